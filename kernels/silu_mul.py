"""SwiGLU's activation in one launch: silu(gate) ⊙ up over the fused gate/up projection's output.

    silu_mul(gate_up) -> act

gate_up  [T, 2I] contiguous, fp32 or bf16: row t = [gate x_t (I) | up x_t (I)] (MLPWeights.gate_up_proj's GEMM)
act      [T, I] (new tensor, gate_up's dtype)

Torch runs it as two launches over column views of gate_up (F.silu, then the product), and the views' row
stride sends both to its generic strided elementwise kernel (K2.6, 16 rows: ~2.4 us each; 20 such launches in
a 4-layer verify step, H200 2026-11-30). Numerics of that torch path: silu in fp32 as x / (1 + exp(-x)),
rounded to the dtype, times up in fp32, rounded once more.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._compile import cuda_source, get_kernels, launch

CODE = r"""
__device__ __forceinline__ float rnd(float v, const float*) { return v; }  // v rounded to the element type
__device__ __forceinline__ float rnd(float v, const u16*) { return bf2f(f2bf(v)); }

// Grid (T, ceil(I / (VW·blockDim))): thread i of row t handles VW consecutive outputs (one 16-byte chunk of
// gate, of up and of act) when I·sizeof(T) is a multiple of 16, else VW = 1 (the scalar template).
template <typename T, int VW>
__global__ void silu_mul(const T* __restrict__ gu, T* __restrict__ out, int I) {
  pdl_trigger();  // a PDL successor (kernels/skinny_gemm) may start streaming its weights; it waits for our output
  pdl_wait();  // launched with PDL: what the kernel before wrote is visible after this; no access before it
  const int t = blockIdx.x, i = VW * (blockIdx.y * blockDim.x + threadIdx.x);
  if (i >= I) return;
  const T* g = gu + (i64)t * 2 * I + i;
  T* o = out + (i64)t * I + i;
  __align__(16) T gv[VW];
  __align__(16) T uv[VW];
  __align__(16) T ov[VW];
  if (VW > 1) {
    *reinterpret_cast<uint4*>(gv) = *reinterpret_cast<const uint4*>(g);
    *reinterpret_cast<uint4*>(uv) = *reinterpret_cast<const uint4*>(g + I);
  } else {
    gv[0] = g[0], uv[0] = g[I];
  }
#pragma unroll
  for (int j = 0; j < VW; ++j) {
    const float x = load_f32(gv + j), s = rnd(x / (1.f + expf(-x)), gv);
    store_f32(ov + j, s * load_f32(uv + j));
  }
  if (VW > 1) *reinterpret_cast<uint4*>(o) = *reinterpret_cast<const uint4*>(ov);
  else o[0] = ov[0];
}
"""
_TYPE = {torch.float32: "float", torch.bfloat16: "u16"}
NAMES = ("silu_mul<float, 4>", "silu_mul<float, 1>", "silu_mul<u16, 8>", "silu_mul<u16, 1>")
THREADS = 128
PDL = True  # launched by programmatic dependent launch: resident while the kernel before it finishes


def fits(gate_up: torch.Tensor) -> bool:
    return gate_up.is_cuda and gate_up.dtype in _TYPE and gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    assert fits(gate_up), (gate_up.shape, gate_up.dtype, gate_up.device)
    gate_up = gate_up.contiguous()
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(T, I, dtype=gate_up.dtype, device=gate_up.device)
    if T == 0 or I == 0:
        return out
    vw = 16 // gate_up.element_size()
    if (I * gate_up.element_size()) % 16 or gate_up.data_ptr() % 16:
        vw = 1
    ker = get_kernels(cuda_source(CODE), NAMES)[f"silu_mul<{_TYPE[gate_up.dtype]}, {vw}>"]
    launch(ker, (T, -(-I // (vw * THREADS))), THREADS, gate_up, out, I, pdl=PDL)
    return out


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
