"""GPU: kernels/skinny_gemm (bf16 few-row projections) against the exact product (fp64) and against itself
across batch sizes, cluster splits, graphs and programmatic dependent launch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kernels import skinny_gemm as sg
from kernels.skinny_gemm import MAX_ROWS, fits, pick_config, skinny_gemm, skinny_gemm_ref, smem_bytes
from verifier_service.linear import on_kernel, project

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def _sync_every_launch(monkeypatch):
    monkeypatch.setenv("DDTREE_KERNEL_SYNC", "1")  # a device fault fails the launching test


def operands(M: int, N: int, K: int, seed: int, ldx: int | None = None):
    """x [M, K] (a view with row stride ldx when given), w [N, K], add [M, N]; bf16, outputs of order 1."""
    g = torch.Generator("cuda").manual_seed(seed)
    x = torch.randn(M, ldx or K, generator=g, device="cuda").bfloat16()[:, :K]
    w = (torch.randn(N, K, generator=g, device="cuda") / K**0.5).bfloat16()
    return x, w, torch.randn(M, N, generator=g, device="cuda").bfloat16()


def assert_close(got: torch.Tensor, x, w, add=None) -> None:
    """Against the exact sum: one bf16 rounding (2^-8 of the value, half an ulp with margin) plus the fp32
    summation error of K products (2^-18 of Σ|x w|, generous). A dropped or doubled 64-input chunk moves an
    output by ~8/sqrt(K) of its size, far beyond either."""
    exact = x.double() @ w.double().T + (0 if add is None else add.double())
    bound = exact.abs() * 2**-8 + (x.double().abs() @ w.double().abs().T) * 2**-18
    err = (got.double() - exact).abs()
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert (err <= bound).all(), f"worst excess {float((err - bound).max()):.3g} at {int((err - bound).argmax())}"


# K2.6 rank-0 shapes (qkv_a, q_b, o_proj, shared gate/up, shared down) and odd ones: N not a multiple of 16,
# K not a multiple of the 64-input chunk, a single chunk, every token-tile count.
@pytest.mark.parametrize("M, N, K", [(1, 2112, 7168), (3, 1920, 1536), (16, 7168, 1280), (13, 592, 7168),
                                     (9, 7168, 296), (8, 17, 72), (9, 1, 8), (15, 100, 200), (11, 48, 4104),
                                     (16, 24, 64), (2, 40, 136), (25, 592, 7168), (32, 1920, 1280), (21, 2112, 7168)])
def test_skinny_gemm(M, N, K):
    x, w, add = operands(M, N, K, M * 1000 + N + K)
    torch.full((64 << 20,), float("nan"), device="cuda")  # leave NaN in the allocator: unwritten y shows up
    got = skinny_gemm(x.contiguous(), w)
    assert got.shape == (M, N)
    assert_close(got, x, w)
    ref = skinny_gemm_ref(x, w)
    assert ((got.float() - ref.float()).abs() <= ref.float().abs() * 2**-7 + 1e-3).all()  # the reference agrees


@pytest.mark.parametrize("config", [(2, 1), (3, 2), (4, 1), (8, 2), (4, 4), (8, 4), (4, 8), (8, 8)])
def test_skinny_gemm_every_split(config, monkeypatch):
    """Each (warps, cluster size) sums all of K once, with add, a strided x, and more warp slots than chunks."""
    monkeypatch.setattr(sg, "CONFIG", config)
    for M, N, K in ((5, 592, 7168), (16, 48, 296), (1, 32, 64)):
        x, w, add = operands(M, N, K, sum(config) + K, ldx=K + 8)
        assert x.stride(0) == K + 8 and fits(x, w)
        out = add.clone()
        got = skinny_gemm(x, w, out)
        assert got.data_ptr() == out.data_ptr()  # accumulated in place
        assert_close(got, x, w, add)


def test_skinny_gemm_row_does_not_depend_on_its_batch():
    """Every row alone, and inside batches of 3, 9 and 16 rows, gives the same bits: a tree verify's rows project
    exactly as a one-row decode step does (the split depends on N and K only)."""
    x, w, add = operands(16, 600, 7168, 11)
    x = x.contiguous()
    full = skinny_gemm(x[:9], w)
    for r in (0, 3, 7, 8):
        assert torch.equal(skinny_gemm(x[r: r + 1], w)[0], full[r]), r
    assert torch.equal(skinny_gemm(x[6:9], w), full[6:9])
    assert torch.equal(skinny_gemm(x, w)[:9], full)
    assert torch.equal(skinny_gemm(x[5:6], w, add[5:6].clone()), skinny_gemm(x[:9], w, add[:9].clone())[5:6])


@pytest.mark.parametrize("M", [1, 7, 32, 33, 100, 300])
def test_skinny_gemm_fp32_out_and_row_blocks(M):
    """fp32 output (the MoE router's logits: no bf16 rounding, only the fp32 sums' error), rows beyond MAX_ROWS in
    blocks of MAX_ROWS, and every row the same bits as that row alone (batch invariance across row blocks)."""
    x, w, _ = operands(M, 384, 7168, M)
    x = x.contiguous()
    torch.full((64 << 20,), float("nan"), device="cuda")
    got = skinny_gemm(x, w, out_dtype=torch.float32)
    exact = x.double() @ w.double().T
    assert got.dtype == torch.float32 and got.shape == (M, 384)
    err = (got.double() - exact).abs()
    assert (err <= (x.double().abs() @ w.double().abs().T) * 2**-18).all(), float(err.max())
    for r in {0, M // 2, M - 1}:
        assert torch.equal(skinny_gemm(x[r: r + 1], w, out_dtype=torch.float32)[0], got[r]), r
    assert_close(skinny_gemm(x, w), x, w)  # bf16 out, the same row blocks
    scores = skinny_gemm(x, w, out_dtype=torch.float32, sigmoid=True)  # the router's epilogue: |σ'| <= 1/4
    bound = (x.double().abs() @ w.double().abs().T) * 2**-20 + 2**-20  # + expf's and the division's rounding
    assert ((scores.double() - exact.sigmoid()).abs() <= bound).all()
    want = skinny_gemm_ref(x, w, out_dtype=torch.float32, sigmoid=True)
    torch.testing.assert_close(scores, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("early", [False, True])  # the successor resident from the first launch's start
def test_skinny_gemm_chain_in_a_graph(early, monkeypatch):
    """Back-to-back launches (each reads the previous one's output after its griddepcontrol.wait), eager and
    replayed from a CUDA graph: the same bits, and the graph follows new inputs. No sync-every-launch fixture:
    that would hide a missing wait."""
    monkeypatch.delenv("DDTREE_KERNEL_SYNC", raising=False)
    x, w1, _ = operands(4, 2048, 7168, 1)
    _, w2, add = operands(4, 7168, 2048, 2)
    x = x.contiguous()

    def chain(x):
        return skinny_gemm(skinny_gemm(x, w1, early_trigger=early), w2, add.clone(), early_trigger=early)

    want = chain(x)
    assert_close(want, skinny_gemm(x, w1), w2, add)
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = chain(static_x)
    graph.replay()
    assert torch.equal(static_out, want)
    x2 = operands(4, 2048, 7168, 3)[0].contiguous()
    static_x.copy_(x2)
    graph.replay()
    assert torch.equal(static_out, chain(x2))


@pytest.mark.parametrize("T", [1, 3, 16, 32])
def test_skinny_gemm_batched_over_heads(T):
    """MLA's W_UV over heads in one launch, through transposed views: o_lat [T, h, C] -> [h, T, C], W_UV = the
    value rows of kv_b [h, nope + v, C] -> [h, v, C] (batch stride (nope + v)·C), out [T, h, v] -> [h, T, v]. Each
    head: the exact product to one rounding, written in place, and the bits of the 2-D launch on that head's
    contiguous operands (same weight shape, same split)."""
    h, C, nope, v = 10, 512, 128, 128
    g = torch.Generator("cuda").manual_seed(T)
    o_lat = torch.randn(T, h, C, generator=g, device="cuda").bfloat16()
    kv_b = (torch.randn(h, nope + v, C, generator=g, device="cuda") / C**0.5).bfloat16()
    x, w = o_lat.transpose(0, 1), kv_b[:, nope:]
    out = torch.full((T, h, v), float("nan"), device="cuda", dtype=torch.bfloat16)
    assert fits(x, w) and not fits(x, w.transpose(1, 2))
    got = skinny_gemm(x, w, out=out.transpose(0, 1))
    assert got.data_ptr() == out.data_ptr() and got.shape == (h, T, v)
    for head in range(h):
        assert_close(out[:, head], x[head], w[head])
        assert torch.equal(out[:, head], skinny_gemm(x[head].contiguous(), w[head].contiguous())), head
    ref = skinny_gemm_ref(x, w, out=torch.empty_like(out).transpose(0, 1))
    assert ((got.float() - ref.float()).abs() <= ref.float().abs() * 2**-7 + 1e-3).all()  # the reference agrees


@pytest.mark.parametrize("T", [1, 16, 17])
def test_absorb_query_on_skinny_gemm(T):
    """MLA's W_UK absorption with the load-time transposed weight (mla.uk_transposed): q_nope is a column block
    of q [T, h, nope + rope], the output the first C columns of q_abs [T, h, C + rope], both through transposed
    views. Up to UV_SKINNY_MAX_ROWS rows skinny_gemm runs it (T = 17: cuBLAS); either way the exact product to
    one rounding per head, and the rope columns stay untouched."""
    from verifier_service import mla
    from verifier_service.synthetic import k26_config

    cfg = k26_config(1)
    h, nope, rope, C, v = 10, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
    g = torch.Generator("cuda").manual_seed(T)
    kv_b = (torch.randn(h * (nope + v), C, generator=g, device="cuda") / nope**0.5).bfloat16()
    q = torch.randn(T, h, nope + rope, generator=g, device="cuda").bfloat16()
    q_abs = torch.full((T, h, C + rope), float("nan"), device="cuda", dtype=torch.bfloat16)
    weights = SimpleNamespace(kv_b_proj=kv_b)  # all that the absorption reads of MLAWeights
    mla.absorb_query(q[..., :nope], weights, cfg, q_abs, mla.uk_transposed(weights, cfg))
    assert q_abs[..., C:].isnan().all()
    w_uk = kv_b.view(h, nope + v, C)[:, :nope]  # [h, nope, C]
    for head in range(h):
        assert_close(q_abs[:, head, :C], q[:, head, :nope], w_uk[head].T)


def test_skinny_gemm_fits_and_project():
    """What the model's projection falls back to cuBLAS for; project() routes bf16 few-row products here."""
    x, w, add = operands(MAX_ROWS, 64, 128, 5)
    x = x.contiguous()
    assert fits(x, w) and on_kernel(x, w, True) and not on_kernel(x, w, False)
    assert not fits(torch.cat([x, x[:1]]), w)  # too many rows
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    wide = torch.zeros(32 * sms, 128, device="cuda", dtype=torch.bfloat16)  # two 16-row tiles per SM: 16 rows
    assert fits(x[:16], wide) and not fits(x[:17], wide)
    assert not fits(x[:, :120].contiguous(), w[:, :120].contiguous().t().contiguous().t())  # strided weight
    assert not fits(x[:, :124].contiguous(), w[:, :124].contiguous())  # K % 8
    assert not fits(x.float(), w.float()) and not fits(x, w.float()) and not fits(x.cpu(), w.cpu())
    assert not fits(x[:, 1:121], w[:, :120].contiguous())  # x rows not 16-byte aligned
    out = project(x[:3], w, True, add[:3].clone())
    assert_close(out, x[:3], w, add[:3])


def test_pick_config_depends_on_shape_only():
    """The split comes from (N, K, SMs); every warp of a cluster has a chunk where K allows it."""
    for n, k in ((2112, 7168), (1920, 1536), (7168, 1280), (592, 7168), (7168, 296), (16, 8)):
        for sms, smem in ((132, 227 << 10), (188, 99 << 10)):  # H200, RTX PRO 6000 Blackwell (sm_120)
            warps, cs = pick_config(n, k, sms, smem)
            assert 2 <= warps <= 8 and cs in (1, 2, 4, 8) and smem_bytes(warps, MAX_ROWS // 8) <= smem
            assert warps * cs <= max(-(-k // 64), 4)


def test_shared_memory_opt_in_only_grows(monkeypatch):
    """One instantiation launched with 129 KB, then 81 KB, then 129 KB of dynamic shared memory (8, 5, 8 warps at
    16 rows). The opt-in used to be set per launch size: the 81 KB launch lowered the kernel's maximum and the
    next 129 KB launch failed with CUDA_ERROR_INVALID_VALUE."""
    x, w, _ = operands(16, 48, 4096, 9)
    x = x.contiguous()
    for config in ((8, 1), (5, 1), (8, 1)):
        monkeypatch.setattr(sg, "CONFIG", config)
        assert_close(skinny_gemm(x, w), x, w)
