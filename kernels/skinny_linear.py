"""y = x Wᵀ for few rows (a tree verify's 1-64), one launch, every row computed the same way whatever M.

    skinny_linear(x, weight) -> y   (new tensor)

x       [M, K] fp32 contiguous, 16-byte aligned, K % 4 == 0
weight  [N, K] fp32 contiguous, 16-byte aligned (nn.Linear's layout)
y       [M, N] fp32

Why: the tiny pair's target runs in fp32, where cuBLAS has no tensor-core path; at 17-33 rows it picks split-K
SIMT GEMMs of ~6.9 us each (68 of a 33-row verify forward's ~1.07 ms of GPU time, H200 2026-11-30) against
~2.4 us gemvs at one row, so a tree verify paid ~0.5 ms more than a plain decode step for the same weights.
Here a block owns 4 output columns x 8 rows and its warps (1-8, by K) split K: thread t sums 16-byte k-chunks
t, t + 32·warps, ... in order, each warp's 32 partial sums are reduce-scattered by xor shuffles (a fixed tree)
and warp 0 adds the warps' results in order, so y[m, n] is the same bit pattern for any M and any position of
row m in its batch: a tree verify's root row equals the plain decode step's row (batch invariance), which
keeps greedy DDTree output equal to autoregressive decoding.
"""

from __future__ import annotations

import torch

from kernels._compile import cuda_source, get_kernels, launch

CODE = r"""
constexpr int ROWS = 8, COLS = 4;  // per block: ROWS x COLS outputs, one per lane after the reduce-scatter
constexpr int MAX_WARPS = 8;

// One halving step of reduce_scatter: each lane keeps the half of v[0, 2·OFF) its bit OFF selects, plus
// the partner's copy of that half. A template so every index is a compile-time constant (registers, not
// local memory).
template <int OFF>
__device__ __forceinline__ void halve(float (&v)[32], bool upper) {
#pragma unroll
  for (int j = 0; j < OFF; ++j) {
    const float send = upper ? v[j] : v[j + OFF];
    const float keep = upper ? v[j + OFF] : v[j];
    v[j] = keep + __shfl_xor_sync(0xffffffffu, send, OFF);
  }
}

// v[32] per lane -> lane l returns the sum over the warp of v[l]: five halving steps, 31 shuffles instead
// of 32 x 5, always in the same tree.
__device__ __forceinline__ float reduce_scatter(float (&v)[32], int lane) {
  halve<16>(v, lane & 16);
  halve<8>(v, lane & 8);
  halve<4>(v, lane & 4);
  halve<2>(v, lane & 2);
  halve<1>(v, lane & 1);
  return v[0];
}

__device__ __forceinline__ void load4(float (&f)[4], const float* p) {
  const float4 v = __ldg(reinterpret_cast<const float4*>(p));
  f[0] = v.x; f[1] = v.y; f[2] = v.z; f[3] = v.w;
}

// Grid (ceil(M / ROWS), ceil(N / COLS)): the blocks of one column group (same weight rows) run next to each
// other, so a weight row is read from HBM once and from L2 by the other row tiles. Block: `warps` warps (a
// function of K only) that split K: thread t sums 16-byte chunks t, t + 32·warps, ... in order (two loads
// in flight per step), each warp reduce-scatters, then warp 0 adds the warps' sums in order.
extern "C" __global__ void skinny_linear(const float* __restrict__ x, const float* __restrict__ w,
                                         float* __restrict__ y, int M, int N, int K) {
  constexpr int V = 4;  // floats per 16-byte chunk
  __shared__ float part[MAX_WARPS][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int m0 = blockIdx.x * ROWS, n0 = blockIdx.y * COLS;
  const int rows = min(ROWS, M - m0), cols = min(COLS, N - n0);
  float acc[32];  // acc[r * COLS + c]: row m0 + r, column n0 + c
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0.f;
  const int chunks = K / V;
#pragma unroll 2
  for (int ch = threadIdx.x; ch < chunks; ch += blockDim.x) {
    float wf[COLS][V];
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
      if (c < cols) load4(wf[c], w + (i64)(n0 + c) * K + ch * V);
      else
#pragma unroll
        for (int j = 0; j < V; ++j) wf[c][j] = 0.f;
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      if (r < rows) {
        float xf[V];
        load4(xf, x + (i64)(m0 + r) * K + ch * V);
#pragma unroll
        for (int c = 0; c < COLS; ++c)
#pragma unroll
          for (int j = 0; j < V; ++j) acc[r * COLS + c] = fmaf(xf[j], wf[c][j], acc[r * COLS + c]);
      }
    }
  }
  part[warp][lane] = reduce_scatter(acc, lane);
  __syncthreads();
  if (warp != 0) return;
  float sum = part[0][lane];
  for (int k = 1; k < warps; ++k) sum += part[k][lane];
  const int r = lane / COLS, c = lane % COLS;
  if (r < rows && c < cols) y[(i64)(m0 + r) * N + n0 + c] = sum;
}
"""
NAMES = ("skinny_linear",)
MAX_ROWS = 64  # above this a GEMM library's tiles win; callers fall back to F.linear
MAX_WARPS = 8  # a block's warps split K: one per 32 chunks of 16 bytes, 1 to 8


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether skinny_linear takes these operands (else use F.linear)."""
    return (x.is_cuda and x.dim() == 2 and x.dtype == weight.dtype == torch.float32 and weight.dim() == 2
            and 0 < x.shape[0] <= MAX_ROWS and x.shape[1] == weight.shape[1] and x.shape[1] % 4 == 0
            and x.is_contiguous() and weight.is_contiguous() and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    assert fits(x, weight), (tuple(x.shape), tuple(weight.shape), x.dtype, weight.dtype)
    M, K = x.shape
    N = weight.shape[0]
    y = x.new_empty(M, N)
    ker = get_kernels(cuda_source(CODE), NAMES)["skinny_linear"]
    warps = min(MAX_WARPS, max(1, K // 4 // 32))  # depends on K only: batch invariance
    launch(ker, (-(-M // 8), -(-N // 4)), 32 * warps, x, weight, y, M, N, K)
    return y


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The exact product (fp64), rounded once to fp32: the kernel differs only by its fp32 sums."""
    return (x.double() @ weight.double().T).to(x.dtype)
