// Absorbed-MLA tree attention over the paged 576-wide latent cache (reference/k26.md §3.6).
// MQA: every (row, head) query of a sequence attends the same keys [ĉ ; k_rope] (576) and values ĉ (512).
//
// Block = 8 warps, a tile of MT (16, 32 or 64) query rows (flat (row, head) rows of one sequence) x one
// split of that sequence's keys. Keys stream in 64-key tiles (73.7 KB) through NSTAGE cp.async buffers.
// Per key tile, three block barriers:
//   S = Q Kᵀ   warp (rg, kg) computes rows 16rg..+15 x keys 8·NT·kg..+8NT-1 over all 576 dims (mma
//              m16n8k16; RG = MT/16 row groups, KG = 8/RG key groups, NT = RG key n-tiles per warp);
//              masked row maxima of each key group -> smem                                   | barrier
//   softmax    online, fp32, base 2: every warp of a row group derives the same new row max, keeps its
//              own partial row sums; P (bf16) and the rescale factor alpha -> smem            | barrier
//   O += P V   warp w owns value dims 64w..64w+63 of all MT rows (2·MT fp32 accumulators per thread)
// Shared rows are unpadded (1152 B for Q, 128 B for P): 16-byte chunk c of row r sits at chunk c ^ (r & 7) of
// its 128-byte group, so the eight row addresses of every ldmatrix hit distinct banks. K tiles are slab-major
// (9 slabs of 64 keys x 128 B, SLAB bytes apart, the same chunk swizzle: what a TMA box of 64 dims x 64 keys with
// the 128-byte swizzle writes), so whole-prefix tiles come by TMA where the cache's pages hold whole tiles.
// Splits write normalized partial O and base-2 LSE; mla_merge combines them.
// Keys past a split's end are zero-filled, never read, so NaN in unused cache slots cannot leak.

#define D 576     // key width: 512 latent + 64 rope
#define DV 512    // value width (the latent)
#define KT 64     // keys per tile
#define ROWB 1152 // bytes per Q row in smem (72 chunks of 16 B), and per key of a K tile (9 slabs x 128 B)
#define PB 128    // bytes per P row in smem (KT bf16)
#define SLAB 8192 // bytes per K slab in smem (64 keys x 64 dims)

template <int MT, int NSTAGE>
struct Smem {
  unsigned char q[MT * ROWB];
  unsigned char k[NSTAGE][KT * ROWB];
  unsigned char p[MT * PB];
  u64 bar[NSTAGE];  // per K stage: the mbarrier its TMA loads complete on
  float red[128];  // [KG][MT] (KG·MT = 128): per key group row maxima; at the end, row sums
  float alpha[MT];
  float m[MT];
  int qrange[4];  // q0, q_end for the epilogue (kept out of registers through the key loop)
};

struct Seq {  // one block's sequence, query tile and key range; all 32-bit (registers are tight)
  const i64* page_table;  // [B, npages] (kernel argument)
  const i64* write_slots;  // [T] (kernel argument)
  int pt0, ws0;  // this sequence's page-table row start, first tree row
  int L, kbeg, kend, q0, q_end;  // positions and flat query rows: < 2^31
  int page_size;
};

// Where key j of the sequence lives, as loaded: its page id (prefix key), its slot (tree key), or -1 past
// the split's end (then zero-filled, not read). Fetched a tile ahead and turned into a slot only when the
// tile is issued (key_slot), so no arithmetic waits on these loads in between (a 1.5K-cycle stall per tile
// when the slot was computed here, H200). Slots of one layer's cache fit 32 bits (2^31 slots = 2.4 TB).
__device__ __forceinline__ int key_ref(const Seq& s, int j) {
  if (j >= s.kend) return -1;
  if (j < s.L) return (int)s.page_table[s.pt0 + j / s.page_size];
  return (int)s.write_slots[s.ws0 + j - s.L];
}

__device__ __forceinline__ int key_slot(const Seq& s, int j, int ref) {
  return ref < 0 || j >= s.L ? ref : ref * s.page_size + j % s.page_size;
}

// 16-byte cp.async of row `row` (smem rows of 1152 B) from global row src: thread (lr = tid / 8,
// sub = tid % 8) copies chunks sub + 8i, i < 9, so 8 lanes stream 128 contiguous bytes at a time.
__device__ __forceinline__ void copy_row(unsigned char* dst, int row, const u16* src, bool ok, int sub) {
  unsigned char* d = dst + row * ROWB + (((sub ^ row) & 7) << 4);
#pragma unroll
  for (int i = 0; i < 9; ++i) cp_async16_zfill(d + 128 * i, src + (ok ? 8 * sub + 64 * i : 0), ok);
}

// The same row into the slab-major layout of mla_attn_wgmma (mla_tree_attention_sm90.cu): 9 slabs of 64 rows
// x 128 B (SLAB bytes apart); thread sub copies chunk sub of each slab, swizzled as above.
__device__ __forceinline__ void copy_row_slabs(unsigned char* dst, int row, const u16* src, bool ok, int sub) {
  unsigned char* d = dst + row * 128 + (((sub ^ row) & 7) << 4);
#pragma unroll
  for (int i = 0; i < 9; ++i) cp_async16_zfill(d + SLAB * i, src + (ok ? 8 * sub + 64 * i : 0), ok);
}

// Where the query rows come from: q [T·h flat (token, head) rows, q_ld elements apart] holds all 576 dims, or with pe
// only the 512 absorbed ones; then dims 512-575 are q_b's rope part rotated here: pe [T, h, 64] at pe_t / pe_h
// elements a token / head (16-byte aligned), angles cos / sin [T, 32] fp32 (one per interleaved pair), so that no
// kernel sits between the query's projections and this one (kernels/rms_norm latent_norms writes the tree rows' keys).
struct QSrc {
  const u16* q;
  int q_ld, h, pe_h;
  i64 pe_t;
  const u16* pe;
  const float* cos;
  const float* sin;
};

// Query row qrow (flat) into the smem row at d (its 16-byte chunk sub of slab 0, swizzle applied), slabs `step` bytes
// apart (ROWB rows: 128; slab-major: SLAB). Chunk sub of each 64-dim slab, zeros when !ok. The rope slab, when
// rotated here, by plain stores: the block barrier after the cp.async wait publishes both.
__device__ __forceinline__ void load_q_row(unsigned char* d, int step, const QSrc& s, int qrow, bool ok, int sub) {
  const u16* src = s.q + (ok ? (i64)qrow * s.q_ld + 8 * sub : 0);
  const int copied = s.pe == nullptr ? 9 : 8;
#pragma unroll
  for (int i = 0; i < 9; ++i)
    if (i < copied) cp_async16_zfill(d + step * i, src + (ok ? 64 * i : 0), ok);
  if (s.pe == nullptr) return;
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (ok) {  // pairs 4sub..4sub+3 of token qrow / h, head qrow % h
    const int t = qrow / s.h;
    const uint4 x = *reinterpret_cast<const uint4*>(s.pe + t * s.pe_t + (i64)(qrow % s.h) * s.pe_h + 8 * sub);
    const float4 c = *reinterpret_cast<const float4*>(s.cos + (i64)t * ((D - DV) / 2) + 4 * sub);
    const float4 sn = *reinterpret_cast<const float4*>(s.sin + (i64)t * ((D - DV) / 2) + 4 * sub);
    const u32 in[4] = {x.x, x.y, x.z, x.w};
    const float cs[4] = {c.x, c.y, c.z, c.w}, ss[4] = {sn.x, sn.y, sn.z, sn.w};
    u32 r[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 p = rope_pair(bf2f((u16)(in[k] & 0xFFFFu)), bf2f((u16)(in[k] >> 16)), cs[k], ss[k]);
      r[k] = (u32)f2bf(p.x) | (u32)f2bf(p.y) << 16;
    }
    v = make_uint4(r[0], r[1], r[2], r[3]);
  }
  *reinterpret_cast<uint4*>(d + step * 8) = v;
}

// S = Q Kᵀ for this warp's 16 rows x 8·NT keys over 576 dims. qa: this lane's Q row (row-major); kb: this
// lane's K row in slab 0 (slab-major). acc[n][c]: CH = 4/NT independent chains per n-tile hide the MMA
// latency. Out: s[n][4] in mma D layout.
template <int NT>
__device__ __forceinline__ void qk_tile(const unsigned char* qa, const unsigned char* kb, int lane, float (&s)[NT][4]) {
  constexpr int CH = 4 / NT;
  float acc[NT * CH][4] = {};
  const int r7 = lane & 7, hi = lane >> 4, c4 = (lane >> 3) & 3;
#pragma unroll 2
  for (int grp = 0; grp < 9; ++grp) {  // 64 dims = 8 chunks = 4 k-steps
#pragma unroll
    for (int kp = 0; kp < 2; ++kp) {  // 2 k-steps: 2 A fragments, one x4 per n-tile
      u32 a[2][4], b[NT][4];
#pragma unroll
      for (int i = 0; i < 2; ++i) ldmatrix_x4(a[i], qa + 128 * grp + ((((4 * kp + 2 * i + hi) ^ r7) & 7) << 4));
#pragma unroll
      for (int n = 0; n < NT; ++n) ldmatrix_x4(b[n], kb + n * 8 * 128 + SLAB * grp + ((((4 * kp + c4) ^ r7) & 7) << 4));
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int n = 0; n < NT; ++n)
          mma_bf16(acc[n * CH + (2 * kp + i) % CH], a[i][0], a[i][1], a[i][2], a[i][3], b[n][2 * i], b[n][2 * i + 1]);
    }
  }
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float v = 0.f;
#pragma unroll
      for (int c = 0; c < CH; ++c) v += acc[n * CH + c][e];
      s[n][e] = v;
    }
}

// O[rows, 64w..64w+63] = alpha · O + P V for one key tile; o[mi][n]: rows 16mi + g (+8), dims 64w + 8n + 2t.
template <int RG>
__device__ __forceinline__ void pv_tile(const unsigned char* sp, const unsigned char* kv_tile, const float* alpha,
                                        int warp, int lane, float (&o)[RG][8][4]) {
  const int g = lane >> 2, r7 = lane & 7, hi = lane >> 4;
#pragma unroll
  for (int mi = 0; mi < RG; ++mi) {
    const float alo = alpha[16 * mi + g], ahi = alpha[16 * mi + g + 8];
#pragma unroll
    for (int n = 0; n < 8; ++n) o[mi][n][0] *= alo, o[mi][n][1] *= alo, o[mi][n][2] *= ahi, o[mi][n][3] *= ahi;
  }
#pragma unroll
  for (int kk = 0; kk < KT / 16; ++kk) {
    const int sw = (((2 * kk + hi) ^ r7) & 7) << 4;
    u32 a[RG][4];
#pragma unroll
    for (int mi = 0; mi < RG; ++mi) ldmatrix_x4(a[mi], sp + (16 * mi + (lane & 15)) * PB + sw);
    const unsigned char* vrow = kv_tile + SLAB * warp + (16 * kk + (lane & 15)) * 128;  // slab-major tile
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      u32 v[4];
      ldmatrix_x4_trans(v, vrow + ((((2 * np + hi) ^ r7) & 7) << 4));
#pragma unroll
      for (int mi = 0; mi < RG; ++mi) {
        mma_bf16(o[mi][2 * np], a[mi][0], a[mi][1], a[mi][2], a[mi][3], v[0], v[1]);
        mma_bf16(o[mi][2 * np + 1], a[mi][0], a[mi][1], a[mi][2], a[mi][3], v[2], v[3]);
      }
    }
  }
}

// Scale and mask this warp's scores in place (-inf = not visible); -> masked row maxima of rows g, g+8.
// Visible: key j < kend and (prefix key, or tree key whose tree_mask bit is set for the query's row).
// tm0, tm1: offsets of the two query rows' tree-mask rows in tm, -1 for padding queries.
template <int NT>
__device__ __forceinline__ void mask_scores(float (&s)[NT][4], const Seq& sq, int j0, bool full,
                                            const unsigned char* __restrict__ tm, int tm0, int tm1,
                                            float scale2, float& mx0, float& mx1) {
  mx0 = mx1 = NEG_INF;
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = j0 + 8 * n + (e & 1), tmo = e < 2 ? tm0 : tm1;
      const bool vis = full || (j < sq.kend && (j < sq.L || (tmo >= 0 && tm[tmo + j - sq.L])));
      s[n][e] = vis ? s[n][e] * scale2 : NEG_INF;
      if (e < 2) mx0 = fmaxf(mx0, s[n][e]);
      else mx1 = fmaxf(mx1, s[n][e]);
    }
  quad_max2(mx0, mx1);
}

// Online-softmax step of one row (this thread's 2·NT scores of it, s[n][lo], s[n][lo+1]):
// m: running max (in), tile max across key groups (tmax) -> new max; returns alpha; adds to l.
template <int NT>
__device__ __forceinline__ float softmax_row(float (&s)[NT][4], int lo, float tmax, float& m, float& l) {
  const float m_new = fmaxf(m, tmax), m_use = m_new == NEG_INF ? 0.f : m_new;
  const float alpha = exp2f(m - m_use);
  float sum = 0.f;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    s[n][lo] = exp2f(s[n][lo] - m_use), s[n][lo + 1] = exp2f(s[n][lo + 1] - m_use);
    sum += s[n][lo] + s[n][lo + 1];
  }
  m = m_new, l = l * alpha + sum;
  return alpha;
}

// Epilogue: normalized rows of this warp's 64 value dims -> bf16 out, or fp32 o_part + LSE (splits).
// red [KG][MT]: row sums of each key group; msm [MT]: final row maxima.
template <int RG>
__device__ __forceinline__ void write_out(const float (&o)[RG][8][4], const float* red, const float* msm,
                                          const Seq& sq, int warp, int lane, bool split, int z, int TH,
                                          u16* __restrict__ out, float* __restrict__ o_part,
                                          float* __restrict__ lse_part) {
  constexpr int MT = 16 * RG, KG = 8 / RG;
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int mi = 0; mi < RG; ++mi)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int row = 16 * mi + g + 8 * hf;
      const i64 qr = sq.q0 + row;
      if (sq.q0 + row >= sq.q_end) continue;
      float l = 0.f;
#pragma unroll
      for (int k = 0; k < KG; ++k) l += red[k * MT + row];
      const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const int col = 64 * warp + 8 * n + 2 * t4;
        const float v0 = o[mi][n][2 * hf] * inv, v1 = o[mi][n][2 * hf + 1] * inv;
        if (split)
          *reinterpret_cast<float2*>(&o_part[((i64)z * TH + qr) * DV + col]) = make_float2(v0, v1);
        else
          *reinterpret_cast<u32*>(&out[qr * DV + col]) = pack_bf16x2(v0, v1);
      }
    }
  const int row = 32 * warp + lane;
  if (split && row < MT && sq.q0 + row < sq.q_end) {
    float l = 0.f;
#pragma unroll
    for (int k = 0; k < KG; ++k) l += red[k * MT + row];
    lse_part[(i64)z * TH + sq.q0 + row] = l > 0.f ? msm[row] + __log2f(l) : NEG_INF;
  }
}

// Keys per split of a sequence with `keys` keys (prefix + its tree rows) over `splits` splits: whole
// tiles, spread evenly over the sequence's actual keys. The split count comes from the page table's
// capacity (graph-safe); chunking the actual length keeps every split busy however short the sequence
// is against that capacity (H200, 10 heads x 16 rows x 4K keys: 19.4 us; chunked by a 128K-key
// capacity, as before, 215 us).
__device__ __forceinline__ int split_chunk(int keys, int splits) {
  return KT * (((keys + KT - 1) / KT + splits - 1) / splits);
}

// Splits that hold keys of a sequence with `keys` keys chunked for `splits` splits (split_chunk); 0 without keys.
__device__ __forceinline__ int seq_splits(int keys, int splits) {
  if (keys <= 0) return 0;
  const int chunk = split_chunk(keys, splits);
  return (keys + chunk - 1) / chunk;
}

// The device schedule's split count s (sched_slots > 0: a CUDA graph's padded plan, whose live sessions, rows and
// prefixes only the device sees). The query tiles of sequences with a prefix (Q of them) take up to s splits each,
// those of sequences without one (the graph's pad rows) one per key tile they have (P blocks in all). s is the
// most that keeps P + Q s blocks in one wave of `slots`, 1 if even one each is more, and at most zsplits (o_part's
// splits). The same in every block of mla_attn* and the merges. LANES (the merges): a warp's lanes take the
// sequences. mla_attn* loop over them in every thread instead, from uniform addresses only, so that ptxas can prove
// the block's sequence and key range warp-uniform and keep them in uniform registers through the key loop: derived
// from shuffles or redux, they made the loop of mla_attn_wgmma 20-25 % slower (H200, 10 heads, 16 rows x 64K keys
// at 44 splits: 61.9 -> 80.5 us; 41 -> 176 R2UR in its SASS), the serial loop costs ~1 us once.
template <bool LANES>
__device__ __forceinline__ int plan_splits(const i64* prefix_lens, const i64* row_starts, int B, int h, int mt,
                                           int slots, int zsplits) {
  int P = 0, Q = 0;
  for (int b = LANES ? threadIdx.x & 31 : 0; b < B; b += LANES ? 32 : 1) {
    const int rb = (int)(row_starts[b + 1] - row_starts[b]), tiles = (rb * h + mt - 1) / mt;
    if (prefix_lens[b] > 0) Q += tiles;
    else P += tiles * ((rb + KT - 1) / KT);
  }
  if (LANES) P = __reduce_add_sync(0xffffffffu, P), Q = __reduce_add_sync(0xffffffffu, Q);
  return Q == 0 ? 1 : max(1, min(zsplits, (slots - P) / Q));
}

// The device schedule's block blockIdx.x -> its sequence b, query tile x and key split z (of s splits): blocks
// dealt out sequence by sequence, each sequence's query tiles in order, each tile's splits that hold keys in
// order (serially, as plan_splits<false>). False past the last block.
__device__ __forceinline__ bool sched_block(const i64* prefix_lens, const i64* row_starts, int B, int h, int mt,
                                            int s, int& b, int& x, int& z) {
  const int i = blockIdx.x;
  for (int base = 0, seq = 0; seq < B; ++seq) {
    const int rb = (int)(row_starts[seq + 1] - row_starts[seq]), splits = seq_splits((int)prefix_lens[seq] + rb, s);
    const int n = (rb * h + mt - 1) / mt * splits;  // the sequence's blocks
    if (i < base + n) {
      b = seq, x = (i - base) / splits, z = (i - base) % splits;
      return true;
    }
    base += n;
  }
  return false;
}

// A block's Seq: sequence b, query tile x of mt flat (row, head) rows, key split z (-> z). Host schedule (!SCHED):
// block (x, b, z) of the grid (ceil(R*h / mt), B, splits), keys chunked for gridDim.z splits. Device schedule
// (SCHED, sched_slots > 0): a 1-D grid dealt out by sched_block, keys chunked for plan_splits' count. A template
// flag, not a branch: compiled in, the device schedule's code cost the host schedule's key loop 1-4 % (H200).
// Empty (q0 >= q_end or kbeg >= kend) when the tile or the split has nothing of this sequence.
template <bool SCHED>
__device__ __forceinline__ Seq block_seq(const i64* page_table, int npages, int page_size, const i64* prefix_lens,
                                         const i64* row_starts, const i64* write_slots, int B, int h, int mt,
                                         int zsplits, int sched_slots, int& z) {
  Seq sq;
  int b = blockIdx.y, x = blockIdx.x, splits = gridDim.z;
  z = blockIdx.z;
  if constexpr (SCHED) {
    splits = plan_splits<false>(prefix_lens, row_starts, B, h, mt, sched_slots, zsplits);
    if (!sched_block(prefix_lens, row_starts, B, h, mt, splits, b, x, z)) {
      sq.q0 = sq.q_end = sq.kbeg = sq.kend = 0;
      return sq;
    }
  }
  const int r0 = (int)row_starts[b], rb = (int)row_starts[b + 1] - r0;
  sq.page_table = page_table, sq.write_slots = write_slots, sq.page_size = page_size;
  sq.pt0 = b * npages, sq.ws0 = r0;
  sq.L = (int)prefix_lens[b], sq.q0 = r0 * h + x * mt, sq.q_end = (r0 + rb) * h;
  const int chunk = split_chunk(sq.L + rb, splits);
  sq.kbeg = z * chunk, sq.kend = min(sq.kbeg + chunk, sq.L + rb);
  return sq;
}

// Issue the cp.async copies of this thread's rows lr + STRIDE·r, r < NR, of the 64-key tile at key kb, whose
// key_refs it fetched (NR = 2: 256 threads copy a tile), in rows (copy_row) or slabs (copy_row_slabs).
template <int NR, bool SLABS = false, int STRIDE = KT / NR>
__device__ __forceinline__ void issue_tile(unsigned char* dst, const u16* kv, const Seq& sq, int kb,
                                           const int (&ref)[NR], int lr, int sub) {
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    const int row = lr + STRIDE * r, slot = key_slot(sq, kb + row, ref[r]);
    const u16* src = kv + (slot < 0 ? 0 : (i64)slot * D);
    if (SLABS) copy_row_slabs(dst, row, src, slot >= 0, sub);
    else copy_row(dst, row, src, slot >= 0, sub);
  }
  cp_async_commit();
}

// key_refs of this thread's rows lr + STRIDE·r of the tile starting at key kb.
template <int NR, int STRIDE = KT / NR>
__device__ __forceinline__ void fetch_refs(int (&ref)[NR], const Seq& sq, int kb, int lr) {
#pragma unroll
  for (int r = 0; r < NR; ++r) ref[r] = key_ref(sq, kb + lr + STRIDE * r);
}


// TMA (sm_90+): a tile wholly inside the committed prefix lies in one page (page_size % 64 == 0) and is fetched
// as 9 boxes of 64 dims x 64 keys by one thread; the tensor map's 128-byte swizzle writes the slab layout
// (copy_row_slabs). The stage's mbarrier completes on one arrival plus the tile's 73,728 bytes. 9 instructions
// instead of 4,608 16-byte cp.async (H200, mla_attn_wgmma, 10 heads x 64 rows x 32K keys: 120.7 -> 107.4 us).
__device__ __forceinline__ void mbar_init(u64* bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
#endif
}
// The mbarriers' initialization -> visible to every thread of the block (the barrier after it publishes it).
__device__ __forceinline__ void mbar_init_fence() {
#if __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n.reg .pred p;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT;\n}\n"
      ::"r"(smem_addr(bar)), "r"(parity) : "memory");
#endif
}
__device__ __forceinline__ void tma_tile(unsigned char* dst, u64* bar, const void* tmap, int slot) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(9 * SLAB)
               : "memory");
#pragma unroll
  for (int s = 0; s < 9; ++s)
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(smem_addr(dst + s * SLAB)), "l"(tmap), "r"(64 * s), "r"(slot), "r"(smem_addr(bar)) : "memory");
#endif
}

// Whether the tile at key kb comes by TMA (its load and its wait must agree): a tensor map exists and the tile
// is all committed prefix (below vis_end = min(L, kend)). Within a block's key range the TMA tiles come first, so
// no TMA write follows a cp.async write to the same stage (which would need a proxy fence between them).
__device__ __forceinline__ bool by_tma(const void* tmap, int kb, int vis_end) {
  return tmap != nullptr && kb + KT <= vis_end;
}

// The tile at key kb into slab-major K stage st of sm (Smem or SmemWG: k[stage][9 * SLAB], bar[stage]): by TMA from
// `issuer` (whose ref[0] is the tile's row 0) where a tensor map exists and the tile is all committed prefix,
// completing on sm.bar[st]; else by cp.async of this thread's rows lr + STRIDE·r. Commits one cp.async group either
// way, so the stage waits count the same groups.
template <int NR, int STRIDE = KT / NR, class S>
__device__ __forceinline__ void load_tile(S& sm, int st, const u16* kv, const void* tmap, const Seq& sq, int kb,
                                          int vis_end, const int (&ref)[NR], int lr, int sub, bool issuer) {
  if (by_tma(tmap, kb, vis_end)) {
    if (issuer) tma_tile(sm.k[st], &sm.bar[st], tmap, key_slot(sq, kb, ref[0]));
    cp_async_commit();
  } else {
    issue_tile<NR, true, STRIDE>(sm.k[st], kv, sq, kb, ref, lr, sub);
  }
}

// Grid (ceil(R*h / MT), B, splits), or (blocks, 1, 1) under the device schedule (SCHED: block_seq);
// block 256; dynamic smem sizeof(Smem<MT, NSTAGE>) + 1024 (the K stages sit
// on 1024-byte swizzle atoms for TMA; MT=64, NSTAGE=2: 226 KB, one block per SM on sm_90; MT=16, NSTAGE=1: 95 KB,
// fits sm_120's 99 KB).
// Pipeline (NSTAGE=2): tiles 0 and 1 are issued before the loop; at the top of tile it >= 1 tile it+1
// goes into the buffer tile it-1 freed. The slots of the next tile to issue are fetched a tile ahead
// (key_refs), so no page-table load latency sits on the issue path. Whole-prefix tiles come by TMA (thread 0)
// where tmap is given (MT <= 32; MT = 64 has no registers to spare), the others by cp.async.
// q [T*h, 576] bf16; kv [slots, 576] bf16 (one layer); page_table [B, npages]; prefix_lens [B];
// row_starts [B+1]; tree_mask [T, R] bool; write_slots [T]. scale2 = softmax_scale * log2(e).
// B sequences; zsplits: o_part's splits. zsplits == 1: out [T*h, 512] bf16. zsplits > 1: o_part [zsplits, T*h,
// 512] fp32, lse_part [zsplits, T*h] (split z of query row r at z * T*h + r).
// tmap: the cache's CUtensorMap (mla_tree_attention._tensor_map) or null (cp.async only).
template <int MT, int NSTAGE, bool SCHED>
__global__ void __launch_bounds__(256, NSTAGE == 1 ? 2 : 1) mla_attn(
    const u16* __restrict__ q, const u16* __restrict__ kv, const i64* __restrict__ page_table, int npages,
    int page_size, const i64* __restrict__ prefix_lens, const i64* __restrict__ row_starts,
    const unsigned char* __restrict__ tree_mask, int R, const i64* __restrict__ write_slots, int h,
    float scale2, int TH, u16* __restrict__ out, float* __restrict__ o_part,
    float* __restrict__ lse_part, int B, int zsplits, int sched_slots, const void* tmap, int q_ld,
    const u16* __restrict__ q_pe, i64 pe_t, int pe_h, const float* __restrict__ rcos, const float* __restrict__ rsin) {
  constexpr int RG = MT / 16, KG = 8 / RG, NT = RG;
  const QSrc qs{q, q_ld, h, pe_h, pe_t, q_pe, rcos, rsin};
  pdl_trigger();  // the merge's blocks may become resident; they wait for this grid before reading it
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Smem<MT, NSTAGE>& sm =
      *reinterpret_cast<Smem<MT, NSTAGE>*>(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  const int lr = tid >> 3, sub = tid & 7;
  int z;  // key split
  Seq sq = block_seq<SCHED>(page_table, npages, page_size, prefix_lens, row_starts, write_slots, B, h, MT,
                            zsplits, sched_slots, z);
  if (sq.q0 >= sq.q_end || sq.kbeg >= sq.kend) return;
  if (tid == 0) sm.qrange[0] = sq.q0, sm.qrange[1] = sq.q_end;
  if (SCHED && tid == 0) sm.qrange[2] = z;  // the split, kept out of registers
  if (MT == 64) tmap = nullptr;
  if (tmap != nullptr && tid == 0) {  // thread 0 issues the TMA tiles; the barrier before the loop publishes these
    for (int st = 0; st < NSTAGE; ++st) mbar_init(&sm.bar[st]);
    mbar_init_fence();
  }

  // The first one or two tiles are issued before the loop. At MT <= 32 (decode, 2-3-row trees) those wholly inside
  // the committed prefix go before griddepcontrol.wait: no kernel of a step writes committed keys (its cache write
  // fills the tree rows' slots), so under programmatic dependent launch their DRAM latency overlaps the kernel before
  // this one. Q and the tiles holding tree rows wait for it. Commit groups: [prefix tiles] [Q (+ tile 0)] [later
  // tiles]. MT = 64 keeps the plain order (its 255 registers have none to spare: 24 B of spills otherwise).
  const int ntiles = (sq.kend - sq.kbeg + KT - 1) / KT, vis_end = min(sq.L, sq.kend);
  const int first = NSTAGE == 2 && ntiles > 1 ? 2 : 1;
  int ref[2];  // key_refs of this thread's rows of the next tile to issue (plan data: readable before the wait)
  bool tile1_after_q = first == 2;  // tile 1's commit group is younger than Q's
  if constexpr (MT == 64) {
    pdl_wait();  // launched with PDL: q and the tree rows' latents are written after this
    for (int row = lr; row < MT; row += 32)  // Q tile, zero rows past the sequence's queries
      load_q_row(sm.q + row * ROWB + (((sub ^ row) & 7) << 4), 128, qs, sq.q0 + row, sq.q0 + row < sq.q_end, sub);
    fetch_refs<2>(ref, sq, sq.kbeg, lr);
    issue_tile<2, true>(sm.k[0], kv, sq, sq.kbeg, ref, lr, sub);  // commits Q with it
    fetch_refs<2>(ref, sq, sq.kbeg + KT, lr);
    if (first == 2) {
      issue_tile<2, true>(sm.k[1], kv, sq, sq.kbeg + KT, ref, lr, sub);
      fetch_refs<2>(ref, sq, sq.kbeg + 2 * KT, lr);
    }
  } else {
    const int early = (sq.kbeg + KT <= sq.L) + (first == 2 && sq.kbeg + 2 * KT <= sq.L);
    fetch_refs<2>(ref, sq, sq.kbeg, lr);
    for (int i = 0; i < early; ++i) {
      load_tile<2>(sm, i, kv, tmap, sq, sq.kbeg + i * KT, vis_end, ref, lr, sub, tid == 0);
      fetch_refs<2>(ref, sq, sq.kbeg + (i + 1) * KT, lr);
    }
    pdl_wait();
    for (int row = lr; row < MT; row += 32)
      load_q_row(sm.q + row * ROWB + (((sub ^ row) & 7) << 4), 128, qs, sq.q0 + row, sq.q0 + row < sq.q_end, sub);
    if (early) cp_async_commit();  // Q's own group; else it goes with tile 0's
    for (int i = early; i < first; ++i) {
      load_tile<2>(sm, i, kv, tmap, sq, sq.kbeg + i * KT, vis_end, ref, lr, sub, tid == 0);
      fetch_refs<2>(ref, sq, sq.kbeg + (i + 1) * KT, lr);
    }
    tile1_after_q = first - (early > 1 ? early : 1) == 1;
    if (tmap != nullptr) __syncthreads();  // the mbarriers' init, before any thread waits on them
  }

  const int rg = warp % RG, kg = warp / RG, ra = 16 * rg + g;  // S role: rows ra, ra + 8
  const int tm0 = sq.q0 + ra < sq.q_end ? (sq.q0 + ra) / h * R : -1;  // tree-mask rows of queries ra, ra + 8
  const int tm1 = sq.q0 + ra + 8 < sq.q_end ? (sq.q0 + ra + 8) / h * R : -1;
  float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
  float o[RG][8][4] = {};
  u32 parity = 0;  // bit st: the phase stage st's mbarrier completes next
  for (int it = 0; it < ntiles; ++it) {
    const int buf = NSTAGE == 2 ? it & 1 : 0;
    const int kb = sq.kbeg + it * KT;
    if (it == 0 && tile1_after_q) cp_async_wait<1>();  // tile 1 may still be on its way
    else cp_async_wait<0>();
    if (by_tma(tmap, kb, vis_end)) mbar_wait(&sm.bar[buf], parity >> buf & 1), parity ^= 1u << buf;
    __syncthreads();  // tile it landed for all threads; every warp is done with tile it-1
    if (NSTAGE == 2 && it >= 1 && it + 1 < ntiles) {
      load_tile<2>(sm, buf ^ 1, kv, tmap, sq, kb + KT, vis_end, ref, lr, sub, tid == 0);
      fetch_refs<2>(ref, sq, kb + 2 * KT, lr);
    }
    float s[NT][4];
    qk_tile<NT>(sm.q + (16 * rg + (lane & 15)) * ROWB, sm.k[buf] + (8 * NT * kg + (lane & 7)) * 128, lane, s);
    float mx0, mx1;
    mask_scores<NT>(s, sq, kb + 8 * NT * kg + 2 * t4, kb + KT <= vis_end, tree_mask, tm0, tm1, scale2,
                    mx0, mx1);
    if (t4 == 0) sm.red[kg * MT + ra] = mx0, sm.red[kg * MT + ra + 8] = mx1;
    __syncthreads();
    float tmax0 = NEG_INF, tmax1 = NEG_INF;
#pragma unroll
    for (int k = 0; k < KG; ++k)
      tmax0 = fmaxf(tmax0, sm.red[k * MT + ra]), tmax1 = fmaxf(tmax1, sm.red[k * MT + ra + 8]);
    const float al0 = softmax_row<NT>(s, 0, tmax0, m0, l0), al1 = softmax_row<NT>(s, 2, tmax1, m1, l1);
#pragma unroll
    for (int n = 0; n < NT; ++n) {  // P row ra / ra+8, keys 8(NT·kg + n) + 2t4: chunk NT·kg + n
      const int off = ((((NT * kg + n) ^ g) & 7) << 4) + 4 * t4;
      *reinterpret_cast<u32*>(sm.p + ra * PB + off) = pack_bf16x2(s[n][0], s[n][1]);
      *reinterpret_cast<u32*>(sm.p + (ra + 8) * PB + off) = pack_bf16x2(s[n][2], s[n][3]);
    }
    if (kg == 0 && t4 == 0) sm.alpha[ra] = al0, sm.alpha[ra + 8] = al1;
    __syncthreads();
    pv_tile<RG>(sm.p, sm.k[buf], sm.alpha, warp, lane, o);
    if (NSTAGE == 1 && it + 1 < ntiles) {
      __syncthreads();  // the single buffer is free
      load_tile<2>(sm, 0, kv, tmap, sq, kb + KT, vis_end, ref, lr, sub, tid == 0);
      fetch_refs<2>(ref, sq, kb + 2 * KT, lr);
    }
  }

  // row sums: this thread's keys -> its key group (shuffle over t4) -> all groups (smem)
#pragma unroll
  for (int d = 1; d < 4; d <<= 1) l0 += __shfl_xor_sync(0xffffffffu, l0, d), l1 += __shfl_xor_sync(0xffffffffu, l1, d);
  if (t4 == 0) sm.red[kg * MT + ra] = l0, sm.red[kg * MT + ra + 8] = l1;
  if (kg == 0 && t4 == 0) sm.m[ra] = m0, sm.m[ra + 8] = m1;
  __syncthreads();
  sq.q0 = sm.qrange[0], sq.q_end = sm.qrange[1];
  write_out<RG>(o, sm.red, sm.m, sq, warp, lane, SCHED ? zsplits > 1 : gridDim.z > 1,
                SCHED ? sm.qrange[2] : (int)blockIdx.z, TH, out, o_part, lse_part);
}

// Splits that hold keys of query row qr's sequence (the chunking of mla_attn's block_seq).
__device__ __forceinline__ int merge_nsplit(const i64* prefix_lens, const i64* row_starts, int B, int h, int splits,
                                            i64 qr, int mt, int sched_slots) {
  if (sched_slots > 0) splits = plan_splits<true>(prefix_lens, row_starts, B, h, mt, sched_slots, splits);
  const i64 t = qr / h;
  int b = 0;
  while (b + 1 < B && row_starts[b + 1] <= t) ++b;
  return seq_splits((int)(prefix_lens[b] + row_starts[b + 1] - row_starts[b]), splits);
}

// The merges' start under programmatic dependent launch -> merge_nsplit. It lets a PDL successor start (W_UV's
// skinny_gemm streams its weights, and in the bench the next mla_attn its prefix tiles; both wait for this grid
// before reading what it writes), reads only the plan, then waits until mla_attn's partials are complete and visible.
__device__ __forceinline__ int merge_start(const i64* prefix_lens, const i64* row_starts, int B, int h, int splits,
                                           i64 qr, int mt, int sched_slots) {
  pdl_trigger();
  const int nsplit = merge_nsplit(prefix_lens, row_starts, B, h, splits, qr, mt, sched_slots);
  pdl_wait();
  return nsplit;
}

// The merge weights of row qr, by a block of 256 threads: wz[z] = 2^(lse_z - M) in shared memory (M the largest
// LSE; all 0 when no split saw a key), -> their sum. red: 8 floats of shared scratch.
__device__ __forceinline__ float merge_weights(const float* __restrict__ lse_part, int TH, i64 qr, int nsplit,
                                               float* wz, float* red) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float mx = NEG_INF;
  for (int z = tid; z < nsplit; z += 256) mx = fmaxf(mx, wz[z] = lse_part[(i64)z * TH + qr]);
  for (int d = 16; d > 0; d >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, d));
  if (lane == 0) red[warp] = mx;
  __syncthreads();
  mx = red[0];
  for (int w = 1; w < 8; ++w) mx = fmaxf(mx, red[w]);
  if (mx == NEG_INF) mx = 0.f;  // no split saw a key: all weights 0, output 0
  __syncthreads();  // red is reused below
  float wsum = 0.f;
  for (int z = tid; z < nsplit; z += 256) wsum += (wz[z] = exp2f(wz[z] - mx));  // -inf (saw no key) -> 0
  for (int d = 16; d > 0; d >>= 1) wsum += __shfl_xor_sync(0xffffffffu, wsum, d);
  if (lane == 0) red[warp] = wsum;
  __syncthreads();  // also publishes wz
  wsum = 0.f;
  for (int w = 0; w < 8; ++w) wsum += red[w];
  return wsum;
}

// 4 merged columns, normalized by the weights' sum and rounded to bf16, to dst (8 bytes).
__device__ __forceinline__ void store_merged(u16* dst, float4 acc, float wsum) {
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  *reinterpret_cast<uint2*>(dst) =
      make_uint2(pack_bf16x2(acc.x * inv, acc.y * inv), pack_bf16x2(acc.z * inv, acc.w * inv));
}

// Merge splits: out[r] = Σ_z 2^(lse_z - M) o_z / Σ_z 2^(lse_z - M). Grid (T*h, 4); block 256 = 8 split
// groups x 32 lanes, lane = 4 columns (float4) of the block's 128, so each thread has nsplit/8
// independent loads in flight. Requires splits <= 1024 (o_part's, mla_attn's zsplits). mt, sched_slots: mla_attn's
// query tile and schedule, whose split count (merge_nsplit) it follows. With programmatic dependent launch it
// becomes resident while mla_attn runs and reads only the plan (row_starts, prefix_lens) before its wait.
extern "C" __global__ void __launch_bounds__(256) mla_merge(
    const float* __restrict__ o_part, const float* __restrict__ lse_part, const i64* __restrict__ prefix_lens,
    const i64* __restrict__ row_starts, int B, int h, int splits, int TH, u16* __restrict__ out, int mt,
    int sched_slots) {
  __shared__ float wz[1024], red[8];
  __shared__ float4 part[7][32];
  const i64 qr = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, zg = tid >> 5;
  const int nsplit = merge_start(prefix_lens, row_starts, B, h, splits, qr, mt, sched_slots);
  const float wsum = merge_weights(lse_part, TH, qr, nsplit, wz, red);
  const float4* src = reinterpret_cast<const float4*>(o_part + qr * DV + 128 * blockIdx.y) + lane;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
  for (int z = zg; z < nsplit; z += 8) {
    const float w = wz[z];
    const float4 v = src[(i64)z * TH * (DV / 4)];
    acc.x += w * v.x, acc.y += w * v.y, acc.z += w * v.z, acc.w += w * v.w;
  }
  if (zg) part[zg - 1][lane] = acc;
  __syncthreads();
  if (zg == 0) {
#pragma unroll
    for (int j = 0; j < 7; ++j) {
      const float4 p = part[j][lane];
      acc.x += p.x, acc.y += p.y, acc.z += p.z, acc.w += p.w;
    }
    store_merged(out + qr * DV + 128 * blockIdx.y + 4 * lane, acc, wsum);
  }
}

// mla_merge32's round of partial loads: v[i] = split z0 + zg + 32i of this thread's float4 column (0 past nsplit).
__device__ __forceinline__ void load_partials(float4 (&v)[8], const float4* src, i64 zstride, int z0, int nsplit) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int z = z0 + 32 * i;
    v[i] = z < nsplit ? src[z * zstride] : make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

// mla_merge for few query rows (decode): 4x the blocks, each thread's partials loaded in one round. Grid (T*h,
// DV / 32); block 256 = 32 split groups x 8 lanes, lane l8 = float4 columns 4·l8 .. of the block's 32; a thread
// reads splits zg, zg + 32, ... up to 8 at a time (129 splits: one round of loads, against mla_merge's four),
// the first 8 before the LSE reductions. Sums in a fixed order: each thread's splits in order, the 4 groups of
// a warp by shuffles, the 8 warps in order. H200, 10 heads x 1 row: 4K keys 9.2 -> 8.7 us, 64K 32.4 -> 30.8;
// at ~30 query rows its extra blocks cost what they save, at 64 more (64 x 1 x 4K 12.7 -> 15.0 us).
extern "C" __global__ void __launch_bounds__(256) mla_merge32(
    const float* __restrict__ o_part, const float* __restrict__ lse_part, const i64* __restrict__ prefix_lens,
    const i64* __restrict__ row_starts, int B, int h, int splits, int TH, u16* __restrict__ out, int mt,
    int sched_slots) {
  __shared__ float wz[1024], red[8];
  __shared__ float4 part[8][8];
  const i64 qr = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, zg = tid >> 3, l8 = tid & 7;
  const int nsplit = merge_start(prefix_lens, row_starts, B, h, splits, qr, mt, sched_slots);
  const float4* src = reinterpret_cast<const float4*>(o_part + qr * DV + 32 * blockIdx.y) + l8;
  const i64 zstride = (i64)TH * (DV / 4);
  float4 v[8];
  load_partials(v, src, zstride, zg, nsplit);  // the first round goes out before the LSE reductions
  const float wsum = merge_weights(lse_part, TH, qr, nsplit, wz, red);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int z0 = 0;; z0 += 256) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int z = z0 + zg + 32 * i;
      const float w = z < nsplit ? wz[z] : 0.f;
      acc.x += w * v[i].x, acc.y += w * v[i].y, acc.z += w * v[i].z, acc.w += w * v[i].w;
    }
    if (z0 + 256 >= nsplit) break;
    load_partials(v, src, zstride, z0 + 256 + zg, nsplit);
  }
#pragma unroll
  for (int d = 8; d < 32; d <<= 1) {  // the warp's 4 split groups
    acc.x += __shfl_xor_sync(0xffffffffu, acc.x, d), acc.y += __shfl_xor_sync(0xffffffffu, acc.y, d);
    acc.z += __shfl_xor_sync(0xffffffffu, acc.z, d), acc.w += __shfl_xor_sync(0xffffffffu, acc.w, d);
  }
  if (lane < 8) part[warp][lane] = acc;
  __syncthreads();
  if (tid < 8) {
    acc = part[0][tid];
#pragma unroll
    for (int w = 1; w < 8; ++w) {
      const float4 p = part[w][tid];
      acc.x += p.x, acc.y += p.y, acc.z += p.z, acc.w += p.w;
    }
    store_merged(out + qr * DV + 32 * blockIdx.y + 4 * tid, acc, wsum);
  }
}
