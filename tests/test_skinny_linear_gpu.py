"""GPU: kernels/skinny_linear against the exact product (fp64, rounded once) and against itself across
batch sizes (a row's result must not depend on how many rows share its launch)."""

from __future__ import annotations

import pytest
import torch
from model_fixtures import tiny_dir, tiny_model  # noqa: F401 (pytest fixtures)

from kernels.skinny_linear import MAX_ROWS, fits, skinny_linear, skinny_linear_ref
from verifier_service.int4 import Int4Weight
from verifier_service.linear import on_kernel, project
from verifier_service.moe import ExpertStack, dense_stack, moe_experts_dense, moe_experts_ref, route

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def _sync_every_launch(monkeypatch):
    monkeypatch.setenv("DDTREE_KERNEL_SYNC", "1")  # a device fault fails the launching test


def operands(M: int, N: int, K: int, seed: int):
    g = torch.Generator("cuda").manual_seed(seed)
    return torch.randn(M, K, generator=g, device="cuda"), torch.randn(N, K, generator=g, device="cuda") / K**0.5


@pytest.mark.parametrize("M, N, K", [(1, 96, 384), (3, 288, 96), (17, 80, 384), (33, 4352, 384), (63, 5, 192),
                                     (64, 1, 1024), (8, 17, 64), (2, 7168, 7168 // 4), (17, 1537, 512)])
def test_skinny_linear(M, N, K):
    x, w = operands(M, N, K, M * 1000 + N + K)
    torch.full((64 << 20,), float("nan"), device="cuda")  # leave NaN in the allocator: unwritten y shows up
    got, want = skinny_linear(x, w), skinny_linear_ref(x, w)
    assert got.shape == (M, N) and got.dtype == torch.float32 and torch.isfinite(got).all()
    # Bound per output: fp32 summation of K products errs by at most ~K * 2^-24 * sum |x_k w_k|; the kernel's
    # sums are ~K / 128 long per thread plus two short trees, so 2^-20 * sum |x_k w_k| is generous yet far
    # below what a dropped or doubled chunk moves (4 of the K products: ~2^-9 of sum |x_k w_k| at K = 1792).
    bound = (x.double().abs() @ w.double().abs().T) * 2**-20
    err = (got.double() - want.double()).abs()
    assert (err <= bound).all(), f"worst excess {float((err - bound).max()):.3g} at {int((err - bound).argmax())}"


def test_skinny_linear_row_does_not_depend_on_its_batch():
    """Every row alone (M = 1), and inside batches of 9 and 64, equals its row of the 33-row result bit for
    bit: a tree verify's rows project exactly as a one-row decode step does."""
    x, w = operands(64, 300, 384, 7)
    full = skinny_linear(x[:33].contiguous(), w)
    for r in (0, 7, 8, 20, 32):
        assert torch.equal(skinny_linear(x[r: r + 1].contiguous(), w)[0], full[r]), r
    assert torch.equal(skinny_linear(x[24:33].contiguous(), w), full[24:33])
    assert torch.equal(skinny_linear(x, w)[:33], full)


def test_skinny_linear_fits():
    """What the model's projection falls back to F.linear for: too many rows, odd widths, mixed dtypes."""
    x, w = operands(MAX_ROWS, 8, 64, 1)
    assert fits(x, w) and not fits(torch.cat([x, x[:1]]), w)
    assert not fits(x[:, :62].contiguous(), w[:, :62].contiguous())  # 248 bytes per row: not 16-byte chunks
    assert not fits(x.bfloat16(), w.bfloat16())  # bf16 is kernels/skinny_gemm's
    assert not fits(x.bfloat16(), w) and not fits(x.cpu(), w.cpu()) and not fits(x[:, 1:33], w[:, 1:33])


@pytest.mark.parametrize("down_by_row", [False, True])
@pytest.mark.parametrize("rows", [1, 17, 64])
def test_dense_moe_through_projections(tiny_model, rows, down_by_row):  # noqa: F811 (pytest fixture)
    """moe_experts_dense with `kernel` (every expert as three skinny projections, router weights folded into
    the activations) against the reference loop on CPU, fp32, for a whole rank and an expert-parallel slice."""
    cfg, w = tiny_model.cfg, tiny_model.weights.layers[2].mlp
    x = torch.randn(rows, cfg.hidden_size, generator=torch.Generator().manual_seed(rows))
    ids, weights = route(x, w, cfg)
    for lo, hi in ((0, w.experts.count), (5, 11)):
        ex = w.experts
        part = ExpertStack(*(Int4Weight(m.packed[lo:hi], m.scale[lo:hi], m.shape, m.tiled)
                             for m in (ex.gate_proj, ex.up_proj, ex.down_proj)), first=ex.first + lo)
        want = moe_experts_ref(x, ids, weights, part)
        dense = dense_stack(ExpertStack(*(Int4Weight(m.packed.cuda(), m.scale.cuda(), m.shape, m.tiled) for m in
                                          (part.gate_proj, part.up_proj, part.down_proj)), part.first), torch.float32,
                            down_by_row=down_by_row)
        assert on_kernel(x.cuda(), dense.gate_proj.reshape(-1, cfg.hidden_size), True)  # the projected path runs
        got = moe_experts_dense(x.cuda(), ids.cuda(), weights.cuda(), dense, kernel=True).cpu()
        assert ((got - want).norm() / want.norm()).item() < 1e-5, (lo, hi)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M", [1, 17, 65])
def test_project_with_add(M, dtype):
    """project(x, w, kernel, add) = x wᵀ + add: on the cuBLAS path one call that accumulates into `add`; checked
    against the fp64 product plus add, rounded once (bf16: within one rounding of the fp32 sum)."""
    N, K = 7168, 296  # K2.6's split shared-expert down projection on one of 7 ranks
    x, w = operands(M, N, K, M + 7)
    add = torch.randn(M, N, device="cuda")
    x, w, add = x.to(dtype), w.to(dtype), add.to(dtype)
    want = (x.double() @ w.double().T + add.double())
    got = project(x, w, True, add.clone())
    assert got.shape == (M, N) and got.dtype == dtype
    tol = 2**-7 if dtype == torch.bfloat16 else 2**-14  # relative to the magnitude of the terms
    scale = x.double().abs() @ w.double().abs().T + add.double().abs()
    assert ((got.double() - want).abs() <= tol * scale).all()
    assert torch.equal(project(x, w, False, add), torch.nn.functional.linear(x, w) + add)
