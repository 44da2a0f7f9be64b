// moe_w4a16's down GEMM for one token (T = 1, whole experts): moe_t1_down replaces moe_gemm<1> and its fused combine.
// Compiled after moe_w4a16.cu as one unit (dequant, local_expert, ld_after_wait come from there).
//
// Why: one token's down is short (K = I = 16 chunks of 128) over 1-8 experts. moe_gemm<1> streams each pair's
// 16-row tiles through a cp.async ring into an fp32 y per pair, and the tile's last block combines them.
// Here a block owns 16 output rows for all the token's local pairs: each lane loads its weights straight into
// registers (LDG.128, a batch of chunks in flight at once), and the block sums w·down(act) itself: no y, no
// arrival counters. H100, after the register-direct gate/up of session 45: one expert 6.8 vs 9.8 us, three
// 15.5 vs 23.4 (docs/kernel-notes/moe_w4a16.md, session 45). Behind moe_gemm<0>, as launched now, not yet measured.
//
// Weights in the tiled order (verifier_service/int4.py tile_int4): tile p (16 rows) of expert e, chunk c (128
// inputs) is 256 words [row][16] at ((e·rows/16 + p)·nch + c)·256 and 64 bf16 scales [row][4] at (...)·64, nch =
// inputs / 128. Lane (g, t) of a warp loads the 16 B of rows g and g+8 that hold scale group t of the chunk (words
// 4t..4t+3, inputs 32t..32t+31).
//
// The scale groups on the MMA's N side: m16n8k16 with the weights as A (16 rows), and B column n = scale group n of
// the one token: lane (g, t) passes the token's inputs where g == t and zeros elsewhere, so D[row][n] is the sum over
// group n's inputs only, and the group scales multiply D's columns in fp32 (q·x exact in the MMA, as in moe_gemm).
// Nibble pairs (i, i+4) are A's bf16x2 fragments (dequant); the inputs are put in the same pair order.

// 16 B of weights that are read once: no L1 allocation (the .nc path: the weights never change during a call).
__device__ __forceinline__ uint4 ldg_stream16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ u32 ldg_stream4(const void* p) {
  u32 v;
  asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
// Inputs 0..7 (8 bf16) -> bf16x2 pairs (0,4) (1,5) (2,6) (3,7), the order dequant gives the weights.
__device__ __forceinline__ uint4 pair_order(uint4 r) {
  return make_uint4(__byte_perm(r.x, r.z, 0x5410), __byte_perm(r.x, r.z, 0x7632), __byte_perm(r.y, r.w, 0x5410),
                    __byte_perm(r.y, r.w, 0x7632));
}
// Scheduling-free twin of mma_bf16 (not volatile: ptxas may interleave the independent chains).
__device__ __forceinline__ void mma_t1(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One lane's share of one chunk of one matrix: rows g and g+8, scale group t.
struct T1Chunk {
  uint4 lo, hi;  // 4 words each
  u32 slo, shi;  // rows g, g+8: bf16 scales of groups 2(t&1) (low half) and 2(t&1)+1
};
__device__ __forceinline__ void t1_load(T1Chunk& ch, const u32* W, const u16* Sc, i64 tile, int c, int g, int t) {
  const u32* w = W + (tile + c) * 256 + g * 16 + t * 4;
  const u16* s = Sc + (tile + c) * 64 + g * 4 + 2 * (t & 1);
  ch.lo = ldg_stream16(w);
  ch.hi = ldg_stream16(w + 8 * 16);
  ch.slo = ldg_stream4(s);
  ch.shi = ldg_stream4(s + 8 * 4);
}
// acc[0|1] (rows g, g+8) += Σ over the chunk of scale · q · x; b[wi]: the lane's B pairs for word wi (zero unless
// g == t). Lanes t = 0, 1 own D's columns 0-3 (the groups); lanes t = 2, 3 see zero columns.
__device__ __forceinline__ void t1_mma(const T1Chunk& ch, const uint4 (&b)[4], float (&acc)[2]) {
  float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};  // two chains: even and odd words
  const u32 lw[4] = {ch.lo.x, ch.lo.y, ch.lo.z, ch.lo.w}, hw[4] = {ch.hi.x, ch.hi.y, ch.hi.z, ch.hi.w};
#pragma unroll
  for (int wi = 0; wi < 4; ++wi) {
    u32 lo[4], hi[4];
    dequant(lw[wi], lo);
    dequant(hw[wi], hi);
    float(&d)[4] = (wi & 1) ? d1 : d0;
    mma_t1(d, lo[0], hi[0], lo[1], hi[1], b[wi].x, b[wi].y);
    mma_t1(d, lo[2], hi[2], lo[3], hi[3], b[wi].z, b[wi].w);
  }
  acc[0] += __uint_as_float(ch.slo << 16) * (d0[0] + d1[0]) + __uint_as_float(ch.slo & 0xffff0000u) * (d0[1] + d1[1]);
  acc[1] += __uint_as_float(ch.shi << 16) * (d0[2] + d1[2]) + __uint_as_float(ch.shi & 0xffff0000u) * (d0[3] + d1[3]);
}
// A row's sum over the quad's lanes (its columns), left in every lane.
__device__ __forceinline__ void t1_quad_sum(float (&acc)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], 1);
    acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], 2);
  }
}

// down + the weighted combine after moe_route and moe_gemm<0>: grid H/16, block (32, NW <= 8). Block p writes
// out[16p .. 16p+15] = bf16(add + Σ_r w_r · down_r(act_r)) over act's rows r < offsets[E] (moe_route's expert-sorted
// local pairs; order[r] is row r's slot, at most 32). The units (r, c) of every row's chunks are dealt to the warps
// CPW at a time (warp w: units w·CPW.., then + NW·CPW), each batch loaded before its MMAs; the first batch's
// weights are in flight before the wait for gate/up. Sums: per lane in unit order, then in warp order.
template <int CPW>
__global__ void __launch_bounds__(256) moe_t1_down(const u32* __restrict__ Wd, const u16* __restrict__ Sd,
                                                   const u16* __restrict__ act, const i64* __restrict__ ids,
                                                   const float* __restrict__ wts, const int* __restrict__ offsets,
                                                   const int* __restrict__ order, i64 first, int E, int H, int I,
                                                   const u16* __restrict__ add, u16* __restrict__ out) {
  __shared__ float red[8][16];
  __shared__ int es[32];
  __shared__ float ws[32];
  __shared__ int nl;
  const int lane = threadIdx.x, w = threadIdx.y, g = lane >> 2, t = lane & 3, NW = blockDim.y;
  const int p = blockIdx.x, nch = I / 128;
  if (w == 0) {  // moe_route's outputs and the router's are final: gate/up triggered this launch after its wait
    const int rows = min(offsets[E], 32);
    const int slot = lane < rows ? order[lane] : -1;
    es[lane] = slot >= 0 ? local_expert(ids, slot, first, E, 1, 1) : -1;
    ws[lane] = slot >= 0 ? wts[slot] : 0.f;
    if (lane == 0) nl = rows;
  }
  __syncthreads();
  const int units = nl * nch;
  float acc[2] = {0.f, 0.f};
  bool waited = false;
  for (int u0 = w * CPW; u0 < units; u0 += NW * CPW) {
    T1Chunk ch[CPW];
#pragma unroll
    for (int i = 0; i < CPW; ++i) {
      const int u = u0 + i;
      if (u < units) t1_load(ch[i], Wd, Sd, ((i64)es[u / nch] * (H / 16) + p) * nch, u % nch, g, t);
    }
    if (!waited) pdl_wait();  // act
    waited = true;
#pragma unroll
    for (int i = 0; i < CPW; ++i) {
      const int u = u0 + i;
      if (u < units) {
        const int r = u / nch, c = u % nch;
        uint4 b[4];
#pragma unroll
        for (int wi = 0; wi < 4; ++wi)
          b[wi] = pair_order(g == t ? ld_after_wait(act + (i64)r * I + c * 128 + 32 * t + 8 * wi)
                                    : make_uint4(0u, 0u, 0u, 0u));
        float a2[2] = {0.f, 0.f};
        t1_mma(ch[i], b, a2);
        acc[0] += ws[r] * a2[0];
        acc[1] += ws[r] * a2[1];
      }
    }
  }
  if (!waited) pdl_wait();  // no units: the output still follows gate/up (and this call's predecessors)
  t1_quad_sum(acc);
  if (t == 0) red[w][g] = acc[0], red[w][g + 8] = acc[1];
  __syncthreads();
  if (w == 0 && lane < 16) {
    float s = add != nullptr ? bf2f(add[p * 16 + lane]) : 0.f;
    for (int v = 0; v < NW; ++v) s += red[v][lane];
    out[p * 16 + lane] = f2bf(s);
  }
}
