"""INT4 pack-quantized format: bit-for-bit agreement with the compressed-tensors library."""

from __future__ import annotations

import pytest
import torch

from verifier_service.int4 import (
    Int4Weight,
    dequantize_int4,
    linear,
    pack_int4,
    quantize_int4_groupwise,
    unpack_int4,
)

helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
ct_quant = pytest.importorskip("compressed_tensors.quantization")
ct_forward = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")


@pytest.fixture
def q() -> torch.Tensor:
    """Random int4 values covering the whole range, -8 included (the top nibble makes words negative)."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(-8, 8, (48, 256), generator=g, dtype=torch.int8)


def test_pack_matches_compressed_tensors(q):
    ours = pack_int4(q)
    assert ours.dtype == torch.int32 and ours.shape == (48, 32)
    assert torch.equal(ours, helpers.pack_to_int32(q, 4))
    assert (ours < 0).any()  # sign bit exercised


def test_unpack_matches_compressed_tensors(q):
    packed = helpers.pack_to_int32(q, 4)
    assert torch.equal(unpack_int4(packed), helpers.unpack_from_int32(packed, 4, q.shape))
    assert torch.equal(unpack_int4(packed), q)


def test_bit_order_is_lsb_first():
    q = torch.tensor([[-8, -7, 0, 1, 2, 3, 4, 7]], dtype=torch.int8)  # nibbles 0,1,8,9,10,11,12,15
    word = pack_int4(q).item() & 0xFFFFFFFF
    assert word == 0xFCBA9810


def test_stacked_experts_round_trip():
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-8, 8, (3, 16, 64), generator=g, dtype=torch.int8)  # [E, out, in]
    packed = pack_int4(q)
    assert packed.shape == (3, 16, 8)
    assert torch.equal(unpack_int4(packed), q)
    assert torch.equal(packed[1], helpers.pack_to_int32(q[1], 4))


def test_pack_rejects_out_of_range():
    with pytest.raises(ValueError):
        pack_int4(torch.full((1, 8), 8, dtype=torch.int8))
    with pytest.raises(ValueError):
        pack_int4(torch.zeros(1, 12, dtype=torch.int8))


def test_dequantize_matches_compressed_tensors():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(32, 128, generator=g)
    packed, scale = quantize_int4_groupwise(w, group=32)
    assert scale.dtype == torch.bfloat16 and scale.shape == (32, 4)
    args = ct_quant.QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    q = helpers.unpack_from_int32(packed, 4, w.shape)
    theirs = ct_forward.dequantize(q, scale, None, args=args)  # bf16: round(q · s)
    assert torch.equal(dequantize_int4(packed, scale, (32, 128), torch.bfloat16), theirs)
    exact = dequantize_int4(packed, scale, (32, 128), torch.float32)
    assert torch.equal(exact.to(torch.bfloat16), theirs)


def test_quantize_round_trip_error_is_within_half_a_step():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 96, generator=g)
    packed, scale = quantize_int4_groupwise(w, group=32)
    back = dequantize_int4(packed, scale, (16, 96), torch.float32)
    step = scale.float().repeat_interleave(32, dim=1)
    assert ((back - w).abs() <= step / 2 + 1e-6).all()
    assert unpack_int4(packed).abs().max() <= 7  # absmax/7 grid: -8 unused, like Kimi's QAT experts


def test_linear_uses_dequantized_weight():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(8, 64, generator=g)
    packed, scale = quantize_int4_groupwise(w)
    x = torch.randn(5, 64, generator=g)
    int4 = Int4Weight(packed, scale, (8, 64))
    assert int4.group_size == 32
    assert torch.allclose(linear(x, int4), x @ dequantize_int4(packed, scale, (8, 64), torch.float32).T)
