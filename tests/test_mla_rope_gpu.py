"""GPU: kernels/mla_rope against the model's own torch math (verifier_service.rope.apply_rope + cat + indexed
write), bit for bit, and against mla_rope_ref."""

import pytest
import torch

from kernels.mla_rope import mla_rope, mla_rope_ref
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
