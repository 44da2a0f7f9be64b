"""RMSNorm in one launch, optionally followed by rotate-half RoPE (the drafter's q_norm/k_norm + RoPE).

    rms_norm(x, weight, eps, cos=None, sin=None) -> out   (new tensor, x's shape and dtype)
    add_rms_norm(x, delta, weight, eps) -> (h, out)       h = x + delta, out = rms_norm(h): a decoder
                                                          layer's residual add and next norm, one launch
    rms_norm_pair(x1, w1, x2, w2, eps) -> (out1, out2)    two norms of the same rows in one launch
    latent_norms(x1, w1, kv, w2, eps, cos, sin, cache, slots) -> out1
                                                          the same, the second written to MLA's latent cache
                                                          rows with its RoPE tail (see below)

x       [..., D] contiguous, fp32 or bf16; rows N = x.numel() / D. Or a [N, D] view of wider rows (last dim
        contiguous, row stride x.stride(0)): a fused projection's column block is normed in place of a copy
weight  [D], x's dtype
cos/sin None, or contiguous [..., 1, D] (x's dtype) with x = [..., heads, D]: row r of x (flattened) uses
        cos/sin row r // heads (one angle table per position, shared by its heads). Needs D even. x may then be
        a column block of wider token rows unflattened into heads (a fused q|k|v projection's q or k), read in place

Rows of plain RMSNorm whose width is a multiple of 16 bytes (and 16-byte aligned) take `rms_norm_vec`: every
thread loads its 16-byte chunks of the row and of the weight at once and keeps them in registers for the
second pass. The scalar loop below it walks a 7168-wide bf16 row as ~28 dependent 2-byte loads per thread,
twice: ~10 us per norm whatever the row count (a K2.6 layer holds 4 norms; 174 of the 2119 us of a 4-layer
16-row verify step, H200 2026-11-30).

Numerics of HF's Llama/Qwen3/DeepSeek RMSNorm: statistics in fp32, the normalized value rounded to x's
dtype, times weight rounded to x's dtype; with RoPE, out[i] = y[i]·cos[i] - y[i+D/2]·sin[i] (first half)
and y[i]·cos[i] + y[i-D/2]·sin[i] (second half) in fp32, rounded once. Torch runs the same as ~6 launches
(cast, square, mean, rsqrt, multiply, cast, scale) plus ~5 for the rotation; a drafter step holds 17
norms, 9 of them with RoPE (~150 of its ~295 launches, H200 2026-11-30).
"""

from __future__ import annotations

import numpy as np
import torch

from kernels._compile import cuda_source, get_kernels, launch
from kernels.mla_rope import rotate_pairs_ref

CODE = r"""
template <typename T> struct io;
template <> struct io<float> {
  static __device__ __forceinline__ float ld(const float* p) { return *p; }
  static __device__ __forceinline__ void st(float* p, float v) { *p = v; }
  static __device__ __forceinline__ float round(float v) { return v; }
};
template <> struct io<u16> {  // bf16 as raw bits
  static __device__ __forceinline__ float ld(const u16* p) { return bf2f(*p); }
  static __device__ __forceinline__ void st(u16* p, float v) { *p = f2bf(v); }
  static __device__ __forceinline__ float round(float v) { return bf2f(f2bf(v)); }
};

// 1 / sqrt(mean of squares + eps) of a block's row from each thread's partial sum of squares: a warp
// shuffle tree, then the warps in order (a fixed order: the result does not depend on the row count).
// nt: the threads that hold the row (a multiple of 32, <= blockDim.x); the others add nothing but join the barrier.
__device__ __forceinline__ float inv_rms(float ss, float* part, int D, float eps, int nt) {
  const int tid = threadIdx.x;
#pragma unroll
  for (int m = 16; m; m >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
  if (nt > 32) {
    if ((tid & 31) == 0 && tid < nt) part[tid >> 5] = ss;
    __syncthreads();
    ss = 0.f;
    for (int k = 0; k < nt / 32; ++k) ss += part[k];
  }
  return rsqrtf(ss / (float)D + eps);
}

// One block of 32·W threads per row of D elements (W warps: more for wide rows, so a 7168-wide row is
// not one warp's serial walk). The row's sum of squares is reduced in a fixed order (per thread, per
// warp, then warps in order) that does not depend on N: a row's result never depends on its batch.
// cos/sin null: plain RMSNorm. Otherwise thread t rotates pairs (i, i + D/2), i = t, t + 32·W, ...
// Row r of x is head r % heads of token r / heads: x + (r / heads)·ld + (r % heads)·D (ld = heads·D when contiguous;
// a column block of a fused projection's output has its tokens further apart). out is contiguous.
template <typename T>
__global__ void rms_norm(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ cos,
                         const T* __restrict__ sin, T* __restrict__ out, int N, int D, int heads, i64 ld, float eps) {
  pdl_trigger();  // a PDL successor (kernels/skinny_gemm) may start streaming its weights; it waits for our output
  pdl_wait();  // launched with PDL: what the kernel before wrote is visible after this; no access before it
  __shared__ float part[32];
  const int row = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
  const T* xr = x + (i64)(row / heads) * ld + (i64)(row % heads) * D;
  T* o = out + (i64)row * D;
  float ss = 0.f;
  for (int i = tid; i < D; i += nt) {
    const float v = io<T>::ld(xr + i);
    ss += v * v;
  }
  const float inv = inv_rms(ss, part, D, eps, nt);
  if (cos == nullptr) {
    for (int i = tid; i < D; i += nt) io<T>::st(o + i, io<T>::ld(w + i) * io<T>::round(io<T>::ld(xr + i) * inv));
    return;
  }
  const int half = D / 2;
  const T* c = cos + (i64)(row / heads) * D;
  const T* s = sin + (i64)(row / heads) * D;
  for (int i = tid; i < half; i += nt) {
    const float a = io<T>::round(io<T>::ld(w + i) * io<T>::round(io<T>::ld(xr + i) * inv));
    const float b = io<T>::round(io<T>::ld(w + i + half) * io<T>::round(io<T>::ld(xr + i + half) * inv));
    io<T>::st(o + i, a * io<T>::ld(c + i) - b * io<T>::ld(s + i));
    io<T>::st(o + i + half, b * io<T>::ld(c + i + half) + a * io<T>::ld(s + i + half));
  }
}

// Plain RMSNorm of rows whose D·sizeof(T) is a multiple of 16 (x, w, out 16-byte aligned): thread t < nt holds
// chunks t, t + nt, ... (at most MAXV of 16 bytes) of the row and of w in registers, all loaded before the first
// use; threads from nt on only join the block's barriers. Same statistic order rules as rms_norm (independent of
// N), same rounding. x's rows are `ld` elements apart (ld >= D, ld·sizeof(T) a multiple of 16); out_row is where this
// block's row goes (16-byte aligned). delta non-null (residual add first, [N, D] contiguous like h_out): the row normed is
// h = T(x + delta), rounded as torch's add rounds, and h is also written to h_out.
template <typename T, int MAXV>
__device__ __forceinline__ void norm_row_vec(const T* __restrict__ x, const T* __restrict__ delta,
                                             const T* __restrict__ w, T* __restrict__ out_row,
                                             T* __restrict__ h_out, int D, int ld, float eps, int nt) {
  constexpr int VW = 16 / sizeof(T);  // elements per 16-byte chunk
  __shared__ float part[32];
  const int row = blockIdx.x, tid = threadIdx.x, nv = tid < nt ? D / VW : 0;
  const uint4* xr = reinterpret_cast<const uint4*>(x + (i64)row * ld);
  const uint4* wr = reinterpret_cast<const uint4*>(w);
  uint4* o = reinterpret_cast<uint4*>(out_row);
  uint4 xv[MAXV], wv[MAXV], dv[MAXV];
#pragma unroll
  for (int k = 0; k < MAXV; ++k) {
    if (tid + k * nt < nv) {
      xv[k] = xr[tid + k * nt];
      wv[k] = __ldg(wr + tid + k * nt);
      if (delta != nullptr) dv[k] = reinterpret_cast<const uint4*>(delta + (i64)row * D)[tid + k * nt];
    }
  }
  if (delta != nullptr) {
#pragma unroll
    for (int k = 0; k < MAXV; ++k) {
      if (tid + k * nt < nv) {
        T* e = reinterpret_cast<T*>(&xv[k]);
        const T* d = reinterpret_cast<const T*>(&dv[k]);
#pragma unroll
        for (int j = 0; j < VW; ++j) io<T>::st(e + j, io<T>::ld(e + j) + io<T>::ld(d + j));
        reinterpret_cast<uint4*>(h_out + (i64)row * D)[tid + k * nt] = xv[k];
      }
    }
  }
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < MAXV; ++k) {
    if (tid + k * nt < nv) {
      const T* e = reinterpret_cast<const T*>(&xv[k]);
#pragma unroll
      for (int j = 0; j < VW; ++j) {
        const float v = io<T>::ld(e + j);
        ss += v * v;
      }
    }
  }
  const float inv = inv_rms(ss, part, D, eps, nt);
#pragma unroll
  for (int k = 0; k < MAXV; ++k) {
    if (tid + k * nt < nv) {
      uint4 r;
      T* re = reinterpret_cast<T*>(&r);
      const T* e = reinterpret_cast<const T*>(&xv[k]);
      const T* we = reinterpret_cast<const T*>(&wv[k]);
#pragma unroll
      for (int j = 0; j < VW; ++j) io<T>::st(re + j, io<T>::ld(we + j) * io<T>::round(io<T>::ld(e + j) * inv));
      o[tid + k * nt] = r;
    }
  }
}

// One block of 32·W threads per row (rms_norm_vec's layout, all threads holding the row).
template <typename T, int MAXV>
__global__ void rms_norm_vec(const T* __restrict__ x, const T* __restrict__ delta, const T* __restrict__ w,
                             T* __restrict__ out, T* __restrict__ h_out, int D, int ld, float eps) {
  pdl_trigger();  // a PDL successor (kernels/skinny_gemm) may start streaming its weights; it waits for our output
  pdl_wait();  // launched with PDL: what the kernel before wrote is visible after this; no access before it
  norm_row_vec<T, MAXV>(x, delta, w, out + (i64)blockIdx.x * D, h_out, D, ld, eps, blockDim.x);
}

// Two RMSNorms of the same N rows in one launch (MLA's q and kv latent norms): grid (N, 2), block y = 0 norms row
// blockIdx.x of x1 (D1 wide, rows ld1 apart) into out1 with nt1 threads, y = 1 the same of x2. Each with the thread
// count its own rms_norm_vec launch has, so each result equals that launch's bit for bit.
// slots2 non-null (MLA's latent cache write, latent_norms): x2's row r goes to out2 + slots2[r]·(D2 + R2) instead,
// followed by the R2 columns after it in x2's row (k_rope), rotated as interleaved pairs by cos / sin row r
// ([N, R2/2] fp32): the cache row [normed latent | rope(k_rope)]. R2 = 0 otherwise.
template <typename T, int MAXV>
__global__ void rms_norm_pair(const T* __restrict__ x1, const T* __restrict__ w1, T* __restrict__ out1, int D1,
                              int ld1, int nt1, const T* __restrict__ x2, const T* __restrict__ w2,
                              T* __restrict__ out2, int D2, int ld2, int nt2, float eps, const i64* __restrict__ slots2,
                              int R2, const float* __restrict__ cos, const float* __restrict__ sin) {
  pdl_trigger();  // the projection after it may start streaming its weights; it waits for our output
  pdl_wait();
  const int row = blockIdx.x;
  if (blockIdx.y == 0) {
    norm_row_vec<T, MAXV>(x1, nullptr, w1, out1 + (i64)row * D1, nullptr, D1, ld1, eps, nt1);
    return;
  }
  T* o = out2 + (slots2 == nullptr ? (i64)row * D2 : slots2[row] * (D2 + R2));
  // thread i < R2/2 rotates pair i (R2/2 <= blockDim.x), its inputs loaded before the norm: off the kernel's tail
  const int i = threadIdx.x;
  const bool rope = i < R2 / 2;
  float e = 0.f, od = 0.f, c = 0.f, sn = 0.f;
  if (rope) {
    const T* xr = x2 + (i64)row * ld2 + D2;
    e = io<T>::ld(xr + 2 * i), od = io<T>::ld(xr + 2 * i + 1);
    c = cos[(i64)row * (R2 / 2) + i], sn = sin[(i64)row * (R2 / 2) + i];
  }
  norm_row_vec<T, MAXV>(x2, nullptr, w2, o, nullptr, D2, ld2, eps, nt2);
  if (rope) {
    const float2 r = rope_pair(e, od, c, sn);
    io<T>::st(o + D2 + 2 * i, r.x);
    io<T>::st(o + D2 + 2 * i + 1, r.y);
  }
}
"""
PDL = True  # launched by programmatic dependent launch: resident while the kernel before it finishes
VEC_CHUNKS = 4  # rms_norm_vec's MAXV: 16-byte chunks per thread, so rows up to 4·16·1024 bytes (32768 bf16)
NAMES = ("rms_norm<float>", "rms_norm<u16>", *(f"{k}<{t}, {VEC_CHUNKS}>" for k in ("rms_norm_vec", "rms_norm_pair")
                                               for t in ("float", "u16")))
ELEMS_PER_WARP = 512  # a row gets one warp per 512 elements, 1 to 8 (H200: a 7168-wide row in 17 us as one warp)
_TYPE = {torch.float32: "float", torch.bfloat16: "u16"}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor | None = None,
             sin: torch.Tensor | None = None) -> torch.Tensor:
    D = x.shape[-1]
    assert x.is_cuda and x.dtype in _TYPE, (x.shape, x.dtype)
    _check_weight(x, weight)
    ld = _row_stride(x) if cos is None else None
    if ld is None and cos is None:  # the general kernel without RoPE reads contiguous rows
        x, ld = x.contiguous(), D
    heads = 1
    if cos is not None:
        heads = x.shape[-2]
        assert D % 2 == 0 and sin is not None, D
        for t in (cos, sin):
            assert t.dtype == x.dtype and t.is_contiguous() and t.numel() * heads == x.numel(), (t.shape, x.shape)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    N = out.numel() // D if D else 0
    if N == 0:
        return out
    if cos is None and _vectorizable(x, ld, weight, out):
        _launch_vec(x, None, weight, out, None, ld, eps)
        return out
    ld = _token_stride(x, heads)
    if ld is None:  # a strided view that missed the 16-byte path
        x, ld = x.contiguous(), heads * D
    ker = get_kernels(cuda_source(CODE), NAMES)[f"rms_norm<{_TYPE[x.dtype]}>"]
    launch(ker, N, 32 * _warps(D), x, weight, cos, sin, out, N, D, heads, np.int64(ld), float(eps), pdl=PDL)
    return out


def _token_stride(x: torch.Tensor, heads: int) -> int | None:
    """Elements between x's tokens when x [..., heads, D] is a contiguous [heads, D] block per token and its leading
    dims flatten to one stride (a column block of a projection's output, unflattened into heads); else None."""
    D = x.shape[-1]
    if x.is_contiguous():
        return heads * D
    if x.dim() < 2 or (heads > 1 and x.stride(-2) != D) or x.stride(-1) != 1:
        return None
    try:
        return x.view(-1, heads, D).stride(0)
    except RuntimeError:  # leading dims that do not flatten to one stride
        return None


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next RMSNorm in one launch: h = x + delta (rounded to x's dtype, as torch's
    add), y = rms_norm(h). x, delta: contiguous [..., D], same shape and dtype. -> (h, y), new tensors.
    Rows off the 16-byte path take torch's add and rms_norm."""
    assert delta.shape == x.shape and delta.dtype == x.dtype, (x.shape, delta.shape, x.dtype, delta.dtype)
    D = x.shape[-1]
    if not (x.is_contiguous() and delta.is_contiguous() and _vectorizable(x, D, weight, x)
            and _vectorizable(delta, D, weight, delta)):
        h = x + delta
        return h, rms_norm(h, weight, eps)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # torch's allocations: 16-byte aligned
    out = torch.empty_like(h)
    if h.numel():
        _launch_vec(x, delta, weight, out, h, D, eps)
    return h, out


def rms_norm_pair(x1: torch.Tensor, w1: torch.Tensor, x2: torch.Tensor, w2: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x1, w1, eps), rms_norm(x2, w2, eps)) in one launch, bit for bit: MLA's q and kv latent norms,
    both column blocks of the fused q/kv latent projection's output, which otherwise take a launch each on the
    verify step's critical path. x1 [N, D1], x2 [N, D2]: the same N, each contiguous or a column block of wider
    rows. Off the 16-byte path: two launches."""
    assert x1.dim() == 2 and x2.dim() == 2 and x1.shape[0] == x2.shape[0], (x1.shape, x2.shape)
    ld1, ld2 = _row_stride(x1), _row_stride(x2)
    out1, out2 = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (x1, x2))
    if (ld1 is None or ld2 is None or x1.dtype != x2.dtype or not _vectorizable(x1, ld1, w1, out1)
            or not _vectorizable(x2, ld2, w2, out2)):
        return rms_norm(x1, w1, eps), rms_norm(x2, w2, eps)
    _check_weight(x1, w1)
    _check_weight(x2, w2)
    if x1.shape[0]:
        nt1, nt2 = 32 * _vec_warps(x1), 32 * _vec_warps(x2)
        ker = get_kernels(cuda_source(CODE), NAMES)[f"rms_norm_pair<{_TYPE[x1.dtype]}, {VEC_CHUNKS}>"]
        launch(ker, (x1.shape[0], 2), max(nt1, nt2), x1, w1, out1, x1.shape[1], ld1, nt1, x2, w2, out2,
               x2.shape[1], ld2, nt2, float(eps), None, 0, None, None, pdl=PDL)
    return out1, out2


def latent_norms(x1: torch.Tensor, w1: torch.Tensor, kv: torch.Tensor, w2: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """MLA's two latent norms and its latent cache write in one launch -> rms_norm(x1, w1, eps) (a new tensor);
    cache[slots] <- [rms_norm(kv[:, :C], w2, eps) | rope(kv[:, C:])], C = w2's width. Bit for bit rms_norm_pair's
    norms and kernels/mla_rope's rotation (interleaved pairs, cos / sin [N, R/2] fp32 contiguous). x1 [N, D1], kv
    [N, C + R]: each contiguous or a column block of wider rows; cache [S, C + R] contiguous; slots int64 [N].
    The rows the tree attention reads for the step's own keys are written here, three launches before it, so no
    kernel sits between the query's projections and the attention (it rotates the query's rope part itself)."""
    N, C = kv.shape[0], w2.shape[0]
    R = kv.shape[1] - C
    assert x1.dim() == 2 and kv.dim() == 2 and x1.shape[0] == N and R > 0 and R % 2 == 0, (x1.shape, kv.shape)
    assert cache.dim() == 2 and cache.shape[1] == C + R and cache.dtype == kv.dtype and cache.is_contiguous()
    assert cos.shape == sin.shape == (N, R // 2) and cos.dtype == sin.dtype == torch.float32, (cos.shape, cos.dtype)
    assert cos.is_contiguous() and sin.is_contiguous() and slots.shape == (N,) and slots.dtype == torch.int64
    assert slots.is_contiguous()
    ld1, ld2 = _row_stride(x1), _row_stride(kv)
    out1 = torch.empty(x1.shape, dtype=x1.dtype, device=x1.device)
    if (ld1 is None or ld2 is None or x1.dtype != kv.dtype or not _vectorizable(x1, ld1, w1, out1)
            or not _vectorizable(kv[:, :C], ld2, w2, cache) or (C + R) * cache.element_size() % 16):
        return latent_norms_ref(x1, w1, kv, w2, eps, cos, sin, cache, slots)
    _check_weight(x1, w1)
    _check_weight(kv[:, :C], w2)
    if N:
        nt1, nt2 = 32 * _vec_warps(x1), 32 * _vec_warps(kv[:, :C])
        assert R // 2 <= max(nt1, nt2), (R, nt1, nt2)  # a rope pair per thread
        ker = get_kernels(cuda_source(CODE), NAMES)[f"rms_norm_pair<{_TYPE[x1.dtype]}, {VEC_CHUNKS}>"]
        launch(ker, (N, 2), max(nt1, nt2), x1, w1, out1, x1.shape[1], ld1, nt1, kv, w2, cache, C, ld2, nt2,
               float(eps), slots, R, cos, sin, pdl=PDL)
    return out1


def latent_norms_ref(x1: torch.Tensor, w1: torch.Tensor, kv: torch.Tensor, w2: torch.Tensor, eps: float,
                     cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    C = w2.shape[0]
    cache[slots] = torch.cat([rms_norm_ref(kv[:, :C], w2, eps), rotate_pairs_ref(kv[:, C:], cos, sin)], dim=-1)
    return rms_norm_ref(x1, w1, eps)


def rms_norm_pair_ref(x1: torch.Tensor, w1: torch.Tensor, x2: torch.Tensor, w2: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_ref(x1, w1, eps), rms_norm_ref(x2, w2, eps)


def _check_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    assert weight.shape == (x.shape[-1],) and weight.dtype == x.dtype and weight.is_contiguous(), (weight.shape,
                                                                                                 weight.dtype)


def _warps(D: int) -> int:
    return min(8, max(1, D // ELEMS_PER_WARP))


def _vectorizable(x: torch.Tensor, ld: int, weight: torch.Tensor, out: torch.Tensor) -> bool:
    """rms_norm_vec's conditions: 16-byte rows, row stride and pointers, and every chunk in registers."""
    row_bytes = x.shape[-1] * x.element_size()
    return (x.is_cuda and x.dtype in _TYPE and row_bytes % 16 == 0 and (ld * x.element_size()) % 16 == 0
            and row_bytes // 16 <= 32 * 32 * VEC_CHUNKS and all(t.data_ptr() % 16 == 0 for t in (x, weight, out)))


def _launch_vec(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor,
                h_out: torch.Tensor | None, ld: int, eps: float) -> None:
    D = x.shape[-1]
    _check_weight(x, weight)
    launch(get_kernels(cuda_source(CODE), NAMES)[f"rms_norm_vec<{_TYPE[x.dtype]}, {VEC_CHUNKS}>"], out.numel() // D,
           32 * _vec_warps(x), x, delta, weight, out, h_out, D, ld, float(eps), pdl=PDL)


def _vec_warps(x: torch.Tensor) -> int:
    """rms_norm_vec's warps for x's rows: one per ELEMS_PER_WARP, and enough that every chunk fits in registers."""
    chunks = x.shape[-1] * x.element_size() // 16
    return max(_warps(x.shape[-1]), -(-chunks // (32 * VEC_CHUNKS)))


def _row_stride(x: torch.Tensor) -> int | None:
    """Elements between x's rows when x is contiguous or a [N, D] view with a contiguous last dim; else None."""
    if x.is_contiguous():
        return x.shape[-1]
    if x.dim() == 2 and x.stride(1) == 1 and x.stride(0) >= x.shape[1]:
        return x.stride(0)
    return None


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor | None = None,
                 sin: torch.Tensor | None = None) -> torch.Tensor:
    x32 = x.float()
    y = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    if cos is None:
        return y
    y1, y2 = y.float().chunk(2, dim=-1)
    c1, c2 = cos.float().chunk(2, dim=-1)
    s1, s2 = sin.float().chunk(2, dim=-1)
    return torch.cat([y1 * c1 - y2 * s1, y2 * c2 + y1 * s2], dim=-1).to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h = x + delta
    return h, rms_norm_ref(h, weight, eps)
