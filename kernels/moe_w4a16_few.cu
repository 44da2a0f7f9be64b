// moe_w4a16's down GEMM for few tokens (T <= FEW_T): moe_few_down replaces moe_gemm<1> and its fused
// combine. Compiled after moe_w4a16.cu as one unit (dequant, local_expert, ld_after_wait come from there).
//
// Why: few tokens route 1-2 tokens to each of their local experts (a tree of 16 rows at EP 7: ~16-20 experts on the
// slowest rank), and the down GEMM is short (K = I = 16 chunks of 128). moe_gemm<1> streams each item's 16-row tiles
// through a cp.async ring into an fp32 y per pair, and a tile's last block combines them. Here a block owns 16 output
// rows for every local item: each lane loads its weights straight into registers (LDG.128, a batch of chunks in
// flight at once), and the block sums w·down(act) per token itself: no y, no arrival counters. H100, slowest of 7
// ranks, the whole MoE call (session 46): T = 1 with 1 / 3 / 8 experts 22.2 -> 20.3, 46.9 -> 41.2, 100.7 -> 94.0 us;
// T = 2 57.8 -> 52.5. An item of more rows costs one n-tile (two rows) each, act re-read and the MMAs redone: 4 tokens
// on each of 8 experts lose (docs/kernel-notes/moe_w4a16.md, session 46).
//
// Weights in the tiled order (verifier_service/int4.py tile_int4): tile p (16 rows) of expert e, chunk c (128
// inputs) is 256 words [row][16] at ((e·rows/16 + p)·nch + c)·256 and 64 bf16 scales [row][4] at (...)·64, nch =
// inputs / 128. Lane (g, t) of a warp loads the 16 B of rows g and g+8 that hold scale group t of the chunk (words
// 4t..4t+3, inputs 32t..32t+31).
//
// The scale groups on the MMA's N side: m16n8k16 with the weights as A (16 rows), and B column n = scale group n % 4
// of the item's token pair n / 4 of an n-tile (two of the item's rows): lane (g, t) passes row g / 4's inputs where
// g % 4 == t and zeros elsewhere, so D[row][n] is the sum over one group of one row only, and the group scales
// multiply D's columns in fp32 (q·x exact in the MMA, as in moe_gemm). Lane (g, t) gets D columns 2t, 2t+1: row t / 2
// of the n-tile, groups 2(t % 2) and 2(t % 2) + 1, the scales it loaded. Nibble pairs (i, i+4) are A's bf16x2
// fragments (dequant); the inputs are put in the same pair order.

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
__device__ __forceinline__ void mma_few(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One lane's share of one chunk of one matrix: rows g and g+8, scale group t.
struct FewChunk {
  uint4 lo, hi;  // 4 words each
  u32 slo, shi;  // rows g, g+8: bf16 scales of groups 2(t&1) (low half) and 2(t&1)+1
};
__device__ __forceinline__ void few_load(FewChunk& ch, const u32* W, const u16* Sc, i64 tile, int c, int g, int t) {
  const u32* w = W + (tile + c) * 256 + g * 16 + t * 4;
  const u16* s = Sc + (tile + c) * 64 + g * 4 + 2 * (t & 1);
  ch.lo = ldg_stream16(w);
  ch.hi = ldg_stream16(w + 8 * 16);
  ch.slo = ldg_stream4(s);
  ch.shi = ldg_stream4(s + 8 * 4);
}
// acc[0|1] (rows g, g+8) = Σ over the chunk of scale · q · x for D's columns 2t, 2t+1 (the n-tile's row t / 2, groups
// 2(t % 2), 2(t % 2) + 1); b[wi]: the lane's B pairs for word wi (zero unless g % 4 == t).
__device__ __forceinline__ void few_mma(const FewChunk& ch, const uint4 (&b)[4], float (&acc)[2]) {
  float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};  // two chains: even and odd words
  const u32 lw[4] = {ch.lo.x, ch.lo.y, ch.lo.z, ch.lo.w}, hw[4] = {ch.hi.x, ch.hi.y, ch.hi.z, ch.hi.w};
#pragma unroll
  for (int wi = 0; wi < 4; ++wi) {
    u32 lo[4], hi[4];
    dequant(lw[wi], lo);
    dequant(hw[wi], hi);
    float(&d)[4] = (wi & 1) ? d1 : d0;
    mma_few(d, lo[0], hi[0], lo[1], hi[1], b[wi].x, b[wi].y);
    mma_few(d, lo[2], hi[2], lo[3], hi[3], b[wi].z, b[wi].w);
  }
  acc[0] = __uint_as_float(ch.slo << 16) * (d0[0] + d1[0]) + __uint_as_float(ch.slo & 0xffff0000u) * (d0[1] + d1[1]);
  acc[1] = __uint_as_float(ch.shi << 16) * (d0[2] + d1[2]) + __uint_as_float(ch.shi & 0xffff0000u) * (d0[3] + d1[3]);
}

#define FEW_T 32      // most tokens of a call (red's rows)
#define FEW_ROWS 256  // most local pairs (act rows) and work items

// down + the weighted combine after moe_route and moe_gemm<0>: grid H/16, block (32, NW <= 8). Block p writes
// out[τ][16p .. 16p+15] = bf16(add[τ] + Σ_r w_r · down_r(act_r)) for every token τ < T, over act's rows r of moe_route's
// work items (e, j0): rows offsets[e] + j0 .. + min(tt, count_e - j0) - 1, whose pair order[r] = τ·k + j (k counts
// slices: j = j'·S + s for slice s of the token's j'-th expert, weighted by that expert's router weight wts[τ·k/S + j']).
// Sliced experts (S > 1) are local experts with I = I_expert / S: nothing else changes. The units
// (item, chunk) are dealt to the warps CPW at a time (warp w: units w·CPW.., then + NW·CPW), each batch loaded before
// its MMAs; the first batch's weights are in flight before the wait for gate/up. A unit's rows go two per n-tile
// through its loaded weights. Sums, in fixed orders (deterministic): per warp in unit order into red[w][τ], then over
// the warps in order. T <= FEW_T, offsets[E] <= FEW_ROWS (the launcher's bounds).
template <int CPW>
__global__ void __launch_bounds__(256) moe_few_down(const u32* __restrict__ Wd, const u16* __restrict__ Sd,
                                                    const u16* __restrict__ act, const float* __restrict__ wts,
                                                    const int* __restrict__ offsets, const int* __restrict__ order,
                                                    const int2* __restrict__ items, const int* __restrict__ num_items,
                                                    int tt, int k, int S, int E, int T, int H, int I,
                                                    const u16* __restrict__ add, u16* __restrict__ out) {
  __shared__ float red[8][FEW_T][16];
  __shared__ int item_tile[FEW_ROWS], item_row[FEW_ROWS], item_rows[FEW_ROWS];
  __shared__ int row_tok[FEW_ROWS];
  __shared__ float row_w[FEW_ROWS];
  const int lane = threadIdx.x, w = threadIdx.y, g = lane >> 2, t = lane & 3, NW = blockDim.y;
  const int tid = w * 32 + lane, nthr = NW * 32, p = blockIdx.x, nch = I / 128;
  // moe_route's outputs and the router's are final: gate/up triggered this launch after its wait for moe_route
  const int ni = min(*num_items, FEW_ROWS), rows = min(offsets[E], FEW_ROWS);
  for (int i = tid; i < ni; i += nthr) {
    const int2 it = items[i];
    const int r0 = offsets[it.x] + it.y;
    item_tile[i] = it.x * (H / 16) + p;
    item_row[i] = r0;
    item_rows[i] = min(min(tt, offsets[it.x + 1] - r0), rows - r0);
  }
  for (int r = tid; r < rows; r += nthr) {
    const int pair = order[r];
    row_tok[r] = pair / k;
    row_w[r] = wts[pair / S];
  }
  for (int i = tid; i < NW * T * 16; i += nthr) {  // red[v][τ][j] = 0 for the warps v and tokens τ in use
    const int v = i / (T * 16), tau = i / 16 % T, j = i % 16;
    red[v][tau][j] = 0.f;
  }
  __syncthreads();
  const int units = ni * nch;
  float(*mine)[16] = red[w];
  bool waited = false;
  for (int u0 = w * CPW; u0 < units; u0 += NW * CPW) {
    FewChunk ch[CPW];
#pragma unroll
    for (int i = 0; i < CPW; ++i) {
      const int u = u0 + i;
      if (u < units) few_load(ch[i], Wd, Sd, (i64)item_tile[u / nch] * nch, u % nch, g, t);
    }
    if (!waited) pdl_wait();  // act
    waited = true;
#pragma unroll
    for (int i = 0; i < CPW; ++i) {
      const int u = u0 + i;
      if (u >= units) continue;
      const int it = u / nch, c = u % nch, r0 = item_row[it], nr = item_rows[it];
      for (int q0 = 0; q0 < nr; q0 += 2) {  // n-tiles: rows q0, q0 + 1 of the item
        const int q = q0 + (g >> 2);
        uint4 b[4];
#pragma unroll
        for (int wi = 0; wi < 4; ++wi)
          b[wi] = pair_order((g & 3) == t && q < nr ? ld_after_wait(act + (i64)(r0 + q) * I + c * 128 + 32 * t + 8 * wi)
                                                    : make_uint4(0u, 0u, 0u, 0u));
        float a2[2];
        few_mma(ch[i], b, a2);
#pragma unroll
        for (int r = 0; r < 2; ++r) a2[r] += __shfl_xor_sync(0xffffffffu, a2[r], 1);  // the row's four groups
        // lanes t = 0 (row q0) then t = 2 (row q0 + 1): one token may hold two slots of an expert (same red row)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int rr = r0 + q0 + h;
          if (t == 2 * h && q0 + h < nr) {
            const float wt = row_w[rr];
            mine[row_tok[rr]][g] += wt * a2[0];
            mine[row_tok[rr]][g + 8] += wt * a2[1];
          }
          __syncwarp();
        }
      }
    }
  }
  if (!waited) pdl_wait();  // no units: the output still follows gate/up (and this call's predecessors)
  __syncthreads();
  for (int o = tid; o < T * 16; o += nthr) {
    const int tok = o >> 4, row = o & 15;
    const i64 at = (i64)tok * H + p * 16 + row;
    float s = add != nullptr ? bf2f(add[at]) : 0.f;
    for (int v = 0; v < NW; ++v) s += red[v][tok][row];
    out[at] = f2bf(s);
  }
}
