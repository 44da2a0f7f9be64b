"""y = x · (q · scale)ᵀ (+ add) for few rows over int8 weights (weight-only, one scale per output row), one launch.

    w8a16_gemm(x, qweight, scale, add=None) -> y   (into `add` when given)
    quantize_int8(w) -> (qweight, scale)                                     the storage this kernel reads

x        [M, K] bf16, rows 16-byte aligned (any such row stride), K % 16 == 0. Any M: up to MAX_ROWS (32 in the
         K-split form) in one weight pass; beyond, blocks of that many rows each stream the weights again.
qweight  [N, K] int8 contiguous, 16-byte aligned, in [-127, 127], columns interleaved within each group of 16
         (`INTERLEAVE`: stored column 16c + p holds input 16c + INTERLEAVE[p]; a tail of K % 16 stays in place)
scale    [N] fp32: W[n, k] = unpacked q[n, k] · scale[n] (`int8_columns` undoes the interleave)
add      [M, N] bf16 contiguous or None: y = bf16(x Wᵀ + add), one rounding
y        [M, N] bf16

Why: the DFlash drafter's Propose is a weight stream (reference/perf.md §3.4: 9.4 GB of bf16 weights and target
lm_head for Kimi's drafter, ~2.2 ms at copy bandwidth, on every decode step's critical path). Stored in int8 the
same parameters are half the bytes. The drafter's outputs only choose which tokens the verifier checks, so a
quantized drafter changes acceptance, never the served tokens. The kernel is kernels/skinny_gemm's tiling and
cluster split of K (compiled in the same unit) over int8 words (kernels/w8a16_gemm.cu): exact int8 -> bf16 in
registers, bf16 MMA, fp32 sums. On Hopper, from WG_FROM_NT token tiles, the same decode feeds warpgroup MMAs
(kernels/w8a16_gemm_sm90.cu). The interleave makes the word ldmatrix hands a lane its whole MMA A fragment, while x
stays in natural order for both kinds of MMA.
"""

from __future__ import annotations

import torch

from kernels import skinny_gemm as sg
from kernels._compile import cuda_source, device_limits, get_kernels, launch, resident_blocks

CODE = ("skinny_gemm.cu", "w8a16_gemm.cu", "w8a16_gemm_sm90.cu")
MAX_NT = 8  # token tiles of 8 per weight pass (the K-split form: 4)
MAX_ROWS = 8 * MAX_NT
# The compiled variants, (form, token tiles NT, weight tiles MT, ring stages ST): "" is the K-split form (warps split K;
# skinny_gemm's tiling; MT 16-row tiles a warp), "_rs" the row-split one (warps split rows, token rows staged once a
# block; MT 16-row tiles a warp), "_wg" / "_wg2" the row-split form on warpgroup MMAs with one / two warpgroups a
# block (sm_90a; MT m64 tiles a warpgroup).
VARIANTS = (*(("", nt, 1, 4) for nt in range(1, 5)), *(("_rs", nt, 4, 3) for nt in range(1, 5)),
            *(("_rs", nt, 2, 3) for nt in range(2, 9)), *(("_rs", nt, 1, 4) for nt in range(5, 9)),
            *((f, nt, mt, st) for nt in range(3, 9) for f, mt, st in (("_wg", 1, 4), ("_wg2", 1, 3), ("_wg2", 2, 2))))
WG_GROUPS = {"_wg": 1, "_wg2": 2}  # warpgroups of a block of the warpgroup-MMA forms


def kernel_name(form: str, nt: int, mt: int, st: int) -> str:
    if form in WG_GROUPS:
        return f"w8a16_gemm_wg<{nt}, {mt}, {st}, {WG_GROUPS[form]}>"
    return f"w8a16_gemm{form}<{nt}, {mt}, {st}, u16>"


NAMES = tuple(kernel_name(*v) for v in VARIANTS)
# Stored column p of each 16-column group holds input INTERLEAVE[p]: bytes 4t .. 4t + 3 of a group = the inputs of the
# m16n8k16 A fragment slots 2t, 2t + 1, 2t + 8, 2t + 9, so that one word decodes into the fragment's two bf16 pairs
# (kernels/w8a16_gemm.cu).
INTERLEAVE = (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15)
CHUNK = 128  # inputs per chunk: must match the .cu (W8_CHUNK)
RS_WARPS = 4  # warps of a row-split block (each 16·MT weight rows)
WG_FROM_NT = 3  # token tiles from which Hopper takes the warpgroup-MMA forms
FORCE: tuple[str, int, int] | None = None  # force (form, MT, ST) of VARIANTS (tests, benches); None: `choose`
CONFIG: tuple[int, int] | None = None  # force the K-split form's (warps, cluster size) (tests); None: `pick_config`
RS_CS: int | None = None  # force the row-split form's cluster size (tests); None: `rs_cluster`
# `rs_cluster`'s cost model: a block's fixed cost (ramp, first stages, cluster sum) in chunks of streaming, and the
# waves a grid larger than the device adds for its last one. Fitted to H200 sweeps of the drafter's fused shapes at
# 8-64 rows (docs/kernel-notes/w8a16_gemm.md, session 37): the best cluster size in 13 of 16 cases, within 1 % in 14.
BLOCK_COST_CHUNKS, WAVE_TAIL = 2, 0.25


def choose(n: int, k: int, nt: int, sms: int, wgmma: bool = False) -> tuple[str, int, int]:
    """(form, MT, ST) for an [n, k] weight and nt token tiles, from H200 sweeps over the drafter's shapes
    (docs/kernel-notes/w8a16_gemm.md). Weights of under two tiles per SM (the context's k|v) take the one-warpgroup
    MMA form on Hopper from WG_FROM_NT token tiles (two warpgroups a block from 6), else the K-split form while it
    holds their rows (4 token tiles), then the row-split form. Others up to
    2 token tiles: long rows (K >= 8192: o, down, fc) and huge weights (lm_head) the row-split form with 4 tiles a
    warp; the rest (q, gate/up) the K-split form for one token tile, the row-split form with 2 tiles a warp for two.
    From WG_FROM_NT token tiles on Hopper, two warpgroups a block sharing the token rows: long rows 2 m64 tiles a
    warpgroup up to 6 token tiles, else 1 m64 tile a warpgroup with 3 stages."""
    tiles = -(-n // 16)
    if tiles < 2 * sms:
        if wgmma and nt >= WG_FROM_NT:
            return ("_wg2", 1, 3) if nt >= 6 else ("_wg", 1, 4)
        return ("", 1, 4) if nt <= 4 else ("_rs", 1, 4)
    if wgmma and nt >= WG_FROM_NT:
        return ("_wg2", 2, 2) if k >= 8192 and nt <= 6 else ("_wg2", 1, 3)
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


def rs_cluster(n: int, k: int, block_rows: int, slots: int) -> int:
    """Blocks per cluster (K split) of the row-split and warpgroup-MMA forms, for blocks of `block_rows` weight rows
    and `slots` resident blocks on the device: the power of two up to 8 (at least 4 chunks a block) with the least
    (chunks a block + BLOCK_COST_CHUNKS) × waves, waves = 1 while the blocks fit the device at once, else
    blocks / slots + WAVE_TAIL (the last, partly filled wave). A small weight gets its K split until it fills the
    device; a large one into blocks short enough to even out its tail (lm_head at 8 rows: 640 whole-K blocks on
    264 slots lose 16 % to 1280 half-K ones)."""
    groups, chunks = -(-n // block_rows), -(-k // CHUNK)
    best, cs = None, 1
    while cs <= 8 and (cs == 1 or chunks >= 4 * cs):
        blocks = groups * cs
        cost = (chunks / cs + BLOCK_COST_CHUNKS) * (1 if blocks <= slots else blocks / slots + WAVE_TAIL)
        if best is None or cost < best[0]:
            best = (cost, cs)
        cs *= 2
    return best[1]


def rs_smem_bytes(warps: int, nt: int, mt: int, st: int) -> int:
    """Dynamic shared memory of a row-split block: ST stages of its warps' weight tiles + one set of token rows."""
    return st * (warps * mt * 2048 + 2048 * nt)


def wg_smem_bytes(groups: int, nt: int, mt: int, st: int) -> int:
    """Dynamic shared memory of a warpgroup-MMA block: ST stages of each warpgroup's MT m64 weight tiles (8 KB each)
    + the token rows, and 1 KB to align the stages to the 128-byte swizzle's 1024-byte atoms."""
    return st * (groups * mt * 8192 + nt * 2048) + 1024


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
    form, mt, st = FORCE or choose(N, K, nt, lim.sms, wgmma=lim.major == 9)
    if form == "":
        nt = min(nt, 4)
    kernel = get_kernels(cuda_source(CODE), NAMES)[kernel_name(form, nt, mt, st)]
    grid_y = -(-M // (8 * nt))  # blocks of 8·nt token rows, each streaming the weights again
    args = (x, x.stride(0), qweight, scale, add, out, M, N, K)
    if form in WG_GROUPS:
        assert lim.major == 9, "the warpgroup-MMA forms are built for sm_90a only"
        groups = WG_GROUPS[form]
        rows, warps, smem = 64 * mt * groups, 4 * groups, wg_smem_bytes(groups, nt, mt, st)
    elif form == "_rs":
        rows, warps, smem = 16 * mt * RS_WARPS, RS_WARPS, rs_smem_bytes(RS_WARPS, nt, mt, st)
    if form:
        cs = RS_CS or rs_cluster(N, K, rows, resident_blocks(kernel, 32 * warps, smem, x.device.index))
        launch(kernel, (-(-N // rows), grid_y), (32, warps), *args, cs, out.stride(0), smem=smem, pdl=sg.PDL,
               cluster=cs)
    else:
        warps, cs = CONFIG or pick_config(N, K, mt, st, lim.sms, lim.smem_block)
        launch(kernel, (-(-N // (16 * mt)), grid_y), (32, warps), *args, cs, out.stride(0),
               smem=smem_bytes(warps, nt, mt, st), pdl=sg.PDL, cluster=cs)
    return out


def w8a16_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                   add: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 product with the dequantized weight (+ add), rounded once to bf16: the kernel differs only by its fp32
    sums (and the scale applied to partial sums)."""
    w = int8_columns(qweight).double() * scale.double()[:, None]
    y = x.double() @ w.T
    if add is not None:
        y += add.double()
        return add.copy_(y.to(torch.bfloat16))
    return y.to(torch.bfloat16)


def _group_order(k: int, order: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Column index map of a [*, k] matrix: `order` within each whole group of 16 columns, a tail kept in place."""
    idx = torch.arange(k, device=device)
    whole = k - k % 16
    idx[:whole] = (idx[:whole].view(-1, 16)[:, list(order)]).reshape(-1)
    return idx


def int8_columns(qweight: torch.Tensor) -> torch.Tensor:
    """The stored weight in input order: undoes `quantize_int8`'s interleave."""
    inverse = tuple(sorted(range(16), key=INTERLEAVE.__getitem__))
    return qweight[:, _group_order(qweight.shape[1], inverse, qweight.device)]


def quantize_int8(w: torch.Tensor, rows_per_pass: int = 16384) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q int8 [N, K], scale fp32 [N]): symmetric per output row, scale = max|w[n]| / 127 (1 for
    an all-zero row), q = round(w / scale) (ties to even), so |w - q·scale| <= scale / 2; q's columns stored in
    the kernel's INTERLEAVE order (a load-time repack: `int8_columns` undoes it). Done `rows_per_pass` rows at a
    time on w's device, so the fp32 copy of a 2.3 GB head never exists whole."""
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    order = _group_order(w.shape[1], INTERLEAVE, w.device)
    for r in range(0, w.shape[0], rows_per_pass):
        part = w[r: r + rows_per_pass].float()
        amax = part.abs().amax(dim=1)
        s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
        q[r: r + rows_per_pass] = torch.round(part[:, order] / s[:, None]).clamp_(-127, 127).to(torch.int8)
        scale[r: r + rows_per_pass] = s
    return q, scale


def dequantize_int8(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q · scale as a [N, K] `dtype` weight in input order (the path for many rows, and CPU)."""
    return (int8_columns(qweight).float() * scale[:, None]).to(dtype)
