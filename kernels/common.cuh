// Shared device helpers, prepended to every kernel's source by kernels/_compile.py `cuda_source`.
// No #include: NVRTC compiles this without the CUDA headers; bf16 is handled as raw u16 bits.
typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;
typedef unsigned long long u64;
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float bf2f(u16 v) { return __uint_as_float((u32)v << 16); }
__device__ __forceinline__ u16 f2bf(float f) {  // round to nearest even, NaN stays NaN
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}
// Scalar fp32 <-> element of a kernel templated over fp32 and bf16 (raw u16 bits).
__device__ __forceinline__ float load_f32(const float* p) { return *p; }
__device__ __forceinline__ float load_f32(const u16* p) { return bf2f(*p); }
__device__ __forceinline__ void store_f32(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_f32(u16* p, float v) { *p = f2bf(v); }
// RoPE of one interleaved pair (e, o) by angle (c, s) = (cos, sin): (e·c - o·s, e·s + o·c), each product and sum
// rounded to fp32 on its own as torch's elementwise ops do (no FMA contraction): verifier_service.rope bit for bit.
__device__ __forceinline__ float2 rope_pair(float e, float o, float c, float s) {
  return make_float2(__fsub_rn(__fmul_rn(e, c), __fmul_rn(o, s)), __fadd_rn(__fmul_rn(e, s), __fmul_rn(o, c)));
}
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
// Programmatic dependent launch (sm_90+; no-ops when the launch did not ask for it). wait: every
// prerequisite grid has completed and its writes are visible. trigger: this block no longer keeps the
// dependent grid from being scheduled (it still has to wait before reading what this grid writes).
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// cp.async: global -> shared without registers; .cg (16 B) bypasses L1 for streamed data.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src));
}
// 16 B copy that writes zeros instead of reading when !valid (src is then not dereferenced).
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// D = A·B + D, m16n8k16, bf16 inputs, fp32 accumulators. Fragment layout (lane = 4·g + t):
// a = {A[g][2t..2t+1], A[g+8][2t..], A[g][2t+8..2t+9], A[g+8][2t+8..]}, b = {B[2t..2t+1][g], B[2t+8..][g]},
// d = {D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1]}.
__device__ __forceinline__ void mma_bf16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// ldmatrix.x4 at a shared-window address: lane 4g+t gets word t of row g of each of the 4 8x(16 B)
// matrices whose row addresses lanes 8j..8j+7 supply. ldmatrix_x4: the same from a generic pointer.
__device__ __forceinline__ void ldsm4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// ldmatrix.x2: the same for 2 matrices, whose row addresses lanes 0..15 supply.
__device__ __forceinline__ void ldsm2(u32 (&r)[2], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* p) { ldsm4(r, smem_addr(p)); }
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
// Max of two rows' values over the 4 lanes of a quad (the lanes holding one mma D row's columns).
__device__ __forceinline__ void quad_max2(float& a, float& b) {
#pragma unroll
  for (int d = 1; d < 4; d <<= 1) {
    a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, d));
    b = fmaxf(b, __shfl_xor_sync(0xffffffffu, b, d));
  }
}

// Generic-proxy writes to shared memory (st.shared, cp.async) -> ordered with the async proxy (wgmma, TMA).
__device__ __forceinline__ void fence_async_smem() {
#if __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// Hopper warpgroup MMA (sm_90a): descriptors, ordering and completion.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Shared-memory matrix descriptor, 128-byte swizzle. K-major: rows 128 B apart, 8-row groups SBO = 1024
// apart (LBO unused). MN-major: 64-element blocks of the MN dimension LBO apart, 8-row K groups SBO apart.
__device__ __forceinline__ u64 sw128_desc(u32 addr, u32 lbo, u32 sbo) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Until at most N of this warpgroup's committed wgmma groups are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
// Pins accumulator registers in program order around the asynchronous MMAs (as CUTLASS's
// warpgroup_fence_operand): no read or write of them moves across a wgmma fence/wait.
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N][4]) {
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}
// The asm operands of a wgmma accumulator fragment d[j][0..3], read and written.
#define WG_F4(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
