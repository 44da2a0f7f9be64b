// Routed-expert SwiGLU over compressed-tensors pack-quantized INT4 weights (reference/k26.md §4).
// Launches: moe_route (group pairs by local expert, zero the arrival counters) -> moe_gemm<0>
// (gate/up + SiLU·up -> act) -> moe_gemm<1> (down -> y per pair; for T <= fuse_t the last block of
// each 16-row output tile also does the combine) -> moe_combine (Σ_k w·y per token, only T > fuse_t). The
// combine starts each sum from an optional bf16 `add` [T, H] (the shared expert's output), read after the wait.
// moe_route and the two GEMMs are launched with programmatic dependent launch (PDL): moe_route waits for
// the router's ids; gate/up blocks become resident while moe_route runs and wait for it at their start;
// down blocks become resident while gate/up runs, stream their first weight stages, and wait for gate/up
// only before their first read of act.
//
// GEMM tiling: a block owns 16 output rows of one expert (both gate and up rows in mode 0) and one
// work item's tokens (up to 8*NT of the expert's; an expert with more has one item per 8*NT, in
// parallel block rows); its NW warps split K, and for few work items the gate/up K is also
// split over `split` blocks (blockIdx.z) so that every SM streams: each block writes an fp32 partial
// and the last block of a tile to arrive (atomic counter) sums them in split order and applies SiLU.
// Each warp streams its K-slice of packed words and scales through an ST-deep cp.async ring,
// reads them with ldmatrix (word t of a row's 16-byte group piece lands in lane 4g+t: exactly the
// fragment layout below), decodes nibbles to bf16 in registers and runs m16n8k16 tensor-core MMAs
// with the tokens as the N=8 side. Weight bytes are read once per item (from DRAM about once per expert).
//
// K permutation: thread (g, t) of a quad holds word t of a 32-input scale group (inputs 8t..8t+7);
// nibble pairs (i, i+4) become bf16x2 fragments, and the activations get the same permutation
// (byte_perm), so each MMA covers exactly one scale group: the group scale multiplies the MMA result
// in fp32 (q·x is exact in the MMA; no bf16 rounding of q·scale).

#define CG 4                 // scale groups (32 inputs each) per stage: 64 B of words per row
#define ROWW (CG * 4 + 4)    // words per staged row (80 B): 8 rows of an ldmatrix hit 8 distinct bank quads

// Local expert of pair p of the routing (P = T*k*S pairs, p = (t*k + j)*S + s: slice s of expert
// topk_ids[t, j]), or -1 where another rank holds it. S = 1 (whole experts): ids first .. first+E-1 are this
// rank's. S > 1 (each expert cut into S slices of I/S intermediate rows): global slice g = id*S + s lives on
// rank g % W as its local expert g / W, and `first` is this rank.
// 32-bit arithmetic: P < 2^31 pairs (the launcher passes P as an int) and ids of at most E·W / S experts.
__device__ __forceinline__ int local_expert(const i64* ids, int p, i64 first, int E, int S, int W) {
  if (S == 1) {
    const i64 e = ids[p] - first;
    return e >= 0 && e < E ? (int)e : -1;
  }
  const i64 id = ids[p / S];
  if (id < 0 || id >= (i64)E * W) return -1;  // no slice of this rank (and id * S stays an int)
  const int g = (int)id * S + p % S;
  return g % W == (int)first && g / W < E ? g / W : -1;
}

// Pairs p as above; local expert e = local_expert(p).
// offsets[E+1]: sorted rows of expert e are offsets[e]..offsets[e+1]-1; order[row] = pair index.
// items[0..*num_items): the GEMMs' work items (e, j0), one per `tt` tokens of an expert (experts
// ascending): the item covers the expert's sorted rows j0 .. min(j0 + tt, count) - 1, and owns one block
// row of each GEMM grid, so an expert's token passes run in parallel blocks, which read its weights
// at about the same time (L2 serves all but the first). Row order inside an expert is irrelevant: every
// token column of the GEMMs is computed independently. Also zeroes counters[0..ncnt) (the gemm
// kernels' arrival counters). Dynamic smem: 2*E ints. Warp 0 scans the counts 32 experts a step
// (shuffle prefix sums + ballot compaction) instead of one thread walking all E (3.0 -> 1.9 us, H200).
extern "C" __global__ void moe_route(const i64* topk_ids, int P, i64 first, int E, int S, int W, int tt,
                                     int* offsets, int* order, int2* items, int* num_items, int* counters,
                                     int ncnt) {
  pdl_trigger();  // the gate/up blocks may become resident now; they wait for this grid to finish
  extern __shared__ int cnt[];  // [E] counts, then [E] cursors
  int* cur = cnt + E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
  // Launched with PDL (when the launcher's PDL is on): topk_ids is complete after this. No global write
  // before it: this call's workspace may be memory the allocator took back from a kernel still running.
  pdl_wait();
  for (int i = threadIdx.x; i < ncnt; i += blockDim.x) counters[i] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    const int e = local_expert(topk_ids, p, first, E, S, W);
    if (e >= 0) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int base = 0, ibase = 0;  // rows and work items before this step's 32
    for (int e0 = 0; e0 < E; e0 += 32) {
      const int e = e0 + lane, c = e < E ? cnt[e] : 0, it = (c + tt - 1) / tt;
      int incl = c, iincl = it;  // inclusive prefix sums of the counts and the items over the step
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, d), w = __shfl_up_sync(0xffffffffu, iincl, d);
        if (lane >= d) incl += v, iincl += w;
      }
      if (e < E) offsets[e] = cur[e] = base + incl - c;
      for (int j = 0; j < it; ++j) items[ibase + iincl - it + j] = make_int2(e, j * tt);
      base += __shfl_sync(0xffffffffu, incl, 31);
      ibase += __shfl_sync(0xffffffffu, iincl, 31);
    }
    if (lane == 0) offsets[E] = base, *num_items = ibase;
  }
  __syncthreads();
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    const int e = local_expert(topk_ids, p, first, E, S, W);
    if (e >= 0) order[atomicAdd(&cur[e], 1)] = p;
  }
}

// 8 nibbles (LSB first, stored q+8) -> bf16x2 pairs (0,4) (1,5) (2,6) (3,7) holding q exactly:
// 0x4300|v is bf16(128+v); one bf16x2 fma subtracts 136.
__device__ __forceinline__ void dequant(u32 w, u32 (&p)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    u32 t;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(t) : "r"(w >> (4 * i)), "n"(0x000F000F), "n"(0x43004300));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(p[i]) : "r"(t), "r"(0x3F803F80u), "r"(0xC308C308u));
  }
}

template <int MT>
struct Stage {  // one warp's share of one pipeline stage
  u32 w[MT][16 * ROWW];  // packed words, 16 rows x CG groups x 4 words (+pad)
  u16 s[MT][16 * CG];    // bf16 scales, 16 rows x CG groups (8 B per row)
};

// Weights in the tiled order (verifier_service/int4.py: tile_int4): a 16-row tile's chunk c (128 inputs) is
// TILE_CW contiguous words, [row][16 words], at tile + c·TILE_CW, and its scales TILE_CS contiguous bf16,
// [row][4], at the scale tile + c·TILE_CS; a tile starts where its first row would in row order.
#define TILE_CW (16 * CG * 4)
#define TILE_CS (16 * CG)

// One warp's cp.async ring over its K-slice of a 16-row tile (MT matrices): chunks gc = slot,
// slot + stride, ... Lane copies 16-byte pieces (row lane/4 + 8j, group lane%4) of every matrix, j = 0,
// 1, and lanes 0-15 the 8 bytes of row `lane`'s scales; sources advance by `stride` chunks per issue.
// Split from the K loop so that a block can put its first stages in flight as soon as it knows its
// expert, before the dependent loads (offsets, order, x) that the loop needs.
template <int MT, int ST>
struct WeightRing {
  const u32* wsrc[MT];
  const u16* ssrc[MT];
  i64 wstep;
  int wadv, sadv;
  u32 ring_sh, st_issue, cp_w, cp_s;

  __device__ __forceinline__ void init(Stage<MT>* ring, const u32* const (&Wm)[MT], const u16* const (&Sm)[MT],
                                       int slot, int stride) {
    const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      wsrc[m] = Wm[m] + slot * TILE_CW + g * CG * 4 + t * 4;
      ssrc[m] = Sm[m] + slot * TILE_CS + (lane & 15) * CG;
    }
    wstep = 8 * CG * 4;  // row g -> g + 8
    wadv = stride * TILE_CW, sadv = stride * TILE_CS;
    ring_sh = st_issue = smem_addr(ring);
    cp_w = (g * ROWW + t * 4) * 4, cp_s = 16 * ROWW * 4 * MT + (lane & 15) * CG * 2;  // byte offsets
  }
  __device__ __forceinline__ void issue() {
    const int lane = threadIdx.x;
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      const u32 dst = st_issue + m * 16 * ROWW * 4 + cp_w;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(wsrc[m]));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + 8 * ROWW * 4), "l"(wsrc[m] + wstep));
      if (lane < 16)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(st_issue + cp_s + m * 16 * CG * 2), "l"(ssrc[m]));
      wsrc[m] += wadv;
      ssrc[m] += sadv;
    }
    st_issue = st_issue + sizeof(Stage<MT>) == ring_sh + ST * sizeof(Stage<MT>) ? ring_sh : st_issue + sizeof(Stage<MT>);
  }
  __device__ __forceinline__ void prologue(int nch) {  // the first ST-1 of the warp's nch chunks
#pragma unroll
    for (int s = 0; s < ST - 1; ++s) {
      if (s < nch) issue();
      cp_async_commit();
    }
  }
};

// 16 bytes of B for the first chunk, by a volatile asm load, so that it stays after the griddepcontrol.wait before
// it: B is __restrict__ const, which lets the compiler hoist plain loads of it above that wait (it did, once the
// wait was behind a runtime condition: the down kernel read act before gate/up had written it).
__device__ __forceinline__ uint4 ld_after_wait(const u16* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}

// One warp's K loop for one pass, its ring's prologue already issued: acc[m][n] (16 rows x 8 tokens,
// fragment layout of mma_bf16) += Σ over the warp's nch chunks of scale · (q · x), for the NV <= NT
// token tiles that hold real tokens (compile-time, so the chunk body has no branches). xr[n]: this
// lane's token row of B, + 8t, at the warp's first chunk; x advances `stride` chunks per chunk.
// WAIT_X: griddepcontrol.wait before the first read of B (the down GEMM's weights stream in while the
// gate/up kernel that writes its B still runs).
template <int MT, int ST, int NT, int NV, bool WAIT_X>
__device__ __forceinline__ void warp_gemm(WeightRing<MT, ST>& wring, const u16* const (&xr)[NT], int stride, int nch,
                                          float (&acc)[MT][NT][4]) {
  const int lane = threadIdx.x, g = lane >> 2;
  const u32 ring_sh = wring.ring_sh;
  // ldmatrix: lanes 8j..8j+7 address rows 0-7 (j even) / 8-15 (j odd) of group j/2 (+2 for the 2nd).
  const u32 lm = ((lane & 7) + 8 * ((lane >> 3) & 1)) * ROWW * 4 + (lane >> 4) * 16;
  const u16* xp[NV];  // x of the next chunk to load
#pragma unroll
  for (int n = 0; n < NV; ++n) xp[n] = xr[n];
  const int xadv = stride * CG * 32;
  uint4 xc[NV][CG];  // activations of chunk c, refilled with chunk c+1 right after use (one ahead)
  if (WAIT_X) pdl_wait();
  if (nch > 0) {
#pragma unroll
    for (int n = 0; n < NV; ++n) {
#pragma unroll
      for (int q = 0; q < CG; ++q) xc[n][q] = ld_after_wait(xp[n] + q * 32);
      xp[n] += xadv;
    }
  }
  u32 st_use = ring_sh;  // stage being consumed
  for (int c = 0; c < nch; ++c) {
    cp_async_wait<ST - 2>();
    __syncwarp();
    if (c + ST - 1 < nch) wring.issue();
    cp_async_commit();
    u32 wr[MT][2][4];  // [m][group pair][lo q, hi q, lo q+1, hi q+1] (lo: row g, hi: row g+8)
    uint2 sc[MT][2];   // [m][row g, g+8]: 4 bf16 scales each
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      const u32 wb = st_use + m * 16 * ROWW * 4 + lm, sb = st_use + 16 * ROWW * 4 * MT + m * 16 * CG * 2;
      ldsm4(wr[m][0], wb);
      ldsm4(wr[m][1], wb + 32);
      asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(sc[m][0].x), "=r"(sc[m][0].y) : "r"(sb + g * CG * 2));
      asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(sc[m][1].x), "=r"(sc[m][1].y) : "r"(sb + (g + 8) * CG * 2));
    }
    st_use = st_use + sizeof(Stage<MT>) == ring_sh + ST * sizeof(Stage<MT>) ? ring_sh : st_use + sizeof(Stage<MT>);
    const bool more = c + 1 < nch;
#pragma unroll
    for (int q = 0; q < CG; ++q) {
      u32 b[NV][4];
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        const uint4 r = xc[n][q];
        b[n][0] = __byte_perm(r.x, r.z, 0x5410);  // inputs (0,4)
        b[n][1] = __byte_perm(r.x, r.z, 0x7632);  // (1,5)
        b[n][2] = __byte_perm(r.y, r.w, 0x5410);  // (2,6)
        b[n][3] = __byte_perm(r.y, r.w, 0x7632);  // (3,7)
        if (more) xc[n][q] = *reinterpret_cast<const uint4*>(xp[n] + q * 32);
      }
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        u32 lo[4], hi[4];
        dequant(wr[m][q >> 1][2 * (q & 1)], lo);
        dequant(wr[m][q >> 1][2 * (q & 1) + 1], hi);
        const u32 s0 = (q >> 1) ? sc[m][0].y : sc[m][0].x, s1 = (q >> 1) ? sc[m][1].y : sc[m][1].x;
        const float slo = __uint_as_float((q & 1) ? s0 & 0xFFFF0000u : s0 << 16);
        const float shi = __uint_as_float((q & 1) ? s1 & 0xFFFF0000u : s1 << 16);
#pragma unroll
        for (int n = 0; n < NV; ++n) {
          float d[4] = {0.f, 0.f, 0.f, 0.f};
          mma_bf16(d, lo[0], hi[0], lo[1], hi[1], b[n][0], b[n][1]);
          mma_bf16(d, lo[2], hi[2], lo[3], hi[3], b[n][2], b[n][3]);
          acc[m][n][0] += slo * d[0];
          acc[m][n][1] += slo * d[1];
          acc[m][n][2] += shi * d[2];
          acc[m][n][3] += shi * d[3];
        }
      }
    }
#pragma unroll
    for (int n = 0; n < NV; ++n) xp[n] += xadv;
  }
  cp_async_wait<0>();
}

// Last-arriver election: every block of a group bumps *cnt once after its global writes; the block
// that makes it `expected` gets true and may read what the others wrote (through L2: __ldcg).
// One thread fences (as cooperative groups' grid sync): the barrier orders the block's writes before
// it; a fence in every thread cost the down kernel ~10% of its cycles in membar stalls (ncu, H200).
__device__ __forceinline__ bool arrive_last(int* cnt, int expected) {
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0 && threadIdx.y == 0) {
    __threadfence();
    last = atomicAdd(cnt, 1) == expected - 1;
    __threadfence();
  }
  __syncthreads();
  return last;
}

// Four bf16 of `add` [T, H] at (tok, h) as fp32, or zeros when add is null.
__device__ __forceinline__ void load_add4(const u16* add, int H, int tok, int h, float* a) {
  if (add == nullptr) {
    a[0] = a[1] = a[2] = a[3] = 0.f;
    return;
  }
  const uint2 v = *reinterpret_cast<const uint2*>(add + (i64)tok * H + h);
  a[0] = bf2f(v.x & 0xffff), a[1] = bf2f(v.x >> 16), a[2] = bf2f(v.y & 0xffff), a[3] = bf2f(v.y >> 16);
}

// out[t, row0..row0+15] = bf16(add[t, rows] + Σ_s owned(t,s) topk_w[t,s/S] · y[t*k+s, rows]), the sum from add
// (0 when null) in slot order; k = the routing's k·S slots a token.
__device__ void combine_tile(const float* y, const i64* ids, const float* tw, i64 first, int E, int S, int W,
                             int k, int T, int H, int row0, const u16* add, u16* out) {
  const int tid = threadIdx.y * 32 + threadIdx.x, nthr = 32 * blockDim.y;
  for (int idx = tid; idx < T * 4; idx += nthr) {
    const int tok = idx >> 2, h = row0 + 4 * (idx & 3);
    float a[4];
    load_add4(add, H, tok, h, a);
    for (int s = 0; s < k; ++s) {
      const int p = tok * k + s;
      if (local_expert(ids, p, first, E, S, W) < 0) continue;
      const float w = tw[p / S];
      const float4 v = __ldcg(reinterpret_cast<const float4*>(y + (i64)p * H + h));
      a[0] += w * v.x, a[1] += w * v.y, a[2] += w * v.z, a[3] += w * v.w;
    }
    *reinterpret_cast<uint2*>(out + (i64)tok * H + h) = make_uint2(pack_bf16x2(a[0], a[1]), pack_bf16x2(a[2], a[3]));
  }
}

// Gate/up K split for `na` work items: the fewest blocks per tile that keep the chip's `slots`
// resident blocks busy, by waves x (chunks per warp + 2 of fixed cost). Same answer in every block.
__device__ __forceinline__ int pick_split(int na, int tiles, int chunks, int nw, int slots, int smax) {
  int best = 1;
  float best_cost = 3e38f;
  for (int s = 1; s <= smax; ++s) {
    const int waves = (tiles * na * s + slots - 1) / slots;
    const float cost = waves * ((float)chunks / (s * nw) + 2.f);
    if (cost < best_cost) best = s, best_cost = cost;
  }
  return best;
}

// Cross-warp sum of one pass's accumulators, per group of `per` warps (group gi = warps [gi*per,
// (gi+1)*per): one 16-row tile each), added in warp order (deterministic). Thread (gi, n, lane), n < ntv,
// then calls fin(gi, n, lane, v[MT][4]) with its group's sums in the fragment layout of mma_bf16.
// Requires (NW / per) * NT <= NW.
template <int MT, int NT, typename Fin>
__device__ __forceinline__ void block_sum(void* smem, const float (&acc)[MT][NT][4], int ntv, int per, Fin fin) {
  const int lane = threadIdx.x, warp = threadIdx.y, NW = blockDim.y, tid = warp * 32 + lane;
  __syncthreads();  // every warp is done with its ring: reuse it
  float4* red = reinterpret_cast<float4*>(smem);  // [NW][MT][NT][32]
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < NT; ++n)
      red[((warp * MT + m) * NT + n) * 32 + lane] = make_float4(acc[m][n][0], acc[m][n][1], acc[m][n][2], acc[m][n][3]);
  __syncthreads();
  if (tid < NW / per * ntv * 32) {
    const int gi = tid / (ntv * 32), n = (tid >> 5) % ntv, l = tid & 31;
    float v[MT][4] = {};
    for (int w = gi * per; w < (gi + 1) * per; ++w)
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        const float4 r = red[((w * MT + m) * NT + n) * 32 + l];
        v[m][0] += r.x, v[m][1] += r.y, v[m][2] += r.z, v[m][3] += r.w;
      }
    fin(gi, n, l, v);
  }
  __syncthreads();  // the next pass refills the ring
}

// MODE 0: W0/S0 = gate, W1/S1 = up [E, N, K/8] / [E, N, K/32]; B = x [T, K]; out = act bf16 [P, N]
//         (row = sorted row), act = silu(gate·x) * (up·x). Grid (N/16, items max, smax): blocks with
//         z >= split (pick_split, or split_force) exit; for split > 1 they write fp32 partials to
//         part [smax, P, 2, N] and counters[y * N/16 + x] elects the block that finishes the tile.
// MODE 1: W0/S0 = down; B = act [P, K]; out = y fp32 [P, N] (row = pair index), unweighted. A tile is
//         16·DMT rows: each warp streams DMT 16-row pieces of it against the same act fragments (more
//         bytes in flight per warp for the short K = I). Grid (N/(16·DMT), items max, 1). fuse:
//         counters[tile] elects the last item's block of each output tile, which writes its rows of
//         final_out (combine_tile); with no work item block (x, 0) does.
// Both modes: block y works on items[y] (y >= na exit); block x owns tile x, its NW warps splitting K,
// while there are few items (na); with more (tpb_max > 1 and 2·na·tiles >= slots·tpb_max) it owns tiles
// tpb·x .. tpb·x + tpb-1, NW/tpb warps each, so every warp streams tpb x the K (longer cp.async streams),
// and blocks x >= tiles/tpb exit.
// H200: 4 warps per down tile are best for one expert, 2 for 2-55; gate/up gains from 3 experts.
// PDL: MODE 0 waits for moe_route before its first read, then (blocks with work) lets MODE 1 be
// scheduled. MODE 1 reads only moe_route's outputs before its wait, which are complete: every MODE 0
// block waited for them before triggering. Every MODE 1 block with work waits before reading act, so
// MODE 1 completes after MODE 0 (with no work item MODE 0 writes nothing).
// Block (32, NW), NW <= 8; dynamic smem NW*ST*sizeof(Stage<MT>). Requires K % (32*CG) == 0,
// N % (16*DMT) == 0.
// OCC: blocks of 256 threads per SM for the register budget: 2 (128 registers), or 4 (64) for the
// one-token-tile, one-piece down kernel (8 blocks of 4 warps per SM). The launcher runs down with two
// pieces per warp for T > 1 (128 registers: faster than one piece at 64) and one piece at 128 for
// T = 1 (one expert, T = 1 decode at EP 7: the K loop keeps more loads in flight).
#define GEMM_PARAMS const u32* __restrict__ W0, const u16* __restrict__ S0, const u32* __restrict__ W1,             \
    const u16* __restrict__ S1, const u16* __restrict__ B, int K, int N, int k_route, int P, const int* offsets,       \
    const int* order, const int2* items, const int* num_items, void* out, float* part, int* counters, int slots,    \
    int smax, int split_force, const i64* ids, const float* tw, u16* final_out, const u16* add, i64 first, int E,    \
    int S, int W, int T, int fuse, int tpb_max
#define GEMM_ARGS W0, S0, W1, S1, B, K, N, k_route, P, offsets, order, items, num_items, out, part, counters,          \
    slots, smax, split_force, ids, tw, final_out, add, first, E, S, W, T, fuse, tpb_max

// The body of moe_gemm for na work items, (e, j0) = items[blockIdx.y]: expert e's sorted rows j0 ..
// j0 + 8·NT - 1 (those it has), one weight pass.
template <int MODE, int NT, int DMT, int ST>
__device__ __forceinline__ void gemm_block(GEMM_PARAMS, int na, int e, int j0) {
  constexpr int MT = MODE == 0 ? 2 : DMT, RT = MODE == 0 ? 16 : 16 * DMT;  // matrices per warp, rows per tile
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.y, NW = blockDim.y, tiles = N / RT;
  if ((int)blockIdx.y >= na) {
    if (MODE == 1 && fuse && na == 0 && blockIdx.y == 0) {
      if (add != nullptr) pdl_wait();  // add's producer may be a PDL predecessor
      for (int m = 0; m < MT; ++m)
        combine_tile(nullptr, ids, tw, first, E, S, W, k_route, T, N, blockIdx.x * RT + 16 * m, add, final_out);
    }
    return;
  }
  const int KW = K / 8, KG = K / 32, chunks = KG / CG;
  const int split = MODE == 1 ? 1 : split_force > 0 ? min(split_force, smax)
                                                    : pick_split(na, tiles, chunks, NW, slots, smax);
  if ((int)blockIdx.z >= split) return;
  // Tiles per block: tpb_max (its warps split into tpb groups, each streaming one tile over tpb x the
  // K per warp: longer cp.async streams) once >= 2 experts are active and blocks of tpb tiles still
  // fill half the `slots` (H200: gate/up from 3 experts, down from 2; block_sum needs tpb * NT <= NW).
  int tpb = na >= 2 && split == 1 && 2 * na * tiles >= slots * tpb_max ? tpb_max : 1;
  if (tpb < 1 || tiles % tpb || NW % tpb || tpb * NT > NW) tpb = 1;
  if ((int)blockIdx.x * tpb >= tiles) return;
  const int per = NW / tpb, row0 = (blockIdx.x * tpb + warp / per) * RT;  // warps per tile, this warp's tile
  if (MODE == 0) pdl_trigger();  // the down kernel may be scheduled (it waits for this grid before act)
  const int g = threadIdx.x >> 2, t = threadIdx.x & 3;
  // Warp slot w of split block z takes chunks w + z*per, then every split*per: a tile's warps read
  // adjacent 64-byte pieces of each row at about the same time (64*per contiguous bytes per row).
  const int slot = blockIdx.z * per + warp % per, stride = split * per;
  const int nch = slot < chunks ? (chunks - slot + stride - 1) / stride : 0;
  const u32* Wm[MT];
  const u16* Sm[MT];
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    // MODE 0: gate and up rows row0..+15; MODE 1: down rows row0 + 16m..+15 (DMT 16-row pieces)
    const int r = MODE == 0 ? row0 : row0 + 16 * m;
    Wm[m] = (MODE == 0 && m ? W1 : W0) + ((i64)e * N + r) * KW;
    Sm[m] = (MODE == 0 && m ? S1 : S0) + ((i64)e * N + r) * KG;
  }
  Stage<MT>* ring = reinterpret_cast<Stage<MT>*>(smem) + warp * ST;
  WeightRing<MT, ST> wring;
  // The weights depend on the expert only: their first stages go out now, and the dependent round
  // trips for the tokens (offsets -> order -> x) overlap their DRAM latency.
  wring.init(ring, Wm, Sm, slot, stride);
  wring.prologue(nch);
  const int off = offsets[e] + j0, n_e = min(offsets[e + 1] - off, 8 * NT);  // this item's rows
  const int ntv = min(NT, (n_e + 7) / 8);  // n-tiles with at least one real token (warp-uniform)
  const u16* xr[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const int j = min(8 * n + g, n_e - 1);  // clamp: padded columns compute garbage that is never stored
    xr[n] = B + (i64)(MODE == 0 ? order[off + j] / k_route : off + j) * K + 8 * t + slot * CG * 32;
  }
  float acc[MT][NT][4] = {};
  if (NT > 1 && ntv == 1)
    warp_gemm<MT, ST, NT, 1, MODE == 1>(wring, xr, stride, nch, acc);
  else
    warp_gemm<MT, ST, NT, NT, MODE == 1>(wring, xr, stride, nch, acc);
  block_sum<MT, NT>(smem, acc, ntv, per, [&](int gi, int n, int l, const float (&v)[MT][4]) {
    const int r0 = (blockIdx.x * tpb + gi) * RT;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int j = 8 * n + 2 * (l & 3) + (i & 1), row = r0 + (l >> 2) + 8 * (i >> 1);
      if (j >= n_e) continue;
      if constexpr (MODE == 1) {
#pragma unroll
        for (int m = 0; m < MT; ++m) reinterpret_cast<float*>(out)[(i64)order[off + j] * N + row + 16 * m] = v[m][i];
      } else if (split == 1) {
        const float gate = v[0][i], act = gate / (1.f + __expf(-gate)) * v[MT - 1][i];
        reinterpret_cast<u16*>(out)[(i64)(off + j) * N + row] = f2bf(act);
      } else {
#pragma unroll
        for (int m = 0; m < MT; ++m) part[(((i64)blockIdx.z * P + off + j) * 2 + m) * N + row] = v[m][i];
      }
    }
  });
  const int tid = warp * 32 + threadIdx.x;
  if (MODE == 0 && split > 1 && arrive_last(&counters[blockIdx.y * tiles + blockIdx.x], split)) {
    for (int idx = tid; idx < n_e * 16; idx += 32 * NW) {  // finish the tile: Σ partials in split order
      const int j = idx >> 4, row = row0 + (idx & 15);
      float gate = 0.f, up = 0.f;
      for (int z = 0; z < split; ++z) {
        gate += __ldcg(&part[(((i64)z * P + off + j) * 2 + 0) * N + row]);
        up += __ldcg(&part[(((i64)z * P + off + j) * 2 + 1) * N + row]);
      }
      reinterpret_cast<u16*>(out)[(i64)(off + j) * N + row] = f2bf(gate / (1.f + __expf(-gate)) * up);
    }
  }
  if (MODE == 1 && fuse)
    for (int gi = 0; gi < tpb; ++gi) {
      const int tile = blockIdx.x * tpb + gi;
      if (arrive_last(&counters[tile], na))
        for (int m = 0; m < MT; ++m)
          combine_tile(reinterpret_cast<const float*>(out), ids, tw, first, E, S, W, k_route, T, N,
                       tile * RT + 16 * m, add, final_out);
    }
}

// DMT = 0 (down only): two pieces per warp once the blocks with work still fill every resident slot
// (na · N/32 / tpb_max >= slots: 3 or more experts at K2.6 sizes on an H200), else one. The host
// cannot see the active count, so the grid is sized for one piece (N/16 tiles); with two, the blocks
// past N/32 exit. H200, T = 1, us, one piece -> two: 3 experts 47.6 -> 44.1, 8 experts 97.2 -> 91.2;
// but 2 experts 32.0 -> 37.5 (224 blocks with work for 264 slots), 1 expert 23.2 -> 25.2.
template <int MODE, int NT, int OCC, int DMT, int ST>
__global__ void __launch_bounds__(256, OCC) moe_gemm(GEMM_PARAMS) {
  if (MODE == 0) pdl_wait();  // for moe_route's outputs (MODE 1 reads only those before its own wait)
  // items[y] is loaded with the count (not after it) so the two round trips overlap; for y >= na it
  // is an unwritten slot of the list and goes unused.
  const int na = *num_items;
  const int2 item = items[blockIdx.y];
  if (DMT == 0 && na * (N / (32 * tpb_max)) >= slots)
    gemm_block<MODE, NT, 2, ST>(GEMM_ARGS, na, item.x, item.y);
  else
    gemm_block<MODE, NT, DMT == 0 ? 1 : DMT, ST>(GEMM_ARGS, na, item.x, item.y);
}

// ---- Down over the concatenated K of every local item, one token tile of 8 per block ----
// out[t, h] = bf16(add[t, h] + Σ_items w(item, t) · Σ_k down_e(item)[h, k] · act(item, t)[k]): one GEMM whose K runs
// over the items' I-chunks back to back and whose 8 columns are the tokens of one token tile (an item's act row
// for token t, or zeros where t does not route to it). Each item's router weight scales its products in fp32,
// with the group scale. Work units stay long when the items are short (expert slices: K = I/S), and there is
// no per-pair y and no combine pass. Grid (tiles · ntt, zmax), block (32, NW): blockIdx.x = row tile · ntt +
// token tile, so a row tile's token tiles run side by side and share its weights through L2. A block keeps
// the items with a token in its tile (in item order: the sums' order is fixed), and block z of them takes
// the chunks c = z·NW + warp + j·Z·NW of their nc·CPI chunks (Z from na on the device; blocks z >= Z exit).
// Z > 1: fp32 partials part[z][t][h], summed in z order by the tile's last block. Needs K % 128 == 0 and
// na <= cap (the table rows in shared memory). Items hold up to tt rows of one expert (moe_route's tt).
struct CatTables {  // in shared memory after the ring, cap rows each
  int* e;           // kept item -> local expert
  int (*row)[8];    // kept item, token column -> act row; -1: the token does not route to it
  float (*w)[8];    // kept item, token column -> router weight (0 where row is -1)
  int* n;           // the number of kept items
};

template <int MT, int ST>
struct CatRing {  // WeightRing over a concatenated chunk list: each issue addresses its own item's matrix
  const u32* W;
  const u16* Sc;
  const int* etab;
  i64 rowN[MT];
  int ci, stride, cpi, KW, KG, N;
  u32 ring_sh, st_issue, cp_w, cp_s, lw, ls;

  __device__ __forceinline__ void init(Stage<MT>* ring, const u32* W_, const u16* S_, const int* e, int row0,
                                       int first, int stride_, int cpi_, int K, int N_) {
    const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
    W = W_, Sc = S_, etab = e, ci = first, stride = stride_, cpi = cpi_, KW = K / 8, KG = K / 32, N = N_;
#pragma unroll
    for (int m = 0; m < MT; ++m) rowN[m] = row0 + 16 * m;
    lw = g * CG * 4 + t * 4, ls = (lane & 15) * CG;
    ring_sh = st_issue = smem_addr(ring);
    cp_w = (g * ROWW + t * 4) * 4, cp_s = 16 * ROWW * 4 * MT + (lane & 15) * CG * 2;
  }
  __device__ __forceinline__ void issue() {
    const int lane = threadIdx.x, it = ci / cpi, kc = ci - it * cpi;
    const i64 e = etab[it];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      const u32* ws = W + (e * N + rowN[m]) * KW + kc * TILE_CW + lw;
      const u16* ss = Sc + (e * N + rowN[m]) * KG + kc * TILE_CS + ls;
      const u32 dst = st_issue + m * 16 * ROWW * 4 + cp_w;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(ws));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + 8 * ROWW * 4), "l"(ws + 8 * CG * 4));
      if (lane < 16)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(st_issue + cp_s + m * 16 * CG * 2), "l"(ss));
    }
    ci += stride;
    st_issue = st_issue + sizeof(Stage<MT>) == ring_sh + ST * sizeof(Stage<MT>) ? ring_sh : st_issue + sizeof(Stage<MT>);
  }
};

// This lane's 16-byte pieces of token column g's act for chunk c (zeros where g does not route to the chunk's item).
__device__ __forceinline__ void cat_load_x(const CatTables& tb, const u16* act, int K, int cpi, int c, int g, int t,
                                           uint4 (&xc)[CG]) {
  const int it = c / cpi, kc = c - it * cpi, row = tb.row[it][g];
#pragma unroll
  for (int q = 0; q < CG; ++q)
    xc[q] = row < 0 ? make_uint4(0, 0, 0, 0) : ld_after_wait(act + (i64)row * K + kc * 128 + 8 * t + q * 32);
}

// Rows [off, off + n) of item i: its expert's rows from item.y, at most tt.
__device__ __forceinline__ int2 cat_item_rows(const int2* items, const int* offsets, int i, int tt) {
  const int2 item = items[i];
  const int off = offsets[item.x] + item.y;
  return make_int2(off, min(tt, offsets[item.x + 1] - off));
}

// The block's tables: the items with a token in tokens [tok0, tok0 + 8), kept in item order (warp 0's ballot scan:
// the chunk order, and so every sum's order, depends on the routing only), their experts, act rows and weights.
__device__ __forceinline__ void cat_tables(CatTables& tb, int* kept, const int2* items, int na, int tt,
                                           const int* offsets, const int* order, int k_route, const float* tw, int S,
                                           int tok0) {
  const int tid = threadIdx.y * 32 + threadIdx.x, nthr = 32 * blockDim.y, lane = threadIdx.x;
  if (threadIdx.y == 0) {
    int nk = 0;
    for (int base = 0; base < na; base += 32) {
      bool mine = false;
      if (base + lane < na) {
        const int2 r = cat_item_rows(items, offsets, base + lane, tt);
        for (int j = 0; j < r.y && !mine; ++j) mine = (unsigned)(order[r.x + j] / k_route - tok0) < 8u;
      }
      const unsigned m = __ballot_sync(0xFFFFFFFFu, mine);
      if (mine) kept[nk + __popc(m & ((1u << lane) - 1))] = base + lane;
      nk += __popc(m);
    }
    if (lane == 0) *tb.n = nk;
  }
  __syncthreads();
  const int nk = *tb.n;
  for (int i = tid; i < nk * 8; i += nthr) tb.row[i >> 3][i & 7] = -1, tb.w[i >> 3][i & 7] = 0.f;
  for (int i = tid; i < nk; i += nthr) tb.e[i] = items[kept[i]].x;
  __syncthreads();
  for (int i = tid; i < nk * tt; i += nthr) {  // kept item i / tt's (i % tt)-th row
    const int2 r = cat_item_rows(items, offsets, kept[i / tt], tt);
    const int j = i % tt;
    if (j < r.y) {
      const int p = order[r.x + j], col = p / k_route - tok0;
      if ((unsigned)col < 8u) tb.row[i / tt][col] = r.x + j, tb.w[i / tt][col] = tw[p / S];
    }
  }
  __syncthreads();
}

// out = add for the tile's tokens: no local item has a token in it.
__device__ __forceinline__ void cat_copy_add(const u16* add, u16* out, int T, int N, int row0, int RT, int tok0) {
  const int tid = threadIdx.y * 32 + threadIdx.x, cols = min(8, T - tok0);
  pdl_wait();
  for (int idx = tid; idx < cols * RT; idx += 32 * blockDim.y) {
    const i64 h = (i64)(tok0 + idx / RT) * N + row0 + idx % RT;
    out[h] = add == nullptr ? (u16)0 : add[h];
  }
}

template <int MT, int ST>
__device__ __forceinline__ void cat_mma(const CatTables& tb, u32 st_use, int it, const uint4 (&xc)[CG],
                                        float (&acc)[MT][4]) {
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  const u32 lm = ((lane & 7) + 8 * ((lane >> 3) & 1)) * ROWW * 4 + (lane >> 4) * 16;
  const float w0 = tb.w[it][2 * t], w1 = tb.w[it][2 * t + 1];
  u32 wr[MT][2][4];
  uint2 sc[MT][2];
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    const u32 wb = st_use + m * 16 * ROWW * 4 + lm, sb = st_use + 16 * ROWW * 4 * MT + m * 16 * CG * 2;
    ldsm4(wr[m][0], wb);
    ldsm4(wr[m][1], wb + 32);
    asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(sc[m][0].x), "=r"(sc[m][0].y) : "r"(sb + g * CG * 2));
    asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(sc[m][1].x), "=r"(sc[m][1].y) : "r"(sb + (g + 8) * CG * 2));
  }
  // The same steps as warp_gemm's, written again on purpose: helpers shared by both kernels changed moe_gemm's code
  // generation and cost its whole-expert down 9 % at 16 tokens (H100, session 43, docs/kernel-notes/moe_w4a16.md).
  u32 b[CG][4];
#pragma unroll
  for (int q = 0; q < CG; ++q) {
    const uint4 r = xc[q];
    b[q][0] = __byte_perm(r.x, r.z, 0x5410), b[q][1] = __byte_perm(r.x, r.z, 0x7632);
    b[q][2] = __byte_perm(r.y, r.w, 0x5410), b[q][3] = __byte_perm(r.y, r.w, 0x7632);
  }
#pragma unroll
  for (int q = 0; q < CG; ++q)
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      u32 lo[4], hi[4];
      dequant(wr[m][q >> 1][2 * (q & 1)], lo);
      dequant(wr[m][q >> 1][2 * (q & 1) + 1], hi);
      const u32 s0 = (q >> 1) ? sc[m][0].y : sc[m][0].x, s1 = (q >> 1) ? sc[m][1].y : sc[m][1].x;
      const float slo = __uint_as_float((q & 1) ? s0 & 0xFFFF0000u : s0 << 16);
      const float shi = __uint_as_float((q & 1) ? s1 & 0xFFFF0000u : s1 << 16);
      float d[4] = {0.f, 0.f, 0.f, 0.f};
      mma_bf16(d, lo[0], hi[0], lo[1], hi[1], b[q][0], b[q][1]);
      mma_bf16(d, lo[2], hi[2], lo[3], hi[3], b[q][2], b[q][3]);
      acc[m][0] += slo * w0 * d[0];
      acc[m][1] += slo * w1 * d[1];
      acc[m][2] += shi * w0 * d[2];
      acc[m][3] += shi * w1 * d[3];
    }
}

template <int MT, int ST>
__global__ void __launch_bounds__(256, 2) moe_down_cat(const u32* __restrict__ W, const u16* __restrict__ Sc,
    const u16* act, int K, int N, int k_route, const int* offsets, const int* order, const int2* items,
    const int* num_items, int cap, int tt, float* part, int* counters, int slots, int zmax, const float* tw, int S,
    const u16* add, u16* out, int T) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.y, NW = blockDim.y, lane = threadIdx.x, tid = warp * 32 + lane;
  const int RT = 16 * MT, ntt = (T + 7) / 8, tiles = N / RT, row0 = (blockIdx.x / ntt) * RT;
  const int tok0 = (blockIdx.x % ntt) * 8, cols = min(8, T - tok0);
  const int na = *num_items, cpi = K / (32 * CG);
  // K-split blocks per tile from the mean items per token tile: every block of a tile agrees before its scan
  const int Z = min(zmax, max(1, min((na + ntt - 1) / ntt * cpi / (2 * NW), (slots + tiles * ntt - 1) / (tiles * ntt))));
  if ((int)blockIdx.y >= Z) return;
  unsigned char* tabs = smem + NW * ST * sizeof(Stage<MT>);
  CatTables tb{reinterpret_cast<int*>(tabs), reinterpret_cast<int(*)[8]>(tabs + 4 * cap),
               reinterpret_cast<float(*)[8]>(tabs + 36 * cap), reinterpret_cast<int*>(tabs + 68 * cap)};
  cat_tables(tb, tb.n + 1, items, na, tt, offsets, order, k_route, tw, S, tok0);
  const int C = *tb.n * cpi;
  if (C == 0) {
    if (blockIdx.y == 0) cat_copy_add(add, out, T, N, row0, RT, tok0);
    return;
  }
  const int slot = blockIdx.y * NW + warp, stride = Z * NW;
  const int nch = slot < C ? (C - slot + stride - 1) / stride : 0;
  Stage<MT>* ring = reinterpret_cast<Stage<MT>*>(smem) + warp * ST;
  CatRing<MT, ST> cring;
  cring.init(ring, W, Sc, tb.e, row0, slot, stride, cpi, K, N);
#pragma unroll
  for (int s = 0; s < ST - 1; ++s) {  // the weights depend on moe_route's items only: in flight before the wait
    if (s < nch) cring.issue();
    cp_async_commit();
  }
  pdl_wait();  // gate/up has written act
  float acc[MT][4] = {};
  uint4 xc[CG];
  if (nch > 0) cat_load_x(tb, act, K, cpi, slot, lane >> 2, lane & 3, xc);
  u32 st_use = cring.ring_sh;
  for (int c = 0; c < nch; ++c) {
    cp_async_wait<ST - 2>();
    __syncwarp();
    if (c + ST - 1 < nch) cring.issue();
    cp_async_commit();
    const int chunk = slot + c * stride;
    const uint4 xnow[CG] = {xc[0], xc[1], xc[2], xc[3]};
    if (c + 1 < nch) cat_load_x(tb, act, K, cpi, chunk + stride, lane >> 2, lane & 3, xc);  // one chunk ahead
    cat_mma<MT, ST>(tb, st_use, chunk / cpi, xnow, acc);
    st_use = st_use + sizeof(Stage<MT>) == cring.ring_sh + ST * sizeof(Stage<MT>) ? cring.ring_sh
                                                                                    : st_use + sizeof(Stage<MT>);
  }
  cp_async_wait<0>();
  float accn[MT][1][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int i = 0; i < 4; ++i) accn[m][0][i] = acc[m][i];
  block_sum<MT, 1>(smem, accn, 1, NW, [&](int, int, int l, const float (&v)[MT][4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int j = 2 * (l & 3) + (i & 1), row = row0 + (l >> 2) + 8 * (i >> 1);
      if (j >= cols) continue;
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        const i64 h = (i64)(tok0 + j) * N + row + 16 * m;
        if (Z == 1)
          out[h] = f2bf((add == nullptr ? 0.f : bf2f(add[h])) + v[m][i]);
        else
          part[(i64)blockIdx.y * T * N + h] = v[m][i];
      }
    }
  });
  if (Z > 1 && arrive_last(&counters[blockIdx.x], Z))
    for (int idx = tid; idx < cols * RT; idx += 32 * NW) {  // Σ partials in z order, then add
      const i64 h = (i64)(tok0 + idx / RT) * N + row0 + idx % RT;
      float sum = 0.f;
      for (int z = 0; z < Z; ++z) sum += __ldcg(&part[(i64)z * T * N + h]);
      out[h] = f2bf((add == nullptr ? 0.f : bf2f(add[h])) + sum);
    }
}

// out[t] = bf16(add[t] + Σ_s owned(t,s) topk_w[t,s/S] · y[t*k+s]), the sum from add (0 when null) in slot
// order (k = the routing's k·S); tokens with no local expert get add. Grid (T, ceil(H / 1024)); block 128;
// 8 outputs per thread. Requires H % 8 == 0.
extern "C" __global__ void moe_combine(const float* __restrict__ y, const i64* __restrict__ topk_ids,
                                       const float* __restrict__ topk_w, i64 first, int E, int S, int W, int k,
                                       int H, const u16* __restrict__ add, u16* __restrict__ out) {
  const int tok = blockIdx.x, h = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
  if (h >= H) return;
  float acc[8];
  load_add4(add, H, tok, h, acc);
  load_add4(add, H, tok, h + 4, acc + 4);
  for (int s = 0; s < k; ++s) {
    const int p = tok * k + s;
    if (local_expert(topk_ids, p, first, E, S, W) < 0) continue;
    const float w = topk_w[p / S];
    const float4* src = reinterpret_cast<const float4*>(y + (i64)p * H + h);
    const float4 a = src[0], b = src[1];
    acc[0] += w * a.x, acc[1] += w * a.y, acc[2] += w * a.z, acc[3] += w * a.w;
    acc[4] += w * b.x, acc[5] += w * b.y, acc[6] += w * b.z, acc[7] += w * b.w;
  }
  uint4 r = make_uint4(pack_bf16x2(acc[0], acc[1]), pack_bf16x2(acc[2], acc[3]), pack_bf16x2(acc[4], acc[5]),
                       pack_bf16x2(acc[6], acc[7]));
  *reinterpret_cast<uint4*>(out + (i64)tok * H + h) = r;
}
