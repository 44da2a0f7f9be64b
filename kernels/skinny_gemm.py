"""bf16 y = x Wᵀ (+ add) for the few rows of a decode or tree-verify step, on tensor cores, one launch.

    skinny_gemm(x, weight, add=None, out_dtype=torch.bfloat16, sigmoid=False) -> y   (into `add` when given)

x       [M, K] bf16, rows 16-byte aligned (any such row stride), K % 8 == 0. Any M; `fits` (the projections'
        test) takes M <= max_rows(N) (16 or 32), where the kernel beats cuBLAS. Beyond MAX_ROWS the rows go in
        blocks of MAX_ROWS, each streaming the weights again (the MoE router's 5.5 MB weight: from L2).
weight  [N, K] bf16 contiguous, 16-byte aligned (nn.Linear's layout)
add     [M, N] bf16 contiguous or None: y = bf16(x Wᵀ + add) with one rounding (cuBLAS's beta = 1)
y       [M, N] bf16, or fp32 (out_dtype=torch.float32, no add: the router's logits, each an fp32 sum of exact
        bf16 products, like F.linear(x.float(), weight.float()) up to the order of the sums); sigmoid (fp32 only):
        1 / (1 + e^-y), the router's scores, in the epilogue, where every block's threads share the 384 of a row
        (in kernels/moe_gate's one-warp select the same took ~5 us, H200)

Why: at 1-32 rows every dense projection of a K2.6 layer is a weight stream (~70 MB a layer and rank). cuBLAS
took ~37 us a MoE layer for ~17 us of bytes (H200), whatever the rows, with split-K GEMMs and a reduce
launch. Here each 16-row weight tile is split over a cluster of blocks along K and summed through
distributed shared memory in a fixed order, in one launch (kernels/skinny_gemm.cu): ~29 us a layer at one
row. The split is chosen from (N, K) only, so every row gets the same bits whatever M is (batch invariance).
Callers must not pass a weight the previous kernel on the stream writes: with PDL the first weight stages
are read before that kernel has finished (model weights are constant).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from kernels._compile import cuda_source, device_limits, get_kernels, launch

CODE = "skinny_gemm.cu"
MAX_NT = 4  # token tiles of 8: up to 32 rows (`max_rows`; beyond, cuBLAS's GEMMs win: BENCHMARKS.md)
_OUT = {torch.bfloat16: "u16", torch.float32: "float"}
NAMES = tuple(f"skinny_gemm<{nt}, {t}>" for t in _OUT.values() for nt in range(1, MAX_NT + 1))
MAX_ROWS = 8 * MAX_NT
STAGES, CHUNK = 4, 64  # must match the .cu (SG_STAGES, SG_CHUNK)
PDL = True  # the weight stages are issued before the wait for the previous kernel
CONFIG: tuple[int, int] | None = None  # force (warps, cluster size) (tests, benches); None: `pick_config`


def fits(x: torch.Tensor, weight: torch.Tensor, any_rows: bool = False) -> bool:
    """Whether skinny_gemm takes these operands, at up to max_rows(N) rows (else use F.linear) or any."""
    return (x.is_cuda and x.dim() == 2 and weight.dim() == 2 and x.dtype == weight.dtype == torch.bfloat16
            and 0 < x.shape[0] and (any_rows or x.shape[0] <= max_rows(weight.shape[0], _sms(x)))
            and x.shape[1] == weight.shape[1] and x.shape[1] % 8 == 0
            and x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
            and weight.is_contiguous() and weight.data_ptr() % 16 == 0)


def max_rows(n: int, sms: int) -> int:
    """Most rows the kernel takes for a weight of n rows: MAX_ROWS where its 16-row tiles are fewer than two per
    SM (8-warp blocks); 16 where they are more (2-warp blocks: K2.6's o_proj, shared down, lm_head), as from 17
    rows cuBLAS is faster there (H200: 24 rows, o_proj 8.9 against 7.6 us, lm_head 118 against 83 us)."""
    return MAX_ROWS if -(-n // 16) < 2 * sms else min(16, MAX_ROWS)


def smem_bytes(warps: int, nt: int) -> int:
    """Dynamic shared memory of one block: its warps' rings (16 weight rows + 8·nt token rows of 128 B a stage)
    + the block sums."""
    return warps * STAGES * (16 + 8 * nt) * 128 + nt * 512


@functools.cache
def pick_config(n: int, k: int, sms: int, smem_max: int = 227 << 10) -> tuple[int, int]:
    """(warps per block, blocks per cluster) for an [n, k] weight, fitted to H200 sweeps (BENCHMARKS.md).
    - At least two 16-row tiles per SM: one block per tile streams its whole K, with 2 warps, or 4 from 64
      chunks of K on (lm_head: 82 against 86 us).
    - Otherwise 8-warp blocks, fewer where a block of MAX_ROWS would not fit `smem_max` (the device's opt-in
      limit: 99 KB on sm_120); the cluster doubles until the blocks cover half the SMs, no warp without a chunk.
    Depends on the weight's shape and the device only, never on the rows (batch invariance)."""
    tiles, chunks = -(-n // 16), -(-k // CHUNK)
    if tiles >= 2 * sms:
        return (4, 1) if chunks >= 64 else (2, 1)
    warps = max(2, min(8, chunks))
    while warps > 1 and smem_bytes(warps, MAX_NT) > smem_max:
        warps -= 1
    cs = 1
    while tiles * cs < sms // 2 and cs < 8 and warps * cs * 2 <= chunks:
        cs *= 2
    return warps, cs


def _sms(x: torch.Tensor) -> int:
    return device_limits(x.device.index).sms


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, add: torch.Tensor | None = None,
                out_dtype: torch.dtype = torch.bfloat16, sigmoid: bool = False) -> torch.Tensor:
    assert fits(x, weight, any_rows=True), (tuple(x.shape), x.stride(), tuple(weight.shape), x.dtype, weight.dtype)
    M, K = x.shape
    N = weight.shape[0]
    if add is None:
        out = x.new_empty(M, N, dtype=out_dtype)
    else:
        assert add.dtype == out_dtype == torch.bfloat16 and add.shape == (M, N) and add.is_contiguous(), add.shape
        out = add
    assert not sigmoid or out_dtype == torch.float32, "the sigmoid epilogue writes fp32"
    lim = device_limits(x.device.index)
    warps, cs = CONFIG or pick_config(N, K, lim.sms, lim.smem_block)
    nt = min(-(-M // 8), MAX_NT)
    ker = get_kernels(cuda_source(CODE), NAMES)[f"skinny_gemm<{nt}, {_OUT[out_dtype]}>"]
    add_ptr = np.uint64(0) if add is None else add  # null: no add
    launch(ker, (-(-N // 16), -(-M // (8 * nt))), (32, warps), x, x.stride(0), weight, add_ptr, out, M, N, K, cs,
           int(sigmoid), smem=smem_bytes(warps, nt), pdl=PDL, cluster=cs)
    return out


def skinny_gemm_ref(x: torch.Tensor, weight: torch.Tensor, add: torch.Tensor | None = None,
                    out_dtype: torch.dtype = torch.bfloat16, sigmoid: bool = False) -> torch.Tensor:
    """fp64 product (+ add) (sigmoid of it), rounded once to out_dtype: the kernel differs only by its fp32 sums."""
    y = x.double() @ weight.double().T
    if add is not None:
        y += add.double()
    return (y.sigmoid() if sigmoid else y).to(out_dtype)
