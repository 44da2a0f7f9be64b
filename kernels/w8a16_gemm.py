"""y = x · (q · scale)ᵀ (+ add) for few rows over int8 weights (weight-only, one scale per output row), one launch.

    w8a16_gemm(x, qweight, scale, add=None) -> y   (into `add` when given)
    quantize_int8(w) -> (qweight, scale)                                     the storage this kernel reads

x        [M, K] bf16, rows 16-byte aligned (any such row stride), K % 16 == 0. Any M: up to MAX_ROWS (32 in the
         K-split form) in one weight pass; beyond, blocks of that many rows each stream the weights again.
qweight  [N, K] int8 contiguous, 16-byte aligned: q[n, k] in [-127, 127]
scale    [N] fp32: W[n, k] = q[n, k] · scale[n]
add      [M, N] bf16 contiguous or None: y = bf16(x Wᵀ + add), one rounding
y        [M, N] bf16

Why: the DFlash drafter's Propose is a weight stream (reference/perf.md §3.4: 9.4 GB of bf16 weights and target
lm_head for Kimi's drafter, ~2.2 ms at copy bandwidth, on every decode step's critical path). Stored in int8 the
same parameters are half the bytes. The drafter's outputs only choose which tokens the verifier checks, so a
quantized drafter changes acceptance, never the served tokens. The kernel is kernels/skinny_gemm's tiling and
cluster split of K (compiled in the same unit) over int8 words (kernels/w8a16_gemm.cu): exact int8 -> bf16 in
registers, bf16 MMA, fp32 sums.
"""

from __future__ import annotations

import torch

from kernels import skinny_gemm as sg
from kernels._compile import cuda_source, device_limits, get_kernels, launch

CODE = ("skinny_gemm.cu", "w8a16_gemm.cu")
MAX_NT = 8  # token tiles of 8 per weight pass (the K-split form: 4)
MAX_ROWS = 8 * MAX_NT
# The compiled variants, (form, token tiles NT, weight tiles per warp MT, ring stages ST): "" is the K-split form
# (warps split K; skinny_gemm's tiling), "_rs" the row-split one (warps split rows, token rows staged once a block).
VARIANTS = (*(("", nt, 1, 4) for nt in range(1, 5)), *(("_rs", nt, 4, 3) for nt in range(1, 5)),
            *(("_rs", nt, 2, 3) for nt in range(2, 9)), *(("_rs", nt, 1, 4) for nt in range(5, 9)))
NAMES = tuple(f"w8a16_gemm{f}<{nt}, {mt}, {st}, u16>" for f, nt, mt, st in VARIANTS)
CHUNK = 128  # inputs per chunk: must match the .cu (W8_CHUNK)
RS_WARPS = 4  # warps of a row-split block (each 16·MT weight rows)
FORCE: tuple[str, int, int] | None = None  # force (form, MT, ST) of VARIANTS (tests, benches); None: `choose`
CONFIG: tuple[int, int] | None = None  # force the K-split form's (warps, cluster size) (tests); None: `pick_config`
RS_CS: int | None = None  # force the row-split form's cluster size (tests); None: `rs_cluster`


def choose(n: int, k: int, nt: int, sms: int) -> tuple[str, int, int]:
    """(form, MT, ST) for an [n, k] weight and nt token tiles, from an H200 sweep over the drafter's shapes
    (BENCHMARKS.md, session 35): weights of under two tiles per SM (k/v) take the K-split form while it holds their
    rows; long rows (K >= 8192: o, down, fc) and huge weights (lm_head) the row-split form with 4 tiles a warp; the
    rest (q, gate/up: K = 7168) the K-split form for one token tile, the row-split form with 2 tiles a warp above."""
    tiles = -(-n // 16)
    if tiles < 2 * sms:
        return ("", 1, 4) if nt <= 4 else ("_rs", 1, 4)
    if k >= 8192 or tiles >= 16 * sms:
        return ("_rs", 4, 3) if nt <= 4 else ("_rs", 2, 3)
    return ("", 1, 4) if nt == 1 else ("_rs", 2, 3)


def smem_bytes(warps: int, nt: int, mt: int, st: int) -> int:
    """Dynamic shared memory of a K-split block: its warps' rings (16·mt weight rows of 128 B + 8·nt token rows of
    256 B a stage) + the block sums."""
    return warps * st * 2048 * (mt + nt) + nt * 512


def pick_config(n: int, k: int, mt: int, st: int, sms: int, smem_max: int = 227 << 10) -> tuple[int, int]:
    """(warps per block, blocks per cluster) of the K-split form: skinny_gemm's rule for blocks of 16·mt rows and
    the same weight bytes per chunk (a 128-input int8 chunk of 16 rows is the 64-input bf16 chunk's 2 KB), with
    fewer warps where a block of 4 token tiles would not fit."""
    warps, cs = sg.pick_config(-(-n // mt), k // 2, sms, smem_max)
    while warps > 1 and smem_bytes(warps, 4, mt, st) > smem_max:
        warps -= 1
    return warps, cs


def rs_cluster(n: int, k: int, mt: int, sms: int) -> int:
    """Blocks per cluster of the row-split form: K split until the blocks cover two per SM (at most 8, and at
    least 8 chunks a block)."""
    groups, chunks, cs = -(-n // (16 * mt * RS_WARPS)), -(-k // CHUNK), 1
    while groups * cs < 2 * sms and cs < 8 and chunks >= 16 * cs:
        cs *= 2
    return cs


def rs_smem_bytes(warps: int, nt: int, mt: int, st: int) -> int:
    """Dynamic shared memory of a row-split block: ST stages of its warps' weight tiles + one set of token rows."""
    return st * (warps * mt * 2048 + 2048 * nt)


def fits(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether w8a16_gemm takes these operands."""
    M, K = x.shape if x.dim() == 2 else (0, 0)
    return (x.dim() == 2 and x.is_cuda and x.dtype == torch.bfloat16 and M > 0 and K % 16 == 0
            and x.stride(-1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
            and qweight.dtype == torch.int8 and qweight.dim() == 2 and qweight.shape[1] == K
            and qweight.is_contiguous() and qweight.data_ptr() % 16 == 0 and qweight.device == x.device
            and scale.dtype == torch.float32 and scale.shape == qweight.shape[:1] and scale.is_contiguous())


def w8a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
               add: torch.Tensor | None = None) -> torch.Tensor:
    assert fits(x, qweight, scale), (tuple(x.shape), x.stride(), x.dtype, tuple(qweight.shape), qweight.dtype)
    (M, K), N = x.shape, qweight.shape[0]
    if add is not None:
        assert add.dtype == torch.bfloat16 and add.shape == (M, N) and add.is_contiguous(), add.shape
        out = add
    else:
        out = x.new_empty((M, N))
    lim = device_limits(x.device.index)
    nt = min(-(-M // 8), MAX_NT)
    form, mt, st = FORCE or choose(N, K, nt, lim.sms)
    if form == "":
        nt = min(nt, 4)
    kernel = get_kernels(cuda_source(CODE), NAMES)[f"w8a16_gemm{form}<{nt}, {mt}, {st}, u16>"]
    grid_y = -(-M // (8 * nt))  # blocks of 8·nt token rows, each streaming the weights again
    if form == "_rs":
        cs = RS_CS or rs_cluster(N, K, mt, lim.sms)
        launch(kernel, (-(-N // (16 * mt * RS_WARPS)), grid_y), (32, RS_WARPS), x, x.stride(0), qweight, scale, add,
               out, M, N, K, cs, out.stride(0), smem=rs_smem_bytes(RS_WARPS, nt, mt, st), pdl=sg.PDL, cluster=cs)
    else:
        warps, cs = CONFIG or pick_config(N, K, mt, st, lim.sms, lim.smem_block)
        launch(kernel, (-(-N // (16 * mt)), grid_y), (32, warps), x, x.stride(0), qweight, scale, add, out, M, N, K,
               cs, out.stride(0), smem=smem_bytes(warps, nt, mt, st), pdl=sg.PDL, cluster=cs)
    return out


def w8a16_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                   add: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 product with the dequantized weight (+ add), rounded once to bf16: the kernel differs only by its fp32
    sums (and the scale applied to partial sums)."""
    w = qweight.double() * scale.double()[:, None]
    y = x.double() @ w.T
    if add is not None:
        y += add.double()
        return add.copy_(y.to(torch.bfloat16))
    return y.to(torch.bfloat16)


def quantize_int8(w: torch.Tensor, rows_per_pass: int = 16384) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q int8 [N, K], scale fp32 [N]): symmetric per output row, scale = max|w[n]| / 127 (1 for
    an all-zero row), q = round(w / scale) (ties to even), so |w - q·scale| <= scale / 2. Done `rows_per_pass`
    rows at a time on w's device, so the fp32 copy of a 2.3 GB head never exists whole."""
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for r in range(0, w.shape[0], rows_per_pass):
        part = w[r: r + rows_per_pass].float()
        amax = part.abs().amax(dim=1)
        s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
        q[r: r + rows_per_pass] = torch.round(part / s[:, None]).clamp_(-127, 127).to(torch.int8)
        scale[r: r + rows_per_pass] = s
    return q, scale


def dequantize_int8(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q · scale as a [N, K] `dtype` weight (the path for many rows, and CPU)."""
    return (qweight.float() * scale[:, None]).to(dtype)

