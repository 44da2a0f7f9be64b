"""GPU: MLA's RoPE in kernels against the model's own torch math (verifier_service.rope.apply_rope + cat + indexed
write), bit for bit, and against the references: kernels/mla_rope, kernels/rms_norm latent_norms (the latent cache
write with the norms) and kernels/mla_tree_attention's own rotation of the query."""

import pytest
import torch

from kernels import mla_tree_attention as mla_mod
from kernels.bench import mla_case
from kernels.mla_rope import mla_rope, mla_rope_ref
from kernels.mla_tree_attention import mla_tree_attention, mla_tree_attention_ref
from kernels.rms_norm import latent_norms, latent_norms_ref, rms_norm_pair
from kernels.skinny_gemm import skinny_gemm
from verifier_service.rope import apply_rope

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def _sync_every_launch(monkeypatch):
    monkeypatch.setenv("DDTREE_KERNEL_SYNC", "1")  # a device fault fails the launching test


def case(T: int, h: int, nope: int, R: int, C: int, dtype: torch.dtype, slots_total: int = 300):
    g = torch.Generator("cuda").manual_seed(T * 100 + h)
    q = torch.randn(T, h, nope + R, generator=g, device="cuda").to(dtype)
    kv = torch.randn(T, C + R, generator=g, device="cuda").to(dtype)
    c = torch.randn(T, C, generator=g, device="cuda").to(dtype)
    positions = torch.randint(0, 70000, (T,), generator=g, device="cuda")
    inv_freq = 1.0 / (50000.0 ** (torch.arange(0, R, 2, device="cuda").float() / R))
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos() * 1.1, angles.sin() * 1.1  # an amplitude != 1, as YaRN folds one in
    cache = torch.full((slots_total, C + R), float("nan"), device="cuda").to(dtype)  # unwritten rows stay NaN
    slots = torch.randperm(slots_total, generator=g, device="cuda")[:T]
    return q, kv, c, cos, sin, cache, slots


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T, h, nope, R, C", [(1, 10, 128, 64, 512), (3, 10, 128, 64, 512), (17, 64, 128, 64, 512),
                                              (63, 1, 128, 64, 512), (17, 6, 32, 16, 64), (5, 3, 8, 2, 8)])
@pytest.mark.parametrize("wide", [False, True])  # kv a column block of wider rows (the fused latent projection)
def test_mla_rope_equals_the_model_math(T, h, nope, R, C, dtype, wide):
    q, kv, c, cos, sin, cache, slots = case(T, h, nope, R, C, dtype)
    if wide:  # NaN around the block: a read outside it shows
        nan = torch.full((T, 7), float("nan"), dtype=dtype, device="cuda")
        kv = torch.cat([nan, kv, nan[:, :5]], dim=-1)[:, 7: 7 + C + R]
    want_cache = cache.clone()
    want_cache[slots] = torch.cat([c, apply_rope(kv[:, C:], cos, sin)], dim=-1)  # as mla_forward writes it
    want_q = apply_rope(q[..., nope:], cos[:, None, :], sin[:, None, :])
    got_q = mla_rope(q, kv, c, cos, sin, cache, slots)
    assert torch.equal(got_q, want_q)
    assert torch.equal(cache[slots], want_cache[slots])
    untouched = torch.ones(cache.shape[0], dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert cache[untouched].isnan().all()
    ref_cache = torch.full_like(cache, float("nan"))
    assert torch.equal(mla_rope_ref(q, kv, c, cos, sin, ref_cache, slots), got_q)
    assert torch.equal(ref_cache[slots], cache[slots])


def test_mla_rope_empty():
    q, kv, c, cos, sin, cache, slots = case(0, 10, 128, 64, 512, torch.bfloat16)
    assert mla_rope(q, kv, c, cos, sin, cache, slots).shape == (0, 10, 64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T, h", [(1, 10), (17, 6), (3, 1)])
def test_mla_rope_writes_into_the_absorbed_query(T, h, dtype):
    """out = the rope columns of a [T, h, C + R] buffer (strided view): the same values as the returned tensor
    without out, and the buffer's other columns untouched."""
    nope, R, C = 128, 64, 512
    q, kv, c, cos, sin, cache, slots = case(T, h, nope, R, C, dtype)
    want = mla_rope(q, kv, c, cos, sin, cache.clone(), slots)
    q_abs = torch.full((T, h, C + R), float("nan"), device="cuda").to(dtype)
    got = mla_rope(q, kv, c, cos, sin, cache, slots, out=q_abs[..., C:])
    assert got.data_ptr() == q_abs[..., C:].data_ptr()
    assert torch.equal(q_abs[..., C:], want)
    assert q_abs[..., :C].isnan().all()
    ref_abs = torch.full_like(q_abs, float("nan"))
    mla_rope_ref(q, kv, c, cos, sin, torch.full_like(cache, float("nan")), slots, out=ref_abs[..., C:])
    assert torch.equal(ref_abs[..., C:], want)


def latent_case(T: int, q_lora: int, C: int, R: int, dtype: torch.dtype, wide: bool):
    """The fused latent projection's output [T, q_lora + C + R] (NaN around it when wide) and its pieces."""
    q, kv, _, cos, sin, cache, slots = case(T, 3, 8, R, C, dtype)
    g = torch.Generator("cuda").manual_seed(T)
    qkv = torch.cat([torch.randn(T, q_lora, generator=g, device="cuda").to(dtype), kv], dim=-1)
    if wide:  # a column block of wider rows, NaN on both sides
        nan = torch.full((T, 8), float("nan"), dtype=dtype, device="cuda")
        qkv = torch.cat([nan, qkv, nan], dim=-1)[:, 8: 8 + q_lora + C + R]
    w1 = (1 + 0.1 * torch.randn(q_lora, generator=g, device="cuda")).to(dtype)
    w2 = (1 + 0.1 * torch.randn(C, generator=g, device="cuda")).to(dtype)
    return qkv[:, :q_lora], w1, qkv[:, q_lora:], w2, cos, sin, cache, slots


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 3, 17, 63])
@pytest.mark.parametrize("q_lora, C, R", [(1536, 512, 64), (96, 64, 16)])
@pytest.mark.parametrize("wide", [False, True])
def test_latent_norms_write_the_cache_rows(T, q_lora, C, R, dtype, wide):
    """latent_norms = rms_norm_pair's two norms (bit for bit), the second written at the slots with its rope tail
    rotated as the model rotates it (apply_rope, bit for bit); every other cache row untouched (NaN)."""
    x1, w1, kv, w2, cos, sin, cache, slots = latent_case(T, q_lora, C, R, dtype, wide)
    want_q, want_c = rms_norm_pair(x1, w1, kv[:, :C], w2, 1e-6)
    got_q = latent_norms(x1, w1, kv, w2, 1e-6, cos, sin, cache, slots)
    assert torch.equal(got_q, want_q)
    assert torch.equal(cache[slots], torch.cat([want_c, apply_rope(kv[:, C:], cos, sin)], dim=-1))
    untouched = torch.ones(cache.shape[0], dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert cache[untouched].isnan().all()
    ref_cache = torch.full_like(cache, float("nan"))
    ref_q = latent_norms_ref(x1, w1, kv, w2, 1e-6, cos, sin, ref_cache, slots)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.02, rtol=0.02)  # sum order, bf16 ties
    torch.testing.assert_close(ref_q, got_q, **tol)
    torch.testing.assert_close(ref_cache[slots], cache[slots], **tol)
    assert torch.equal(ref_cache[slots][:, C:], cache[slots][:, C:])


def rope_source(T: int, h: int, seed: int):
    """q_b's output [T, h, 192] with NaN in its nope part (the kernel must read only the rope columns), the rope
    view [T, h, 64] and its angles [T, 32] (amplitude folded in)."""
    g = torch.Generator("cuda").manual_seed(seed)
    q = torch.randn(T, h, 192, generator=g, device="cuda").bfloat16()
    q[..., :128] = float("nan")
    angles = torch.randint(0, 70000, (T, 1), generator=g, device="cuda").float() * torch.rand(32, generator=g,
                                                                                               device="cuda")
    return q[..., 128:], angles.cos() * 1.1, angles.sin() * 1.1


@pytest.mark.parametrize("rows,prefixes,heads", [([1], [0], 10), ([3], [5], 1), ([17], [1000], 10),
                                                 ([1, 3, 17], [5, 300, 4097], 9), ([1], [40000], 10)])
@pytest.mark.parametrize("config", mla_mod.CONFIGS)
def test_tree_attention_rotates_the_query(config, rows, prefixes, heads, monkeypatch):
    """rope = (q_pe, cos, sin): the kernel rotates the query's rope part as it loads it. Bit for bit the same call
    on the query rotated by the model's apply_rope beforehand, on every compiled instance; near the reference."""
    monkeypatch.setattr(mla_mod, "CONFIG", config)
    q, *plan = mla_case(rows, prefixes, heads, 64, seed=sum(rows) + heads)
    q_pe, cos, sin = rope_source(q.shape[0], heads, seed=len(rows))
    full = torch.cat([q[..., :512], apply_rope(q_pe, cos[:, None, :], sin[:, None, :])], dim=-1)
    got = mla_tree_attention(q[..., :512].contiguous(), *plan, 0.14467963, rope=(q_pe, cos, sin))
    assert torch.equal(got, mla_tree_attention(full, *plan, 0.14467963))
    want = mla_tree_attention_ref(q[..., :512].contiguous(), *plan, 0.14467963, rope=(q_pe, cos, sin))
    assert torch.equal(want, mla_tree_attention_ref(full, *plan, 0.14467963))
    o, r = got.double(), want.double()
    assert torch.isfinite(o).all() and (o - r).norm() / r.norm() < 1e-2  # bf16 P and output, fp32 softmax


@pytest.mark.parametrize("graph", [False, True])
def test_tree_attention_in_the_served_order(graph, monkeypatch):
    """The served order: latent_norms writes the tree rows' cache rows, W_UK's skinny_gemm (early_trigger: the
    attention becomes resident as it starts) writes the absorbed query, the attention (PDL, whole-prefix tiles read
    before its griddepcontrol.wait) rotates the query's rope part itself. It must see both writes, eagerly and from a
    graph replayed on new inputs. No sync-every-launch fixture: that would hide a missing wait."""
    monkeypatch.delenv("DDTREE_KERNEL_SYNC", raising=False)
    cases = [mla_case(r, p, 10, 64, seed=i) for i, (r, p) in enumerate([([1], [40000]), ([3], [5000]), ([8], [9000])])]
    g = torch.Generator("cuda").manual_seed(7)
    w_uk = (torch.randn(10, 512, 128, generator=g, device="cuda") / 128**0.5).bfloat16()  # skinny_gemm's [h, C, nope]
    inputs = []
    for i, (q, *plan) in enumerate(cases):
        T = q.shape[0]
        x1, w1, kv, w2, cos, sin, _, _ = latent_case(T, 1536, 512, 64, torch.bfloat16, wide=True)
        q_nope = torch.randn(10, T, 128, generator=g, device="cuda").bfloat16()  # [h, T, nope]
        q_abs = torch.empty(T, 10, 512, dtype=torch.bfloat16, device="cuda")
        inputs.append((q_abs, q_nope, rope_source(T, 10, seed=i)[0], x1, w1, kv, w2, cos, sin))

    def step():
        outs = []
        for (_, kv_cache, *plan), (q_abs, q_nope, q_pe, x1, w1, kv, w2, cos, sin) in zip(cases, inputs):
            latent_norms(x1, w1, kv, w2, 1e-6, cos, sin, kv_cache.view(-1, 576), plan[-1])
            skinny_gemm(q_nope, w_uk, out=q_abs.transpose(0, 1), early_trigger=True)
            outs.append(mla_tree_attention(q_abs, kv_cache, *plan, 0.14467963, rope=(q_pe, cos, sin)))
        return outs

    outs = step()
    if graph:
        cg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cg):
            outs = step()
        for tensors in inputs:  # new inputs in place: new tree latents and query on replay
            for t in (tensors[1], tensors[2], tensors[5], tensors[7]):
                t.copy_(torch.randn_like(t, dtype=torch.float32).to(t.dtype))
        cg.replay()
    torch.cuda.synchronize()
    for out, (_, kv_cache, *plan), (q_abs, q_nope, q_pe, *_, cos, sin) in zip(outs, cases, inputs):
        assert torch.equal(q_abs.transpose(0, 1), skinny_gemm(q_nope, w_uk))  # what W_UK wrote, on this replay
        want = mla_tree_attention_ref(q_abs, kv_cache, *plan, 0.14467963, rope=(q_pe, cos, sin))
        o, r = out.double(), want.double()
        assert torch.isfinite(o).all() and (o - r).norm() / r.norm() < 1e-2
