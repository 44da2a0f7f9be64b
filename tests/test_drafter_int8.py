"""The drafter's int8 weights (drafter_service/int8.py, kernels/w8a16_gemm.quantize_int8) on CPU: the rounding
against brute force, and a quantized drafter against the same drafter built from the dequantized weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from drafter_service.int8 import Int8Linear, quantize_drafter
from drafter_service.synthetic import random_drafter
from kernels import w8a16_gemm as w8
from kernels.w8a16_gemm import dequantize_int8, int8_columns, quantize_int8, w8a16_gemm_ref


def test_quantize_int8_rounds_each_row_to_its_nearest_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 50, generator=g) * torch.rand(37, 1, generator=g) * 3
    w[5] = 0  # an all-zero row keeps scale 1 and q 0
    w[9, 7] = -w[9].abs().max() * 2  # the row's largest magnitude is negative
    stored, scale = quantize_int8(w.bfloat16(), rows_per_pass=8)  # several passes
    q = int8_columns(stored)
    w = w.bfloat16().double()
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and q.shape == w.shape and scale.shape == (37,)
    assert int(q.abs().max()) == 127 and scale[5] == 1 and not q[5].any() and q[9, 7] == -127
    for n in range(37):  # brute force: the scale is max|w| / 127, and q the nearest of the 255 steps
        s = float(w[n].abs().max()) / 127 or 1.0
        assert float(scale[n]) == pytest.approx(s, rel=1e-6)
        # within half a step (no other step is nearer), up to fp32's rounding of w / scale (<= 127 · 2^-23 steps)
        err = (w[n] - q[n].double() * float(scale[n])).abs()
        assert (err <= float(scale[n]) * (0.5 + 127 * 2**-23)).all()


def test_quantize_int8_stores_each_lanes_mma_inputs_together():
    """The stored order the kernels read: in each whole group of 16 columns, stored bytes 4t .. 4t + 3 hold the inputs
    of the m16n8k16 A fragment slots 2t, 2t + 1, 2t + 8, 2t + 9; a tail of K % 16 columns stays in place."""
    w = torch.randn(3, 16 * 3 + 5, generator=torch.Generator().manual_seed(4))
    stored, _ = quantize_int8(w)
    q = int8_columns(stored)
    for c in range(3):
        for t in range(4):
            for j in range(4):
                slot = (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9)[j]
                assert torch.equal(stored[:, 16 * c + 4 * t + j], q[:, 16 * c + slot])
    assert torch.equal(stored[:, 48:], q[:, 48:])


@pytest.mark.parametrize("n, k, rows, slots", [(163840, 7168, 256, 264), (36864, 7168, 256, 264), (7168, 8192, 256, 264),
                                              (2048, 7168, 64, 396), (7168, 256, 256, 264), (128, 128, 256, 264)])
def test_row_split_cluster_is_the_fewest_waves_of_chunks(n, k, rows, slots):
    """rs_cluster against every power of two it may take (1..8, at least 4 chunks of 128 inputs a block): the one with
    the least (chunks a block + BLOCK_COST_CHUNKS) × waves (1, or blocks / slots + WAVE_TAIL past one), the smallest
    on a tie."""
    groups, chunks = -(-n // rows), -(-k // 128)
    allowed = [cs for cs in (1, 2, 4, 8) if cs == 1 or chunks >= 4 * cs]
    waves = {cs: 1 if groups * cs <= slots else groups * cs / slots + w8.WAVE_TAIL for cs in allowed}
    cost = {cs: waves[cs] * (chunks / cs + w8.BLOCK_COST_CHUNKS) for cs in allowed}
    want = min(allowed, key=lambda cs: (cost[cs], cs))
    assert w8.rs_cluster(n, k, rows, slots) == want
    if n == 163840:  # lm_head: 3 waves of whole-K blocks lose to 5 of half-K ones
        assert want == 2


def test_int8_linear_is_the_dequantized_linear():
    g = torch.Generator().manual_seed(1)
    w, b, x = torch.randn(24, 32, generator=g), torch.randn(24, generator=g), torch.randn(2, 3, 32, generator=g)
    lin = Int8Linear.from_weight(w, b)
    stored, scale = quantize_int8(w)
    q = int8_columns(stored)
    want = x @ (q.float() * scale[:, None]).T + b
    assert torch.allclose(lin(x), want, rtol=1e-6, atol=1e-5) and lin(x).shape == (2, 3, 24)
    # the kernel's torch reference is the same product, in fp64, rounded once
    ref = w8a16_gemm_ref(x.reshape(6, 32).bfloat16(), stored, scale)
    assert torch.allclose(ref.float(), (x.reshape(6, 32).bfloat16().double() @ (q.double() * scale.double()[:, None]).T)
                          .bfloat16().float())


def drafter_outputs(m, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Context K/V [layers, B·L, nkv, hd] of 2 sessions × 6 random feature rows, and the logits of a random block
    drafted over them."""
    B, Bk, L = 2, m.cfg.block_size, 6
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(m.vocab_size, (B, Bk), generator=g)
    block_pos = torch.arange(L, L + Bk).expand(B, Bk)
    ctx_pos, ctx_valid = torch.arange(L).expand(B, L), torch.ones(B, L, dtype=torch.bool)
    feats = torch.randn(B * L, m.cfg.feature_width, generator=g)
    k, v = m.context_kv(feats, ctx_pos.reshape(-1))
    kb, vb = k.unflatten(1, (B, L)), v.unflatten(1, (B, L))
    return k, v, m.logits(m.forward_block(ids, block_pos, ctx_pos, ctx_valid, lambda i: (kb[i], vb[i])))


def test_quantized_drafter_equals_drafter_with_dequantized_weights():
    """A drafter after quantize_drafter computes exactly what the original architecture computes from the
    dequantized weights (built independently: each nn.Linear's weight and the lm_head overwritten), and its
    logits stay close to the bf16-free fp32 original's."""
    model = random_drafter("k26-mini", dtype=torch.float32, seed=3)
    twin = random_drafter("k26-mini", dtype=torch.float32, seed=3)
    original = random_drafter("k26-mini", dtype=torch.float32, seed=3)
    for m in twin.modules():
        if isinstance(m, nn.Linear):
            m.weight.copy_(dequantize_int8(*quantize_int8(m.weight), torch.float32))
    twin.lm_head = dequantize_int8(*quantize_int8(twin.lm_head), torch.float32)
    quantize_drafter(model)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    linears = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 1 + 7 * model.cfg.num_hidden_layers + 1 and model.lm_head in linears
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    got, want, orig = (drafter_outputs(m, seed=4)[2] for m in (model, twin, original))
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-3 * float(want.abs().max()))
    assert not torch.equal(got, orig)  # the rounding is real
    assert (got.argmax(-1) == orig.argmax(-1)).float().mean() >= 0.9


def test_drafter_service_loads_int8_weights():
    """`ddtree drafter --quantization int8` (here a synthetic k26-mini on CPU) serves Proposes from Int8Linear
    projections; an unknown storage is refused naming the field."""
    from drafter_service.config import DrafterConfig
    from drafter_service.engine import Proposal, ProposeItem
    from drafter_service.server import load_engine

    with pytest.raises(ValueError, match="quantization"):
        DrafterConfig(synthetic="k26-mini", quantization="fp4")
    engine = load_engine(DrafterConfig(synthetic="k26-mini", quantization="int8", cache_mb=16))
    assert isinstance(engine.model.lm_head, Int8Linear) and isinstance(engine.model.fc, Int8Linear)
    g = torch.Generator().manual_seed(5)
    feats = torch.randn(6, engine.cfg.feature_width, generator=g)
    (result,) = engine.propose([ProposeItem("s", 0, feats, root_token=7, tree_budget=8)])
    assert isinstance(result, Proposal) and len(result.tree.tokens) == 8


@pytest.mark.parametrize("quantize", [False, True])
def test_fused_projections_compute_what_the_separate_ones_do(quantize):
    """Attention.fuse / MLP.fuse (q|k|v and gate|up as one projection each, the served CUDA layout): the same context
    K/V and logits as the checkpoint's separate projections, for nn.Linear and Int8Linear (per-row scales kept), and
    k|v of the context read as rows of the fused tensors, not copies."""
    model = random_drafter("k26-mini", dtype=torch.float32, seed=5)
    plain = random_drafter("k26-mini", dtype=torch.float32, seed=5)
    if quantize:
        quantize_drafter(model), quantize_drafter(plain)
    for layer in model.layers:
        layer.self_attn.fuse()
        layer.mlp.fuse()
    attn = model.layers[0].self_attn
    assert not hasattr(attn, "q_proj") and not hasattr(model.layers[0].mlp, "gate_proj")
    fused_w, kv_w = ((attn.qkv_proj.qweight, attn.kv_proj.qweight) if quantize
                     else (attn.qkv_proj.weight, attn.kv_proj.weight))
    assert kv_w.data_ptr() == fused_w[attn.num_heads * attn.head_dim:].data_ptr()
    for got, want in zip(drafter_outputs(model, seed=6), drafter_outputs(plain, seed=6)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
