"""bf16 y = x Wᵀ (+ add) for the few rows of a decode or tree-verify step, on tensor cores, one launch.

    skinny_gemm(x, weight, add=None, out_dtype=torch.bfloat16, sigmoid=False, out=None, early_trigger=False) -> y
                                                                    (into `add` or `out` when given)

x       [M, K] bf16, rows 16-byte aligned (any such row stride), K % 8 == 0. Any M; `fits` (the projections'
        test) takes M <= max_rows(N) (16 or 32), where the kernel beats cuBLAS. Beyond MAX_ROWS the rows go in
        blocks of MAX_ROWS, each streaming the weights again (the MoE router's 5.5 MB weight: from L2).
weight  [N, K] bf16 contiguous, 16-byte aligned (nn.Linear's layout)
add     [M, N] bf16 contiguous or None: y = bf16(x Wᵀ + add) with one rounding (cuBLAS's beta = 1)
y       [M, N] bf16, or fp32 (out_dtype=torch.float32, no add: the router's logits, each an fp32 sum of exact
        bf16 products, like F.linear(x.float(), weight.float()) up to the order of the sums); sigmoid (fp32 only):
        1 / (1 + e^-y), the router's scores, in the epilogue, where every block's threads share the 384 of a row
        (in kernels/moe_gate's one-warp select the same took ~5 us, H200)

early_trigger: the next kernel (PDL) may become resident as this one starts, not when its weight stream ends; it
        still waits for this one's end before reading. For a successor with work before its wait: the tree
        attention after MLA's W_UK loads its prefix tiles meanwhile (H200, verify step of 16 / 61 layers: 4-16 rows
        -0.4 to -1.1 %, 1 and 64 rows unchanged). Not for a skinny_gemm successor: with every launch so, the step
        took +3.6 % at 1 row (their weight streams compete).

Batched: x [B, M, K], weight [B, N, K], y [B, M, N] (`out` may be a strided view, rows 1 element apart inside a
row): one launch for B products, blockIdx.z = b; any batch strides, x's and y's row strides as above (MLA's W_UV
over heads reads o_lat [T, h, C] and writes [T, h, v] through transposed views). No add then.

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
    """Whether skinny_gemm takes these operands (2-D, or batched 3-D), at up to max_rows(N) rows (else use
    F.linear / torch.matmul) or any."""
    batched = x.dim() == 3 and weight.dim() == 3 and x.shape[0] == weight.shape[0] > 0
    if not (batched or x.dim() == weight.dim() == 2):
        return False
    M, K, N = x.shape[-2], x.shape[-1], weight.shape[-2]
    return (x.is_cuda and x.dtype == weight.dtype == torch.bfloat16 and 0 < M
            and (any_rows or M <= max_rows(N, _sms(x))) and weight.shape[-1] == K and K % 8 == 0
            and x.stride(-1) == 1 and all(st % 8 == 0 for st in x.stride()[:-1]) and x.data_ptr() % 16 == 0
            and weight.stride(-1) == 1 and weight.stride(-2) == K and all(st % 8 == 0 for st in weight.stride()[:-1])
            and weight.data_ptr() % 16 == 0)


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
                out_dtype: torch.dtype = torch.bfloat16, sigmoid: bool = False,
                out: torch.Tensor | None = None, early_trigger: bool = False) -> torch.Tensor:
    assert fits(x, weight, any_rows=True), (tuple(x.shape), x.stride(), tuple(weight.shape), x.dtype, weight.dtype)
    B, (M, K), N = (x.shape[0] if x.dim() == 3 else 1), x.shape[-2:], weight.shape[-2]
    shape = (*x.shape[:-2], M, N)
    if add is not None:
        assert x.dim() == 2 and out is None, "add: 2-D only, and it is the output"
        assert add.dtype == out_dtype == torch.bfloat16 and add.shape == (M, N) and add.is_contiguous(), add.shape
        out = add
    elif out is None:
        out = x.new_empty(shape, dtype=out_dtype)
    assert out.shape == shape and out.dtype == out_dtype and out.stride(-1) == 1, (out.shape, out.stride())
    assert not sigmoid or out_dtype == torch.float32, "the sigmoid epilogue writes fp32"
    lim = device_limits(x.device.index)
    warps, cs = CONFIG or pick_config(N, K, lim.sms, lim.smem_block)
    nt = min(-(-M // 8), MAX_NT)
    ker = get_kernels(cuda_source(CODE), NAMES)[f"skinny_gemm<{nt}, {_OUT[out_dtype]}>"]
    batch = [np.int64(t.stride(0) if t.dim() == 3 else 0) for t in (x, weight, out)]  # elements per batch item
    launch(ker, (-(-N // 16), -(-M // (8 * nt)), B), (32, warps), x, x.stride(-2), weight, add, out, M, N, K, cs,
           int(sigmoid), int(early_trigger), out.stride(-2), *batch, smem=smem_bytes(warps, nt), pdl=PDL, cluster=cs)
    return out


def skinny_gemm_ref(x: torch.Tensor, weight: torch.Tensor, add: torch.Tensor | None = None,
                    out_dtype: torch.dtype = torch.bfloat16, sigmoid: bool = False,
                    out: torch.Tensor | None = None, early_trigger: bool = False) -> torch.Tensor:
    """fp64 product (+ add) (sigmoid of it), rounded once to out_dtype: the kernel differs only by its fp32 sums.
    2-D or batched 3-D like skinny_gemm; written into `out` when given, and returned (`add` is left as it is).
    early_trigger: a launch hint, no effect here."""
    y = x.double() @ weight.double().transpose(-1, -2)
    if add is not None:
        y += add.double()
    y = (y.sigmoid() if sigmoid else y).to(out_dtype)
    return y if out is None else out.copy_(y)
