"""`ddtree bench kernels` groups of the drafter's kernels (kernels/bench.py runs them): ddtree_build on
K2.6-vocabulary logits and dflash_attention at Kimi's and the tiny drafter's heads."""

from __future__ import annotations

import torch

from kernels.bench import gpu_time, result_row


# (sessions, depths, k, budget): K2.6's drafter block 8 -> depths 1..7; the engine uses k = budget
# (drafter_service/engine.py); k < budget and depth 15 (block 16) as in earlier sessions.
DDTREE_CASES = ((1, 7, 8, 16), (8, 7, 8, 16), (8, 7, 16, 16), (8, 7, 16, 64), (8, 7, 64, 64), (8, 15, 16, 64),
                (1, 15, 8, 16))


def bench_ddtree(copy_bw: float, build=None) -> list[dict]:
    """ddtree_build on bf16 logits [S, L, 163840] (randn x 3), rotating enough copies that the
    calls do not hit L2 (H200: 50 MB). `build` times another implementation of the same signature."""
    from kernels.ddtree_build import ddtree_build, ddtree_build_ref

    build = build or ddtree_build
    rows = []
    for S, L, k, budget in DDTREE_CASES:
        one = S * L * 163840 * 2
        n = min(32, -(-128 * 10**6 // one))
        copies = [(torch.randn(S, L, 163840, device="cuda") * 3).bfloat16() for _ in range(n)]
        t = gpu_time([lambda x=x: build(x, k, budget) for x in copies])
        t_ref = gpu_time([lambda: ddtree_build_ref(copies[0], k, budget)], reps=3, graph=False)
        rows.append(result_row("ddtree_build", f"sessions={S} depth={L} k={k} budget={budget}", t, one, copy_bw, t_ref))
    return rows


# (sessions, context pages of 64 keys, q heads, kv heads, head dim): Kimi's DFlash drafter (64 / 8 x 128) at 1K
# and 4K context, 8 sessions; the tiny drafter (6 / 2 x 64). Block 8.
DFLASH_CASES = ((1, 16, 64, 8, 128), (1, 65, 64, 8, 128), (8, 65, 64, 8, 128), (1, 4, 6, 2, 64))


def bench_dflash(copy_bw: float) -> list[dict]:
    """dflash_attention against its reference; bytes = the visible keys' K and V (4 copies rotated: > L2)."""
    from kernels.dflash_attention import dflash_attention, dflash_attention_ref

    rows = []
    for B, pages, nh, nkv, hd in DFLASH_CASES:
        slots, Bk = B * pages * 64, 8
        cases = []
        for _ in range(4):
            pool = torch.randn(2, slots, nkv, hd, device="cuda").bfloat16()
            table = torch.randperm(B * pages, device="cuda").view(B, pages)
            q = torch.randn(B, Bk, nh, hd, device="cuda").bfloat16()
            blk = torch.randn(2, B, Bk, nkv, hd, device="cuda").bfloat16()
            mask = torch.ones(B, 1, pages * 64 + Bk, dtype=torch.bool, device="cuda").expand(-1, Bk, -1)
            cases.append((q, pool[0], pool[1], table, 64, blk[0], blk[1], mask, hd**-0.5))
        t = gpu_time([lambda c=c: dflash_attention(*c) for c in cases])
        t_ref = gpu_time([lambda: dflash_attention_ref(*cases[0])], reps=5, graph=False)
        nbytes = B * (pages * 64 + Bk) * nkv * hd * 2 * 2
        rows.append(result_row("dflash_attention", f"sessions={B} keys={pages * 64} heads={nh}/{nkv}x{hd}", t, nbytes,
                               copy_bw, t_ref))
    return rows


# (N, K) of the Kimi DFlash drafter's projections as served (model.py: Attention.fuse, MLP.fuse) and the lm_head its
# logits multiply by: q|k|v of a block, k|v of the context, o, gate|up, down, fc (6 target layers x 7168 inputs),
# lm_head.
DRAFTER_GEMMS = ((10240, 7168), (2048, 7168), (7168, 8192), (36864, 7168), (7168, 18432), (7168, 43008),
                 (163840, 7168))


def bench_linear_int8(copy_bw: float) -> list[dict]:
    """w8a16_gemm (the drafter's `--quantization int8`) at a Propose's rows (8 per session) against F.linear
    (cuBLAS) over the bf16 weight, what the bf16 drafter runs; bytes = int8 weight + row scales + x + y. The
    calls rotate over >= 256 MB of weights (copies_past_l2), so every weight comes from HBM."""
    import torch.nn.functional as F

    from kernels.bench import copies_past_l2
    from kernels.w8a16_gemm import quantize_int8, w8a16_gemm

    rows = []
    for N, K in DRAFTER_GEMMS:
        n = copies_past_l2(N * K)
        ws = [(torch.randn(N, K, device="cuda") * K**-0.5).bfloat16() for _ in range(n)]
        qs = [quantize_int8(w) for w in ws]
        for M in (1, 8, 16, 32, 64):
            xs = [torch.randn(M, K, device="cuda").bfloat16() for _ in range(n)]
            t = gpu_time([lambda x=x, q=q: w8a16_gemm(x, *q) for x, q in zip(xs, qs)])
            t_ref = gpu_time([lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, ws)])
            nbytes = N * K + 4 * N + (M * K + M * N) * 2
            rows.append(result_row("w8a16_gemm", f"rows={M} N={N} K={K}", t, nbytes, copy_bw, t_ref))
        del ws, qs
    return rows
