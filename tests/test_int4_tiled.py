"""The tiled storage order of INT4 experts (int4.tile_int4, what kernels/moe_w4a16 reads): its index map written
out element by element, the round trip, dequantization in either order, and who tiles (loader, model)."""

from __future__ import annotations

import pytest
import torch
from model_fixtures import tiny_dir, tiny_model  # noqa: F401

from verifier_service.int4 import Int4Weight, pack_int4, tile_int4, tileable, untile_int4
from verifier_service.moe import ExpertStack, kernel_fits_for, tile_experts


def random_int4(E: int, out: int, inp: int, seed: int = 0) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (E, out, inp), generator=g, dtype=torch.int8)
    return Int4Weight(pack_int4(q), torch.rand(E, out, inp // 32, generator=g).bfloat16(), (out, inp))


def test_tiled_index_map():
    """Row r, word j of expert e sits at flat index ((r/16)·(words/16) + j/16)·256 + (r%16)·16 + j%16 of the
    expert's words; its scale group c at ((r/16)·(groups/4) + c/4)·64 + (r%16)·4 + c%4 (kernels/moe_w4a16.cu:
    TILE_CW, TILE_CS). Checked at every element against that formula."""
    w = random_int4(2, 32, 384)
    packed, scale = tile_int4(w.packed, w.scale)
    assert packed.shape == w.packed.shape and scale.shape == w.scale.shape
    words, groups = w.packed.shape[-1], w.scale.shape[-1]
    for e in range(2):
        flat_w, flat_s = packed[e].flatten(), scale[e].flatten()
        for r in range(32):
            for j in range(words):
                assert flat_w[((r // 16) * (words // 16) + j // 16) * 256 + (r % 16) * 16 + j % 16] == w.packed[e, r, j]
            for c in range(groups):
                assert flat_s[((r // 16) * (groups // 4) + c // 4) * 64 + (r % 16) * 4 + c % 4] == w.scale[e, r, c]


def test_round_trip_and_dequantize_either_order():
    w = random_int4(3, 48, 256, seed=1)
    t = w.tile()
    assert t.tiled and not w.tiled and t.tile() is t
    assert not torch.equal(t.packed, w.packed)  # the order did change
    back = untile_int4(t.packed, t.scale)
    assert torch.equal(back[0], w.packed) and torch.equal(back[1], w.scale)
    assert torch.equal(t.dequantize(torch.float32), w.dequantize(torch.float32))
    assert torch.equal(t.select(2).dequantize(torch.float32), w.select(2).dequantize(torch.float32))


def test_tileable_shapes():
    assert tileable((16, 128), 32) and tileable((2048, 7168), 32) and tileable((7168, 2048), 32)
    assert not tileable((24, 128), 32) and not tileable((16, 96), 32) and not tileable((16, 128), 64)
    with pytest.raises(ValueError, match="tiles"):
        tile_int4(torch.zeros(24, 16, dtype=torch.int32), torch.zeros(24, 4))


def test_kernel_needs_the_tiled_order():
    """The INT4 kernel is chosen only for tiled stacks; tile_experts tiles the INT4 matrices that can be."""
    rows = ExpertStack(random_int4(2, 128, 256), random_int4(2, 128, 256, 1), random_int4(2, 256, 128, 2), first=4)
    assert not kernel_fits_for("cuda", torch.bfloat16, rows)
    assert kernel_fits_for("cuda", torch.bfloat16, rows, tiled=False)
    tiled = tile_experts(rows)
    assert kernel_fits_for("cuda", torch.bfloat16, tiled) and tiled.first == 4
    assert not kernel_fits_for("cpu", torch.bfloat16, tiled) and not kernel_fits_for("cuda", torch.float32, tiled)
    for a, b in zip((rows.gate_proj, rows.up_proj, rows.down_proj), (tiled.gate_proj, tiled.up_proj, tiled.down_proj)):
        assert b.tiled and torch.equal(a.dequantize(torch.float32), b.dequantize(torch.float32))


def test_model_tiles_copies_of_untiled_experts(tiny_model):  # noqa: F811
    """What a kernel model on a GPU does to experts it gets in the row order (model._with_tiled_experts): tiled
    copies of the tileable matrices (the tiny model's gate/up; its down, 64 inputs, is not), the others and the
    caller's weights left as they are, every matrix dequantizing to the same values."""
    from verifier_service.model import _with_tiled_experts

    rows = tiny_model.weights
    tiled = _with_tiled_experts(rows)
    moe = [i for i, layer in enumerate(rows.layers) if hasattr(layer.mlp, "experts")]
    assert moe
    for i in moe:
        for name in ("gate_proj", "up_proj", "down_proj"):
            a, b = getattr(rows.layers[i].mlp.experts, name), getattr(tiled.layers[i].mlp.experts, name)
            assert not a.tiled and b.tiled == tileable(b.shape, b.group_size)
            assert (b is a) == (not b.tiled)
            assert torch.equal(a.dequantize(torch.float32), b.dequantize(torch.float32))
    assert tiled.layers[0] is rows.layers[0] or not hasattr(rows.layers[0].mlp, "experts")  # dense layers kept


@pytest.mark.gpu
def test_loader_tiles_on_gpu_and_model_keeps_its_stacks(tiny_dir, tiny_model):  # noqa: F811
    """On a GPU the loader stores INT4 experts tiled as it reads them, the same weights as the CPU load's row
    order; a kernel model keeps those stacks (no copies)."""
    from verifier_service.model import K2Model
    from verifier_service.weights import load_target_weights

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cpu = tiny_model.weights
    gpu = load_target_weights(tiny_dir, dtype=torch.bfloat16, device="cuda")
    moe = [i for i, layer in enumerate(cpu.layers) if hasattr(layer.mlp, "experts")]
    for i in moe:
        for name in ("gate_proj", "up_proj", "down_proj"):
            a, b = getattr(cpu.layers[i].mlp.experts, name), getattr(gpu.layers[i].mlp.experts, name)
            assert b.tiled == tileable(b.shape, b.group_size) and not a.tiled
            assert torch.equal(a.dequantize(torch.float32), b.dequantize(torch.float32).cpu())
    moved = K2Model(tiny_model.cfg, gpu, use_kernels=True)
    assert all(moved.weights.layers[i].mlp.experts.gate_proj is gpu.layers[i].mlp.experts.gate_proj for i in moe)
