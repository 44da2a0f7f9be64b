// mla_attn_wgmma: the 64-query-row tile of mla_attn on Hopper's warpgroup MMA (sm_90a only; compiled
// after mla_tree_attention.cu, whose Seq, key_slot, mask_scores, softmax_row and split_chunk it uses).
// Why: mma.sync reloads every Q and K fragment through ldmatrix per warp (~573 KB of shared-memory reads
// per 64 x 64 tile) and ran at 220-240 TFLOP/s; wgmma reads its operands from shared memory once per
// warpgroup.
//
// Block = 2 warpgroups (256 threads), 64 flat (row, head) query rows x one split of the keys; 64-key
// tiles in 2 stages, loaded by TMA or cp.async (see the kernel). Per key tile:
//   warpgroup 0: S = Q Kᵀ   36 x wgmma m64n64k16 (A = Q, B = K, both from smem) -> 32 fp32 regs;
//                mask, online softmax (fp32, base 2), P bf16 and the rescale factors alpha -> smem
//   warpgroup 1: meanwhile issues the next tile's loads                                  | barrier
//   both:        O_w = alpha O_w + P V[:, 256w .. 256w+255]   4 x wgmma m64n256k16 (B = V transposed)
//                -> 128 fp32 regs per thread
// Why one warpgroup scores all 64 keys (H200): splitting the keys (m64n32 each, Q read by both) was 3-5 %
// slower; splitting the 576 dims (both warpgroups m64n64, partial S summed through smem) 20-35 % slower, as
// warpgroup 1 then also issues the copies; two accumulator chains per warpgroup did not help.
// wgmma D layout: warp 16 rows, lane 4g+t -> rows g, g+8, columns 8j+2t, +1, in S as in O.
//
// Shared layout: "slab-major" 128-byte swizzle, the canonical wgmma SW128 layout. A 64-row operand of
// 576 bf16 is 9 slabs of 64 dims; slab s, row r sits at s*8192 + r*128, and its 16-byte chunk c at
// chunk c ^ (r & 7). Q and K tiles are K-major (rows = queries / keys); the same K slabs read as
// V[keys, dims] are MN-major (dims contiguous), 8 keys per 1024-byte swizzle atom.

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
struct SmemWG {  // 1024-byte aligned (the swizzle atom)
  unsigned char q[9 * SLAB];
  unsigned char k[2][9 * SLAB];
  unsigned char p[SLAB];  // P [64 rows, 64 keys] bf16, one K-major slab
  u64 bar[2];  // per K stage: the mbarrier its TMA loads complete on
  float red[2][64];  // at the end: each warpgroup's row sums (warpgroup 1's are 0)
  float m[64];
  float alpha[64];  // the tile's rescale factors, for warpgroup 1
  int qrange[4];
};

#define V_LBO SLAB  // V: next 64 dims (MN) = next slab
#define V_SBO 1024  // V: next 8 keys (K) = next 1024-byte atom

// d (+)= A[64 x 16] B[16 x 64]; A, B K-major in shared memory. acc = 0: d = A B.
__device__ __forceinline__ void wgmma_m64n64(float (&d)[8][4], u64 da, u64 db, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,"
      "%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : WG_F4(0), WG_F4(1), WG_F4(2), WG_F4(3), WG_F4(4), WG_F4(5), WG_F4(6), WG_F4(7)
      : "l"(da), "l"(db), "r"(acc));
}

// d[32][4] += A[64 x 16] B[16 x 256]; A K-major, B MN-major (transposed) in shared memory.
__device__ __forceinline__ void wgmma_m64n256_bt(float (&d)[32][4], u64 da, u64 db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,"
      "%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,"
      "%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,"
      "%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,"
      "%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,"
      "%121,%122,%123,%124,%125,%126,%127}, %128, %129, 1, 1, 1, 0, 1;\n"
      : WG_F4(0), WG_F4(1), WG_F4(2), WG_F4(3), WG_F4(4), WG_F4(5), WG_F4(6), WG_F4(7), WG_F4(8), WG_F4(9),
        WG_F4(10), WG_F4(11), WG_F4(12), WG_F4(13), WG_F4(14), WG_F4(15), WG_F4(16), WG_F4(17), WG_F4(18),
        WG_F4(19), WG_F4(20), WG_F4(21), WG_F4(22), WG_F4(23), WG_F4(24), WG_F4(25), WG_F4(26), WG_F4(27),
        WG_F4(28), WG_F4(29), WG_F4(30), WG_F4(31)
      : "l"(da), "l"(db));
}

// S = Q Kᵀ for the 64 keys of one tile: 36 k-steps of 16 dims; k-step kk is 32·(kk % 4) bytes into slab kk / 4.
// Issues the wgmmas; qk_wait completes them.
__device__ __forceinline__ void qk_issue(float (&s)[8][4], u32 q_addr, u32 k_addr) {
  const u64 qd = sw128_desc(q_addr, 16, 1024), kd = sw128_desc(k_addr, 16, 1024);
  fence_regs<8>(s);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 36; ++kk) {
    const u64 off = (u64)(((kk >> 2) * SLAB + (kk & 3) * 32) >> 4);
    wgmma_m64n64(s, qd + off, kd + off, kk > 0);
  }
  wgmma_commit();
}

__device__ __forceinline__ void qk_wait(float (&s)[8][4]) {
  wgmma_wait<0>();
  fence_regs<8>(s);
}

// O_w += P V_w: 4 k-steps of 16 keys; P k-step kk is 32·kk bytes into its slab, V's 2 atoms of 8 keys.
__device__ __forceinline__ void pv_wgmma(float (&o)[32][4], u32 p_addr, u32 v_addr) {
  const u64 pd = sw128_desc(p_addr, 16, 1024), vd = sw128_desc(v_addr, V_LBO, V_SBO);
  fence_regs<32>(o);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_m64n256_bt(o, pd + (u64)(32 * kk >> 4), vd + (u64)(2048 * kk >> 4));
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs<32>(o);
}

// Epilogue: rows ra, ra + 8 of this warpgroup's 256 value dims, normalized by both warpgroups' row sums
// (red[w][row]) -> bf16 out, or fp32 o_part + base-2 LSE (splits; threads 0..63 write one row's LSE).
__device__ __forceinline__ void write_out_wg(const float (&o)[32][4], const SmemWG& sm, const Seq& sq, int w, int ra,
                                             int t4, int tid, bool split, int z, int TH, u16* __restrict__ out,
                                             float* __restrict__ o_part, float* __restrict__ lse_part) {
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int row = ra + 8 * hf;
    if (sq.q0 + row >= sq.q_end) continue;
    const i64 qr = sq.q0 + row;
    const float l = sm.red[0][row] + sm.red[1][row], inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int col = 256 * w + 8 * j + 2 * t4;
      const float v0 = o[j][2 * hf] * inv, v1 = o[j][2 * hf + 1] * inv;
      if (split)
        *reinterpret_cast<float2*>(&o_part[((i64)z * TH + qr) * DV + col]) = make_float2(v0, v1);
      else
        *reinterpret_cast<u32*>(&out[qr * DV + col]) = pack_bf16x2(v0, v1);
    }
  }
  if (split && tid < 64 && sq.q0 + tid < sq.q_end) {
    const float l = sm.red[0][tid] + sm.red[1][tid];
    lse_part[(i64)z * TH + sq.q0 + tid] = l > 0.f ? sm.m[tid] + __log2f(l) : NEG_INF;
  }
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// Grid (ceil(R*h / 64), B, splits) or, under the device schedule (SCHED), (blocks, 1, 1); block 256; dynamic smem
// sizeof(SmemWG) + 1024 (alignment slack).
// Arguments and outputs as mla_attn; tmap: the cache's CUtensorMap (mla_tree_attention._tensor_map) or null.
// Pipeline: Q and tiles 0, 1 are issued before the loop; in the loop tile it+1 goes into the stage tile it-1
// freed, issued while warpgroup 0's S wgmmas run. Whole-prefix tiles come by TMA (thread 0 in the prologue,
// thread 128 in the loop): 9 instructions instead of 4,608 16-byte cp.async, whose issue took ~2K cycles
// per tile (H200, 10 heads x 64 rows x 32K keys: 120.7 -> 107.4 us). The other tiles (the one holding the
// prefix's end and the tree rows, or any tile when page_size % 64 != 0) go by cp.async, zero-filling keys
// past the split's end: warpgroup 1 issues rows 0..47, warpgroup 0 rows 48..63 after its wgmmas.
template <bool SCHED>
__global__ void __launch_bounds__(256, 1) mla_attn_wgmma(
    const u16* __restrict__ q, const u16* __restrict__ kv, const i64* __restrict__ page_table, int npages,
    int page_size, const i64* __restrict__ prefix_lens, const i64* __restrict__ row_starts,
    const unsigned char* __restrict__ tree_mask, int R, const i64* __restrict__ write_slots, int h,
    float scale2, int TH, u16* __restrict__ out, float* __restrict__ o_part, float* __restrict__ lse_part,
    int B, int zsplits, int sched_slots, const void* tmap, int q_ld, const u16* __restrict__ q_pe, i64 pe_t,
    int pe_h, const float* __restrict__ rcos, const float* __restrict__ rsin) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const QSrc qs{q, q_ld, h, pe_h, pe_t, q_pe, rcos, rsin};
  pdl_trigger();
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  SmemWG& sm = *reinterpret_cast<SmemWG*>(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 7, g = lane >> 2, t4 = lane & 3;
  const int lr = tid >> 3, sub = tid & 7;
  int z;  // key split
  Seq sq = block_seq<SCHED>(page_table, npages, page_size, prefix_lens, row_starts, write_slots, B, h, 64,
                            zsplits, sched_slots, z);
  if (sq.q0 >= sq.q_end || sq.kbeg >= sq.kend) return;
  if (tid == 0) sm.qrange[0] = sq.q0, sm.qrange[1] = sq.q_end;
  if (SCHED && tid == 0) sm.qrange[2] = z;  // the split, kept out of registers

  if (tid == 0) {
    mbar_init(&sm.bar[0]), mbar_init(&sm.bar[1]);
    mbar_init_fence();
  }
  __syncthreads();
  const int ntiles = (sq.kend - sq.kbeg + KT - 1) / KT, vis_end = min(sq.L, sq.kend);
  // The first one or two tiles go before the loop. Those by TMA (wholly committed prefix) are issued before
  // griddepcontrol.wait: no kernel of a step writes committed keys (its cache write fills the tree rows' slots), so
  // under programmatic dependent launch their latency overlaps the kernel before this one. Q and the cp.async tiles
  // wait for it. Commit groups: [TMA tiles' (empty) groups] [Q (+ tile 0)] [tile 1].
  // In the loop warpgroup 1 copies rows 0..47 of a tile (three per thread, 16 apart), warpgroup 0 rows 48..63
  // (one per thread) after issuing its wgmmas; thread 128 issues TMA tiles.
  const int first = ntiles > 1 ? 2 : 1;
  const int early = by_tma(tmap, sq.kbeg, vis_end) + (first == 2 && by_tma(tmap, sq.kbeg + KT, vis_end));
  int ref2[2], ref1[3], ref0[1];  // key_refs: rows lr, lr + 32 (prologue); the loop's rows
  fetch_refs<2>(ref2, sq, sq.kbeg, lr);
  for (int i = 0; i < early; ++i) {
    load_tile<2>(sm, i, kv, tmap, sq, sq.kbeg + i * KT, vis_end, ref2, lr, sub, tid == 0);
    fetch_refs<2>(ref2, sq, sq.kbeg + (i + 1) * KT, lr);
  }
  pdl_wait();  // launched with PDL: q and the tree rows' latents are written after this
  for (int row = lr; row < 64; row += 32)  // Q tile, zero rows past the sequence's queries
    load_q_row(sm.q + row * 128 + (((sub ^ row) & 7) << 4), SLAB, qs, sq.q0 + row, sq.q0 + row < sq.q_end, sub);
  if (early) cp_async_commit();  // Q's own group; else it goes with tile 0's
  for (int i = early; i < first; ++i) {
    load_tile<2>(sm, i, kv, tmap, sq, sq.kbeg + i * KT, vis_end, ref2, lr, sub, tid == 0);
    fetch_refs<2>(ref2, sq, sq.kbeg + (i + 1) * KT, lr);
  }
  const bool tile1_after_q = first - (early > 1 ? early : 1) == 1;  // tile 1's commit group is younger than Q's
  if (w == 1) fetch_refs<3, 16>(ref1, sq, sq.kbeg + 2 * KT, lr - 16);
  else fetch_refs<1>(ref0, sq, sq.kbeg + 2 * KT, 48 + lr);

  const int ra = 16 * ((tid >> 5) & 3) + g;  // this thread's rows ra, ra + 8 (of S and of O)
  const int tm0 = sq.q0 + ra < sq.q_end ? (sq.q0 + ra) / h * R : -1;
  const int tm1 = sq.q0 + ra + 8 < sq.q_end ? (sq.q0 + ra + 8) / h * R : -1;
  float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;  // warpgroup 0's softmax state
  float o[32][4] = {};
  u32 parity = 0;  // bit st: the phase stage st's mbarrier completes next
  for (int it = 0; it < ntiles; ++it) {
    const int buf = it & 1, kb = sq.kbeg + it * KT;
    if (it == 0 && tile1_after_q) cp_async_wait<1>();
    else cp_async_wait<0>();
    if (by_tma(tmap, kb, vis_end)) mbar_wait(&sm.bar[buf], parity >> buf & 1), parity ^= 1u << buf;
    fence_async_smem();
    __syncthreads();  // tile it landed for all threads; both warpgroups are done with tile it-1
    float al0, al1;
    float s[8][4];
    if (w == 0) qk_issue(s, smem_addr(sm.q), smem_addr(sm.k[buf]));
    if (it >= 1 && it + 1 < ntiles) {  // warpgroup 0: while its wgmmas run
      if (w == 1) {
        load_tile<3, 16>(sm, buf ^ 1, kv, tmap, sq, kb + KT, vis_end, ref1, lr - 16, sub, tid == 128);
        fetch_refs<3, 16>(ref1, sq, kb + 2 * KT, lr - 16);
      } else {
        load_tile<1>(sm, buf ^ 1, kv, tmap, sq, kb + KT, vis_end, ref0, 48 + lr, sub, false);
        fetch_refs<1>(ref0, sq, kb + 2 * KT, 48 + lr);
      }
    }
    if (w == 0) {
      qk_wait(s);
      float tmax0, tmax1;
      mask_scores<8>(s, sq, kb + 2 * t4, kb + KT <= vis_end, tree_mask, tm0, tm1, scale2, tmax0, tmax1);
      al0 = softmax_row<8>(s, 0, tmax0, m0, l0), al1 = softmax_row<8>(s, 2, tmax1, m1, l1);
#pragma unroll
      for (int n = 0; n < 8; ++n) {  // P rows ra, ra+8, keys 8n + 2t4: chunk n
        const int off = (((n ^ g) & 7) << 4) + 4 * t4;
        *reinterpret_cast<u32*>(sm.p + ra * 128 + off) = pack_bf16x2(s[n][0], s[n][1]);
        *reinterpret_cast<u32*>(sm.p + (ra + 8) * 128 + off) = pack_bf16x2(s[n][2], s[n][3]);
      }
      if (t4 == 0) sm.alpha[ra] = al0, sm.alpha[ra + 8] = al1;
      fence_async_smem();
    }
    __syncthreads();  // P and alpha of tile it written
    if (w == 1) al0 = sm.alpha[ra], al1 = sm.alpha[ra + 8];
#pragma unroll
    for (int j = 0; j < 32; ++j) o[j][0] *= al0, o[j][1] *= al0, o[j][2] *= al1, o[j][3] *= al1;
    pv_wgmma(o, smem_addr(sm.p), smem_addr(sm.k[buf]) + 4 * SLAB * w);
  }

#pragma unroll
  for (int d = 1; d < 4; d <<= 1) l0 += __shfl_xor_sync(0xffffffffu, l0, d), l1 += __shfl_xor_sync(0xffffffffu, l1, d);
  if (t4 == 0) sm.red[w][ra] = l0, sm.red[w][ra + 8] = l1;
  if (w == 0 && t4 == 0) sm.m[ra] = m0, sm.m[ra + 8] = m1;
  __syncthreads();
  sq.q0 = sm.qrange[0], sq.q_end = sm.qrange[1];
  write_out_wg(o, sm, sq, w, ra, t4, tid, SCHED ? zsplits > 1 : gridDim.z > 1,
               SCHED ? sm.qrange[2] : (int)blockIdx.z, TH, out, o_part, lse_part);
#endif
}
