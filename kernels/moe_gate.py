"""MoE router in two launches: fp32 logits + sigmoid, then the biased top-k and the normalized weights.

    moe_gate(x, gate, bias, top_k, scale, renormalize=True) -> (topk_ids, topk_weights)
    gate_select(scores, bias, top_k, scale, renormalize=True) -> (topk_ids, topk_weights)   the second launch
    both also take live_rows=None

x            [T, H] contiguous, bf16 or fp32
gate         [E, H] router weight, contiguous; E <= 32·MAX_PER_LANE (512). bf16 (the checkpoint's dtype) with
             bf16 x: scores on tensor cores (kernels/skinny_gemm, fp32 out, sigmoid epilogue; 5.5 MB for K2.6).
             fp32: gate_logits below (SIMT, fp32 or bf16 x, H % 4 == 0 and H <= 4·256·MAX_CHUNKS = 8192).
bias         [E] fp32 e_score_correction_bias: added for choosing only
topk_ids     int64 [T, top_k], descending by s + bias (equal values: the lower expert id first)
topk_weights fp32 [T, top_k]: the chosen unbiased scores s, divided by (their sum + 1e-20) if renormalize,
             times scale
live_rows    None, or int64 [1] on the device: rows from live_rows[0] on are a CUDA graph's pad rows (graphs.py
             pads a step to its row bucket with copies of one dummy row). They choose no expert: ids -1 (no
             rank's, so the routed-expert kernels skip them), weights 0. Read when the launch runs, so one
             captured graph serves every live count.

s = sigmoid(x·gate^T) in fp32, as HF's DeepSeek-V3 / Kimi K2 MoEGate, F.linear(x.float(), gate.float()): the
products of bf16 values are exact in fp32 either way, only the order of the fp32 sums differs (n_group =
topk_group = 1: a plain top-k; grouped routing stays on the torch path). Torch runs this as ~12 launches (a
cuBLAS fp32 GEMM that picks a split-K kernel of ~11 us at 16 rows and a SIMT one of ~30 us at 64, sigmoid, add,
topk, sort, gather, sum, divide, scale): ~45 us of a K2.6 MoE layer at 16 rows, H200 2026-11-30.

Both score kernels sum each row in one fixed order that does not depend on T (gate_logits: per thread over its
chunks, a warp shuffle tree, warps in order; skinny_gemm: a split chosen from the weight's shape): a tree row
routes exactly like the same token verified alone, which cuBLAS, choosing its kernel by T, does not promise.
"""

from __future__ import annotations

import torch

from kernels import skinny_gemm
from kernels._compile import cuda_source, get_kernels, launch

CODE = r"""
template <typename T> struct in4;  // 4 consecutive activations as fp32
template <> struct in4<float> {
  static __device__ __forceinline__ float4 ld(const float* p) { return *reinterpret_cast<const float4*>(p); }
};
template <> struct in4<u16> {
  static __device__ __forceinline__ float4 ld(const u16* p) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    return make_float4(bf2f(v.x & 0xffff), bf2f(v.x >> 16), bf2f(v.y & 0xffff), bf2f(v.y >> 16));
  }
};

// scores[t, e] = sigmoid(x[t] · gate[e]) (fp32 gate). Block (blockIdx.x, blockIdx.y) = experts EPB·x .. and rows
// ROWS·y ..; 256 threads. Thread t keeps float4 chunks t, t + 256, ... (at most MAXC) of its experts' gate
// rows in registers and walks its rows R at a time.
template <typename T, int EPB, int MAXC, int R, int ROWS>
__global__ void __launch_bounds__(256) gate_logits(const T* __restrict__ x, const float* __restrict__ gate,
                                                    float* __restrict__ scores, int Tn, int H, int E) {
  __shared__ float part[8][R * EPB];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nc = H / 4;
  const int e0 = blockIdx.x * EPB, row0 = blockIdx.y * ROWS;
  float4 w[EPB][MAXC];
#pragma unroll
  for (int e = 0; e < EPB; ++e)
#pragma unroll
    for (int c = 0; c < MAXC; ++c) {
      const int i = tid + c * 256;
      w[e][c] = (i < nc && e0 + e < E) ? __ldg(reinterpret_cast<const float4*>(gate + (i64)(e0 + e) * H) + i)
                                       : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  for (int r0 = row0; r0 < min(Tn, row0 + ROWS); r0 += R) {
    float acc[R][EPB];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int e = 0; e < EPB; ++e) acc[r][e] = 0.f;
      if (r0 + r >= Tn) continue;
#pragma unroll
      for (int c = 0; c < MAXC; ++c) {
        const int i = tid + c * 256;
        if (i >= nc) continue;
        const float4 v = in4<T>::ld(x + (i64)(r0 + r) * H + 4 * i);
#pragma unroll
        for (int e = 0; e < EPB; ++e) {
          acc[r][e] = fmaf(v.x, w[e][c].x, acc[r][e]);
          acc[r][e] = fmaf(v.y, w[e][c].y, acc[r][e]);
          acc[r][e] = fmaf(v.z, w[e][c].z, acc[r][e]);
          acc[r][e] = fmaf(v.w, w[e][c].w, acc[r][e]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int e = 0; e < EPB; ++e) {
#pragma unroll
        for (int m = 16; m; m >>= 1) acc[r][e] += __shfl_xor_sync(0xffffffffu, acc[r][e], m);
        if (lane == 0) part[warp][r * EPB + e] = acc[r][e];
      }
    __syncthreads();
    if (tid < R * EPB) {
      const int r = tid / EPB, e = tid % EPB;
      float s = 0.f;
#pragma unroll
      for (int k = 0; k < 8; ++k) s += part[k][tid];
      if (r0 + r < Tn && e0 + e < E) scores[(i64)(r0 + r) * E + e0 + e] = 1.f / (1.f + expf(-s));
    }
    __syncthreads();
  }
}

// One warp per row: K rounds of a warp argmax over s + bias (ties: lower expert id), then the weights. The sigmoid
// stays with the logits kernels, spread over their threads: here one warp would take ~5 us per row for it (H200).
template <int MAXPL>
__global__ void gate_select(const float* __restrict__ scores, const float* __restrict__ bias, int Tn, int E,
                             int K, float scale, int renormalize, const i64* __restrict__ live,
                             i64* __restrict__ ids, float* __restrict__ weights) {
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
  pdl_trigger();  // moe_route (PDL) may become resident; it waits for this grid before reading ids
  pdl_wait();  // launched with PDL: the logits kernel's output is complete and visible after this
  if (row >= Tn) return;
  if (live != nullptr && row >= *live) {  // a pad row: no expert, so no rank reads weights for it
    if (lane < K) ids[(i64)row * K + lane] = -1, weights[(i64)row * K + lane] = 0.f;
    return;
  }
  const float* s = scores + (i64)row * E;
  float c[MAXPL];  // lane's experts lane, lane + 32, ...
#pragma unroll
  for (int j = 0; j < MAXPL; ++j) {
    const int e = lane + 32 * j;
    c[j] = e < E ? s[e] + bias[e] : NEG_INF;
  }
  float sum = 0.f, mine = 0.f;
  for (int k = 0; k < K; ++k) {
    float bv = NEG_INF;
    int be = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < MAXPL; ++j)
      if (c[j] > bv) bv = c[j], be = lane + 32 * j;  // strict: the lowest id of equal values
#pragma unroll
    for (int m = 16; m; m >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, m);
      const int oe = __shfl_xor_sync(0xffffffffu, be, m);
      if (ov > bv || (ov == bv && oe < be)) bv = ov, be = oe;
    }
    if (be >= E) be = k;  // no finite value left (NaN scores): a valid id, never read out of bounds
#pragma unroll
    for (int j = 0; j < MAXPL; ++j)
      if (lane + 32 * j == be) c[j] = NEG_INF;
    const float v = s[be];
    sum += v;  // in selection order
    if (lane == k) mine = v;
    if (lane == 0) ids[(i64)row * K + k] = be;
  }
  if (lane < K) weights[(i64)row * K + lane] = (renormalize ? mine / (sum + 1e-20f) : mine) * scale;
}
"""
EXPERTS_PER_BLOCK = 2  # 192 blocks over K2.6's 384 experts
MAX_CHUNKS = 8  # float4 gate chunks per thread: H <= 8192
ROW_TILE = 8  # rows per pass of a block (accumulators: ROW_TILE · EXPERTS_PER_BLOCK per thread)
ROWS_PER_BLOCK = 16  # more rows: more blocks (each re-reads its gate rows, from L2)
MAX_PER_LANE = 16  # E <= 512
PDL = True  # gate_select by programmatic dependent launch: resident while the logits kernel runs
_LOGITS = {dt: f"gate_logits<{t}, {EXPERTS_PER_BLOCK}, {MAX_CHUNKS}, {ROW_TILE}, {ROWS_PER_BLOCK}>"
           for dt, t in ((torch.float32, "float"), (torch.bfloat16, "u16"))}
_SELECT = f"gate_select<{MAX_PER_LANE}>"
NAMES = (*_LOGITS.values(), _SELECT)


def fits(x: torch.Tensor, gate: torch.Tensor, top_k: int) -> bool:
    """Shapes and dtypes the kernels take (others: moe_gate_ref)."""
    E, H = gate.shape
    if not (x.is_cuda and gate.is_contiguous() and E <= 32 * MAX_PER_LANE and 1 <= top_k <= min(E, 32)):
        return False
    if gate.dtype == torch.bfloat16:
        return x.shape[0] == 0 or skinny_gemm.fits(x, gate, any_rows=True)
    return gate.dtype == torch.float32 and x.dtype in _LOGITS and H % 4 == 0 and H <= 4 * 256 * MAX_CHUNKS


def moe_gate(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, top_k: int, scale: float,
              renormalize: bool = True, live_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    T, H = x.shape
    E = gate.shape[0]
    assert fits(x, gate, top_k) and gate.shape[1] == H, (x.shape, x.dtype, gate.shape, gate.dtype, top_k)
    assert x.is_contiguous() and gate.is_contiguous() and bias.shape == (E,) and bias.dtype == torch.float32
    if T == 0:
        scores = torch.empty(0, E, dtype=torch.float32, device=x.device)
    elif gate.dtype == torch.bfloat16:
        scores = skinny_gemm.skinny_gemm(x, gate, out_dtype=torch.float32, sigmoid=True)  # [T, E]
    else:
        scores = torch.empty(T, E, dtype=torch.float32, device=x.device)
        launch(get_kernels(cuda_source(CODE), NAMES)[_LOGITS[x.dtype]],
               (-(-E // EXPERTS_PER_BLOCK), -(-T // ROWS_PER_BLOCK)), 256, x, gate, scores, T, H, E)
    return gate_select(scores, bias, top_k, scale, renormalize, live_rows)


def gate_select(scores: torch.Tensor, bias: torch.Tensor, top_k: int, scale: float,
                renormalize: bool = True, live_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_gate's second launch: scores [T, E] fp32 contiguous (the sigmoid already applied) -> (topk_ids,
    topk_weights) as moe_gate returns them. A NaN or -inf biased score is never chosen; a row with fewer than top_k
    others takes expert k for choice k."""
    T, E = scores.shape
    assert scores.dtype == torch.float32 and scores.is_contiguous() and E <= 32 * MAX_PER_LANE, (scores.shape,)
    assert bias.shape == (E,) and bias.dtype == torch.float32 and 1 <= top_k <= min(E, 32), (bias.shape, top_k)
    if live_rows is not None:
        assert live_rows.shape == (1,) and live_rows.dtype == torch.int64 and live_rows.device == scores.device
    ids = torch.empty(T, top_k, dtype=torch.int64, device=scores.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=scores.device)
    if T:
        launch(get_kernels(cuda_source(CODE), NAMES)[_SELECT], -(-T // 4), 128, scores, bias.contiguous(), T, E,
               top_k, float(scale), int(renormalize), live_rows, ids, weights, pdl=PDL)
    return ids, weights


def moe_gate_ref(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, top_k: int, scale: float,
                  renormalize: bool = True, live_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.nn.functional.linear(x.float(), gate.float()).sigmoid()  # [T, E]
    ids = (scores + bias).topk(top_k, dim=-1).indices  # [T, k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return skip_pad_rows(ids, weights * scale, live_rows)


def skip_pad_rows(ids: torch.Tensor, weights: torch.Tensor,
                  live_rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k], weights [T, k] with rows live_rows[0].. (pad rows, see the module doc) set to -1 and 0."""
    if live_rows is None:
        return ids, weights
    pad = (torch.arange(ids.shape[0], device=ids.device) >= live_rows)[:, None]  # [T, 1], no host read
    return ids.masked_fill(pad, -1), weights.masked_fill(pad, 0.0)
