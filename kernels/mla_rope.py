"""MLA's RoPE and latent cache write in one launch (instead of ~20: two interleaved rotations of ~8 ops
each, a concatenation, a cast and an indexed write). The model's batched torch attention takes it; the tree-attention
kernel's path splits the same work over the launches around it (kernels/rms_norm latent_norms writes the cache rows,
the attention rotates the query), so no launch sits between the query's projections and the attention.

    mla_rope(q, kv, c, cos, sin, cache, slots, out=None) -> q_rope

q      [T, h, D] contiguous: per head [nope | rope]; its last R = rope dims are rotated into q_rope
kv     [T, C + R], last dim contiguous, any row stride (a column block of the fused q/kv latent projection's
       output): the kv_a projection [latent | k_rope]; its k_rope part is rotated
c      [T, C] contiguous: the normed latent (kv_a_layernorm of kv[:, :C])
cos    [T, R/2] fp32 contiguous (sin the same): one angle per interleaved pair, amplitude folded in
cache  [S, C + R] one layer's latent cache viewed flat, q's dtype: row slots[t] <- [c[t] | rope(k_rope[t])]
slots  int64 [T]
out    None, or where q_rope goes: [T, h, R] of q's dtype, last dim contiguous, any head and row strides (the
       rope columns of the absorbed query [T, h, C + R] that the tree-attention kernel reads: no copy)
q_rope [T, h, R] (out, or a new tensor)

Rotation of pair (e, o) = (x[2i], x[2i+1]): (e·cos - o·sin, e·sin + o·cos), each product and sum rounded
to fp32 on its own as torch's elementwise ops do (no FMA contraction), then once to q's dtype: the result
equals verifier_service.rope.apply_rope bit for bit. fp32 and bf16.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels._compile import cuda_source, get_kernels, launch

CODE = r"""
template <typename T>
__device__ __forceinline__ void rotate(const T* x, T* out, float c, float s) {
  const float2 r = rope_pair(load_f32(x), load_f32(x + 1), c, s);
  store_f32(out, r.x);
  store_f32(out + 1, r.y);
}

// One block per row t: the cache row [c | rope(k_rope)] and the h·R/2 pairs of q's rope parts.
template <typename T>
__global__ void mla_rope(const T* __restrict__ q, const T* __restrict__ kv, const T* __restrict__ c,
                         const float* __restrict__ cos, const float* __restrict__ sin, T* __restrict__ cache,
                         const i64* __restrict__ slots, T* __restrict__ q_rope, int h, int D, int C, int R,
                         int kv_ld, i64 out_t, i64 out_h) {
  pdl_trigger();  // the kernel after it may become resident; it waits for our writes before reading them
  pdl_wait();  // launched with PDL: what the kernel before wrote is visible after this; no access before it
  const int t = blockIdx.x, half = R / 2;
  const float* ct = cos + (i64)t * half;
  const float* sn = sin + (i64)t * half;
  T* row = cache + slots[t] * (C + R);
  for (int i = threadIdx.x; i < C; i += blockDim.x) row[i] = c[(i64)t * C + i];
  for (int i = threadIdx.x; i < half; i += blockDim.x)
    rotate(kv + (i64)t * kv_ld + C + 2 * i, row + C + 2 * i, ct[i], sn[i]);
  for (int j = threadIdx.x; j < h * half; j += blockDim.x) {
    const int head = j / half, i = j % half;
    rotate(q + ((i64)t * h + head) * D + (D - R) + 2 * i, q_rope + t * out_t + head * out_h + 2 * i, ct[i], sn[i]);
  }
}
"""
PDL = True  # launched by programmatic dependent launch: resident while the kernel before it finishes
_TYPE = {torch.float32: "float", torch.bfloat16: "u16"}
NAMES = tuple(f"mla_rope<{t}>" for t in _TYPE.values())


def fits(q: torch.Tensor, cache: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in _TYPE and cache.dtype == q.dtype


def mla_rope(q: torch.Tensor, kv: torch.Tensor, c: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    T, h, D = q.shape
    C, R = c.shape[1], 2 * cos.shape[1]
    assert fits(q, cache) and kv.dtype == c.dtype == q.dtype, (q.dtype, kv.dtype, c.dtype, cache.dtype)
    assert kv.shape == (T, C + R) and c.shape == (T, C) and cache.shape[1] == C + R and R <= D, (kv.shape, c.shape)
    assert cos.shape == sin.shape == (T, R // 2) and cos.dtype == sin.dtype == torch.float32, (cos.shape, cos.dtype)
    assert slots.shape == (T,) and slots.dtype == torch.int64
    for x in (q, c, cos, sin, cache, slots):
        assert x.is_contiguous()
    assert kv.stride(1) == 1, kv.stride()
    q_rope = torch.empty(T, h, R, dtype=q.dtype, device=q.device) if out is None else out
    assert q_rope.shape == (T, h, R) and q_rope.dtype == q.dtype and q_rope.stride(2) == 1, q_rope.stride()
    if T:
        ker = get_kernels(cuda_source(CODE), NAMES)[f"mla_rope<{_TYPE[q.dtype]}>"]
        launch(ker, T, 128, q, kv, c, cos, sin, cache, slots, q_rope, h, D, C, R, kv.stride(0),
               np.int64(q_rope.stride(0)), np.int64(q_rope.stride(1)), pdl=PDL)
    return q_rope


def mla_rope_ref(q: torch.Tensor, kv: torch.Tensor, c: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    R = 2 * cos.shape[1]
    cache[slots] = torch.cat([c, rotate_pairs_ref(kv[:, -R:], cos, sin)], dim=-1).to(cache.dtype)
    q_rope = rotate_pairs_ref(q[..., -R:], cos[:, None, :], sin[:, None, :])
    return q_rope if out is None else out.copy_(q_rope)


def rotate_pairs_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of interleaved pairs (x[2i], x[2i+1]) by angle i of cos / sin (broadcast to x [..., R/2]), in fp32, rounded
    once to x's dtype: the torch form of the kernels' rope_pair (kernels/common.cuh)."""
    e, o = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((e * cos - o * sin, e * sin + o * cos), dim=-1).flatten(-2).to(x.dtype)
