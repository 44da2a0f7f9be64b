// Record of the session-45 experiment (docs/kernel-notes/moe_w4a16.md, session 45): not compiled by the project.
// Launched by its A/B script through kernels._compile (get_kernels(cuda_source(this text), names)) with grid
// (I/16, k) x (32, ceil(H/128/CPW)) and H·2 bytes of shared memory; its act [k, I] fed a down kernel of
// moe_t1_down's design.
// EXPERIMENT (session 45): one-token routed experts as register-direct GEMVs on the tensor cores.
// Tiled INT4 (verifier_service/int4.py tile_int4): tile p (16 rows), chunk c (128 inputs): 256 words [row][16],
// scales 64 bf16 [row][4], at (p * nch + c) * 256 words / * 64 scales.
// Lane (g, t) loads row g's and row g+8's 16 B of scale group t of each chunk (LDG.128 into registers, every
// chunk of the warp in flight at once: no shared-memory ring). The MMA's N side holds one column per scale group
// (column n = group n for the token; B is x where the lane's group t == n, else 0), so one m16n8k16 sums the
// four groups' products into four columns, and the group scales multiply D's columns in fp32 afterwards.

#define NIB 8
__device__ __forceinline__ uint4 ldg_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ u32 ldg_u32(const void* p) {
  u32 v;
  asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ void dq(u32 w, u32 (&p)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    u32 t;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(t) : "r"(w >> (4 * i)), "n"(0x000F000F), "n"(0x43004300));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(p[i]) : "r"(t), "r"(0x3F803F80u), "r"(0xC308C308u));
  }
}
__device__ __forceinline__ void mma_nv(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// 8 bf16 (16 B, inputs 0..7) -> pairs (0,4) (1,5) (2,6) (3,7): the dequantized weights' pair order.
__device__ __forceinline__ uint4 perm_x(uint4 r) {
  return make_uint4(__byte_perm(r.x, r.z, 0x5410), __byte_perm(r.x, r.z, 0x7632), __byte_perm(r.y, r.w, 0x5410),
                    __byte_perm(r.y, r.w, 0x7632));
}
// The y-th local pair of the single token's k: its expert (local index) and slot j, or -1.
__device__ __forceinline__ int nth_local(const i64* ids, int k, i64 first, int E, int y, int* jslot) {
  int n = 0;
  for (int j = 0; j < k; ++j) {
    const i64 id = ids[j];
    if (id >= first && id < first + E) {
      if (n == y) { *jslot = j; return (int)(id - first); }
      ++n;
    }
  }
  return -1;
}
__device__ __forceinline__ int count_local(const i64* ids, int k, i64 first, int E) {
  int n = 0;
  for (int j = 0; j < k; ++j) n += ids[j] >= first && ids[j] < first + E;
  return n;
}

// One chunk of one matrix: d += W_chunk(16 rows) · B, then acc += scale · d per column.
struct Chunk {
  uint4 lo, hi;  // row g / g+8, group t: 4 words each
  u32 slo, shi;  // row g / g+8: bf16 scales of groups 2(t&1), 2(t&1)+1
};
__device__ __forceinline__ void load_chunk(Chunk& ch, const u32* W, const u16* Sc, int c, int g, int t) {
  const u32* w = W + c * 256 + g * 16 + t * 4;
  ch.lo = ldg_stream(w);
  ch.hi = ldg_stream(w + 128);
  const u16* s = Sc + c * 64 + g * 4 + 2 * (t & 1);
  ch.slo = ldg_u32(s);
  ch.shi = ldg_u32(s + 32);
}
__device__ __forceinline__ void mma_chunk(const Chunk& ch, const uint4 (&b)[4], float (&acc)[2]) {
  float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};
  const u32 lw[4] = {ch.lo.x, ch.lo.y, ch.lo.z, ch.lo.w}, hw[4] = {ch.hi.x, ch.hi.y, ch.hi.z, ch.hi.w};
#pragma unroll
  for (int wi = 0; wi < 4; ++wi) {
    u32 lo[4], hi[4];
    dq(lw[wi], lo);
    dq(hw[wi], hi);
    float (&d)[4] = (wi & 1) ? d1 : d0;
    mma_nv(d, lo[0], hi[0], lo[1], hi[1], b[wi].x, b[wi].y);
    mma_nv(d, lo[2], hi[2], lo[3], hi[3], b[wi].z, b[wi].w);
  }
  acc[0] += __uint_as_float(ch.slo << 16) * (d0[0] + d1[0]) + __uint_as_float(ch.slo & 0xFFFF0000u) * (d0[1] + d1[1]);
  acc[1] += __uint_as_float(ch.shi << 16) * (d0[2] + d1[2]) + __uint_as_float(ch.shi & 0xFFFF0000u) * (d0[3] + d1[3]);
}
// Sum a row's columns over the quad (lanes t = 0..3), then over the block's warps in warp order.
__device__ __forceinline__ void quad_sum(float (&acc)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], 1);
    acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], 2);
  }
}

// gate/up: grid (I/16, k), block (32, NW), NW·CPW >= H/128. Block (p, y): rows 16p.. of the y-th local expert;
// warp w: chunks w·CPW .. w·CPW+CPW-1 of gate and up (a contiguous 4·CPW KB run of each). act: bf16 [k, I].
template <int CPW>
__global__ void __launch_bounds__(CPW >= 8 ? 256 : CPW >= 4 ? 512 : 896) moe_gemv_gate_up(const u32* __restrict__ Wg, const u16* __restrict__ Sg,
                                                           const u32* __restrict__ Wu, const u16* __restrict__ Su,
                                                           const u16* __restrict__ x, const i64* __restrict__ ids,
                                                           int k, i64 first, int E, int H, int I, u16* __restrict__ act) {
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* xs = reinterpret_cast<uint4*>(smem);  // x in pair order, H/8 pieces
  const int lane = threadIdx.x, w = threadIdx.y, g = lane >> 2, t = lane & 3, p = blockIdx.x, y = blockIdx.y;
  const int nch = H / 128, NW = blockDim.y;
  pdl_wait();
  pdl_trigger();
  int j;
  const int e = nth_local(ids, k, first, E, y, &j);
  if (e < 0) return;
  const i64 tile = ((i64)e * I / 16 + p) * nch;
  Chunk cg[CPW], cu[CPW];
#pragma unroll
  for (int i = 0; i < CPW; ++i) {
    const int c = w * CPW + i;
    if (c < nch) {
      load_chunk(cg[i], Wg + tile * 256, Sg + tile * 64, c, g, t);
      load_chunk(cu[i], Wu + tile * 256, Su + tile * 64, c, g, t);
    }
  }
  for (int i = lane + 32 * w; i < H / 8; i += 32 * NW) xs[i] = perm_x(reinterpret_cast<const uint4*>(x)[i]);
  __syncthreads();
  float ag[2] = {0.f, 0.f}, au[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < CPW; ++i) {
    const int c = w * CPW + i;
    if (c < nch) {
      uint4 b[4];
#pragma unroll
      for (int wi = 0; wi < 4; ++wi) b[wi] = g == t ? xs[c * 16 + 4 * t + wi] : make_uint4(0, 0, 0, 0);
      mma_chunk(cg[i], b, ag);
      mma_chunk(cu[i], b, au);
    }
  }
  quad_sum(ag);
  quad_sum(au);
  __syncthreads();
  float* red = reinterpret_cast<float*>(smem);  // [NW][2 mats][16 rows]
  if (t == 0) {
    red[(w * 2 + 0) * 16 + g] = ag[0], red[(w * 2 + 0) * 16 + g + 8] = ag[1];
    red[(w * 2 + 1) * 16 + g] = au[0], red[(w * 2 + 1) * 16 + g + 8] = au[1];
  }
  __syncthreads();
  if (w == 0 && lane < 16) {
    float gs = 0.f, us = 0.f;
    for (int v = 0; v < NW; ++v) gs += red[(v * 2) * 16 + lane], us += red[(v * 2 + 1) * 16 + lane];
    act[(i64)y * I + p * 16 + lane] = f2bf(gs / (1.f + __expf(-gs)) * us);
  }
}

// The experiment's down kernel (moe_gemv_down) is the same design as kernels/moe_w4a16_t1.cu moe_t1_down, which finds
// its pairs from moe_route's order instead of scanning the ids: see that file.
