"""GPU: kernels/w8a16_gemm (int8 weight-only few-row GEMM) against the exact product of the dequantized weight
(fp64), across row counts, both forms and their tilings, cluster splits, add, and CUDA graph replay."""

from __future__ import annotations

import pytest
import torch

from kernels import w8a16_gemm as w8
from kernels.w8a16_gemm import MAX_ROWS, fits, quantize_int8, w8a16_gemm, w8a16_gemm_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def _sync_every_launch(monkeypatch):
    monkeypatch.setenv("DDTREE_KERNEL_SYNC", "1")  # a device fault fails the launching test


def operands(M: int, N: int, K: int, seed: int, ldx: int | None = None):
    """x [M, K] bf16 (a view with row stride ldx when given), an int8 weight [N, K] with its row scales (rows of
    different magnitude), add [M, N] bf16."""
    g = torch.Generator("cuda").manual_seed(seed)
    x = torch.randn(M, ldx or K, generator=g, device="cuda").bfloat16()[:, :K]
    w = torch.randn(N, K, generator=g, device="cuda") / K**0.5 * torch.rand(N, 1, generator=g, device="cuda") * 4
    q, scale = quantize_int8(w)
    return x, q, scale, torch.randn(M, N, generator=g, device="cuda").bfloat16()


def assert_close(got: torch.Tensor, x, q, scale, add=None) -> None:
    """Against the exact sum with W = q·scale: one bf16 rounding (2^-8 of the value) plus the fp32 summation
    error of K products (2^-18 of Σ|x w|, generous). A dropped, doubled or misplaced 16-input piece moves an
    output by ~4/sqrt(K) of its size, far beyond either."""
    w = w8.int8_columns(q).double() * scale.double()[:, None]
    exact = x.double() @ w.T + (0 if add is None else add.double())
    bound = exact.abs() * 2**-8 + (x.double().abs() @ w.abs().T) * 2**-18
    err = (got.double() - exact).abs()
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert (err <= bound).all(), f"worst excess {float((err - bound).max()):.3g} at {int((err - bound).argmax())}"


# The Kimi DFlash drafter's projections at one or two sessions' block rows (q, k/v, o, gate/up, down, fc, a slice
# of the lm_head) and odd ones: N not a multiple of 16, K one 16-input piece or not a multiple of the 128-input
# chunk, every token-tile count, more rows than one weight pass takes (63 over k/v's K-split form, 70).
@pytest.mark.parametrize("M, N, K", [(8, 8192, 7168), (8, 1024, 7168), (16, 7168, 8192), (16, 18432, 7168),
                                     (8, 7168, 18432), (4, 7168, 43008), (8, 23408, 7168), (1, 17, 16),
                                     (3, 100, 144), (17, 48, 4112), (63, 600, 1024), (33, 40, 7168), (9, 1, 16),
                                     (24, 2112, 7168), (32, 1920, 1280), (63, 1024, 7168), (48, 7168, 8192),
                                     (70, 8192, 7168)])
def test_w8a16_gemm(M, N, K):
    x, q, scale, _ = operands(M, N, K, M * 1000 + N + K)
    torch.full((64 << 20,), float("nan"), device="cuda")  # leave NaN in the allocator: unwritten y shows up
    got = w8a16_gemm(x.contiguous(), q, scale)
    assert got.shape == (M, N) and got.dtype == torch.bfloat16
    assert_close(got, x, q, scale)
    ref = w8a16_gemm_ref(x, q, scale)
    assert ((got.float() - ref.float()).abs() <= ref.float().abs() * 2**-7 + 1e-3).all()  # the reference agrees


@pytest.mark.parametrize("config", [(1, 1), (2, 1), (3, 2), (4, 1), (5, 4), (4, 8), (2, 8)])
def test_w8a16_gemm_every_split(config, monkeypatch):
    """Each (warps, cluster size) of the K-split form sums all of K once, with add, a strided x, and more warp
    slots than chunks."""
    monkeypatch.setattr(w8, "FORCE", ("", 1, 4))
    monkeypatch.setattr(w8, "CONFIG", config)
    for M, N, K in ((5, 592, 7168), (16, 48, 304), (1, 32, 16), (32, 40, 1152)):
        x, q, scale, add = operands(M, N, K, sum(config) + K, ldx=K + 8)
        assert x.stride(0) == K + 8 and fits(x, q, scale)
        out = add.clone()
        got = w8a16_gemm(x, q, scale, out)
        assert got.data_ptr() == out.data_ptr()  # accumulated in place
        assert_close(got, x, q, scale, add)


def test_w8a16_gemm_graph_replay():
    """A CUDA graph replay equals the eager call, and a row's bits do not depend on its place among the rows."""
    x, q, scale, _ = operands(16, 4000, 7168, 5)
    x = x.contiguous()
    got = w8a16_gemm(x, q, scale)
    assert_close(got, x, q, scale)
    static_x = x.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = w8a16_gemm(static_x, q, scale)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, got)
    static_x.copy_(x.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, got.flip(0))


def test_w8a16_gemm_fits():
    x, q, scale, _ = operands(4, 64, 64, 1)
    assert fits(x.contiguous(), q, scale) and MAX_ROWS == 64
    assert not fits(x[:, :48].contiguous()[:, :40], q[:, :40].contiguous(), scale)  # K % 16 != 0
    assert not fits(x.float(), q, scale) and not fits(x, q.float(), scale) and not fits(x, q, scale.bfloat16())


def _forms():
    """Each compiled (form, MT, ST) with the token-tile counts it is compiled for."""
    forms: dict[tuple[str, int, int], list[int]] = {}
    for form, nt, mt, st in w8.VARIANTS:
        forms.setdefault((form, mt, st), []).append(nt)
    return sorted(forms.items())


@pytest.mark.parametrize("variant, nts", _forms())
def test_w8a16_gemm_every_variant(variant, nts, monkeypatch):
    """Each compiled variant at its fewest and most token tiles (and beyond: a second row block), row-split
    clusters of 1, 2 and 4: partial last blocks (N not a multiple of the block's rows), add, a strided x."""
    if variant[0] in w8.WG_GROUPS and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warpgroup-MMA form is built for sm_90a")
    monkeypatch.setattr(w8, "FORCE", variant)
    # beyond: a second row block where the launcher caps the token tiles (the K-split form at 4, every form at 8)
    rows = [8 * min(nts) - 7, 8 * max(nts)] + ([8 * max(nts) + 5] if variant[0] == "" or max(nts) == 8 else [])
    shapes = ((600, 7168), (100, 144), (2048, 1024), (17, 16), (1040, 4112), (48, 256))
    for i, M in enumerate(rows):
        for j, (N, K) in enumerate(shapes[i::2]):
            monkeypatch.setattr(w8, "RS_CS", (1, 2, 4)[(i + j) % 3])
            x, q, scale, add = operands(M, N, K, M * 7 + N, ldx=K + 8)
            out = add.clone()
            assert_close(w8a16_gemm(x, q, scale, out), x, q, scale, add)
            assert_close(w8a16_gemm(x, q, scale), x, q, scale)
