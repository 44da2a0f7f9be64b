// DFlash block attention (GQA) over the drafter's paged K/V pool plus the block's own keys.
// The keys of sequence b are [context (P·page_size, read through page_table) ; block (Bk rows)]; query head
// qh reads kv head qh / G (G = nh / nkv, torch's enable_gqa). All G·Bk queries of one kv head share every
// key tile: a block takes the QR = 64 flat query rows r = t·G + j (token t, group head j) of one (sequence,
// kv head) and one chunk of KC = 128 keys (grid (chunks, nkv, B)), and writes an unnormalized partial
// O = Σ 2^(s - m) v with its row max m (base 2) and sum l; dflash_merge combines the chunks.
//
// Shared rows are HD bf16 (HD/8 chunks of 16 B); chunk c of row r sits at c ^ (r & 7), so the eight row
// addresses of every ldmatrix hit distinct banks. A key no token of the block sees is zero-filled, never
// read: NaN or stale data in unused pool slots cannot leak. Warp w owns query rows 16w..16w+15:
//   S = Q Kᵀ (16 x KC, mma m16n8k16 over HD), masked (mask[b, t, key]) and scaled to base 2 in place;
//   P = 2^(S - m) in registers (the S accumulators are P's A fragments); O = P V (16 x HD).

#define QR 64   // query rows per block
#define KC 128  // keys per block

template <int HD>
struct DflashSmem {
  unsigned char q[QR * HD * 2];
  unsigned char k[KC * HD * 2];
  unsigned char v[KC * HD * 2];
  unsigned char mask[QR * KC];  // [token][key] visibility, tokens of this block's rows (<= QR)
};

template <int HD>
__device__ __forceinline__ int dswz(int r, int c) { return r * HD * 2 + ((c ^ (r & 7)) << 4); }

// q [B, Bk, nh, HD]; kp, vp [slots, nkv, HD] (one pool layer); page_table [B, P]; kb [B, Bk, nkv, HD]; vb the
// same with its tokens vbs elements apart (a column block of the fused k|v projection's output, not copied);
// mask byte of (b, t, key j) at mask[b·msb + t·mst + j], keys j of [context ; block]; scale2 = scale·log2(e).
// Out: o_part [B, nkv, chunks, QR, HD] fp32, ml [B, nkv, chunks, QR] float2 (m, l); m = -inf: no key seen.
template <int HD>
__global__ void __launch_bounds__(128) dflash_attn(
    const u16* __restrict__ q, const u16* __restrict__ kp, const u16* __restrict__ vp,
    const i64* __restrict__ page_table, int P, int page_size, const u16* __restrict__ kb,
    const u16* __restrict__ vb, i64 vbs, const unsigned char* __restrict__ mask, i64 msb, i64 mst, int Bk, int nh,
    int nkv, float scale2, float* __restrict__ o_part, float2* __restrict__ ml) {
  constexpr int CH = HD / 8;  // 16-byte chunks per row
  pdl_trigger();  // the merge's blocks may become resident; they wait for this grid before reading it
  extern __shared__ __align__(128) unsigned char smem_raw[];
  DflashSmem<HD>& sm = *reinterpret_cast<DflashSmem<HD>*>(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int chunk = blockIdx.x, h = blockIdx.y, b = blockIdx.z, chunks = gridDim.x;
  const int G = nh / nkv, rows = Bk * G, Lc = P * page_size, L = Lc + Bk, j0 = chunk * KC;

  for (int i = tid; i < QR * CH; i += 128) {  // Q rows r = t·G + j, zero past the block's queries
    const int r = i / CH, c = i % CH;
    const bool ok = r < rows;
    const i64 src = ok ? ((((i64)b * Bk + r / G) * nh + h * G + r % G) * HD + 8 * c) : 0;
    cp_async16_zfill(sm.q + dswz<HD>(r, c), q + src, ok);
  }
  for (int i = tid; i < Bk * KC; i += 128) {  // visibility of this chunk's keys, 0 past L
    const int t = i / KC, j = j0 + i % KC;
    sm.mask[i] = j < L ? mask[(i64)b * msb + (i64)t * mst + j] : 0;
  }
  __syncthreads();
  for (int i = tid; i < KC * CH; i += 128) {  // K and V rows of keys some token sees
    const int r = i / CH, c = i % CH, j = j0 + r;
    bool seen = false;
    for (int t = 0; t < Bk; ++t) seen |= sm.mask[t * KC + r] != 0;
    const u16 *ks = kp, *vs = vp;
    i64 off = 0, voff = 0;
    if (seen && j < Lc) {
      const i64 slot = page_table[(i64)b * P + j / page_size] * page_size + j % page_size;
      voff = off = (slot * nkv + h) * HD + 8 * c;
    } else if (seen) {
      const i64 tok = (i64)b * Bk + (j - Lc);
      ks = kb, vs = vb, off = (tok * nkv + h) * HD + 8 * c, voff = tok * vbs + h * HD + 8 * c;
    }
    cp_async16_zfill(sm.k + dswz<HD>(r, c), ks + off, seen);
    cp_async16_zfill(sm.v + dswz<HD>(r, c), vs + voff, seen);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  const int g = lane >> 2, t4 = lane & 3, r7 = lane & 7, hi = lane >> 4, c4 = (lane >> 3) & 3;
  float s[KC / 8][4] = {};
  const unsigned char* qa = sm.q + (16 * warp + (lane & 15)) * HD * 2;
  const unsigned char* kr = sm.k + r7 * HD * 2;
#pragma unroll
  for (int kp2 = 0; kp2 < HD / 32; ++kp2) {  // two k-steps (32 dims, chunks 4kp2..4kp2+3) at a time
    u32 a[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i) ldmatrix_x4(a[i], qa + (((4 * kp2 + 2 * i + hi) ^ r7) << 4));
#pragma unroll
    for (int n = 0; n < KC / 8; ++n) {
      u32 bk[4];
      ldmatrix_x4(bk, kr + n * 8 * HD * 2 + (((4 * kp2 + c4) ^ r7) << 4));
      mma_bf16(s[n], a[0][0], a[0][1], a[0][2], a[0][3], bk[0], bk[1]);
      mma_bf16(s[n], a[1][0], a[1][1], a[1][2], a[1][3], bk[2], bk[3]);
    }
  }

  // This thread's rows ra = 16w + g and ra + 8; scores of keys 8n + 2t4 + (e & 1).
  const int ra = 16 * warp + g;
  const bool ok0 = ra < rows, ok1 = ra + 8 < rows;
  const unsigned char* m0 = sm.mask + (ok0 ? ra / G : 0) * KC;
  const unsigned char* m1 = sm.mask + (ok1 ? (ra + 8) / G : 0) * KC;
  float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
  for (int n = 0; n < KC / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = 8 * n + 2 * t4 + (e & 1);
      const bool vis = e < 2 ? ok0 && m0[col] : ok1 && m1[col];
      s[n][e] = vis ? s[n][e] * scale2 : NEG_INF;
      if (e < 2) mx0 = fmaxf(mx0, s[n][e]);
      else mx1 = fmaxf(mx1, s[n][e]);
    }
  quad_max2(mx0, mx1);
  const float use0 = mx0 == NEG_INF ? 0.f : mx0, use1 = mx1 == NEG_INF ? 0.f : mx1;
  float l0 = 0.f, l1 = 0.f;
#pragma unroll
  for (int n = 0; n < KC / 8; ++n) {
    s[n][0] = exp2f(s[n][0] - use0), s[n][1] = exp2f(s[n][1] - use0);
    s[n][2] = exp2f(s[n][2] - use1), s[n][3] = exp2f(s[n][3] - use1);
    l0 += s[n][0] + s[n][1], l1 += s[n][2] + s[n][3];
  }
#pragma unroll
  for (int d = 1; d < 4; d <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, d);
    l1 += __shfl_xor_sync(0xffffffffu, l1, d);
  }

  float o[HD / 8][4] = {};
#pragma unroll
  for (int kk = 0; kk < KC / 16; ++kk) {  // 16 keys: P's A fragment from two S n-tiles
    const u32 a0 = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]), a1 = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
    const u32 a2 = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    const u32 a3 = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    const unsigned char* vrow = sm.v + (16 * kk + (lane & 15)) * HD * 2;
#pragma unroll
    for (int np = 0; np < HD / 16; ++np) {
      u32 v[4];
      ldmatrix_x4_trans(v, vrow + (((2 * np + hi) ^ r7) << 4));
      mma_bf16(o[2 * np], a0, a1, a2, a3, v[0], v[1]);
      mma_bf16(o[2 * np + 1], a0, a1, a2, a3, v[2], v[3]);
    }
  }

  const i64 part = ((i64)b * nkv + h) * chunks + chunk;
  float* op = o_part + part * QR * HD;
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) {
    const int col = 8 * n + 2 * t4;
    if (ok0) *reinterpret_cast<float2*>(&op[ra * HD + col]) = make_float2(o[n][0], o[n][1]);
    if (ok1) *reinterpret_cast<float2*>(&op[(ra + 8) * HD + col]) = make_float2(o[n][2], o[n][3]);
  }
  if (t4 == 0) {
    if (ok0) ml[part * QR + ra] = make_float2(mx0, l0);
    if (ok1) ml[part * QR + ra + 8] = make_float2(mx1, l1);
  }
}

// Grid (QR, nkv, B), block HD: out[b, t, h·G + j, d] for query row r = t·G + j of kv head h, from the
// chunks' partials: Σ 2^(m_c - M) O_c / Σ 2^(m_c - M) l_c (0 for a row that saw no key).
template <int HD>
__global__ void __launch_bounds__(HD) dflash_merge(const float* __restrict__ o_part, const float2* __restrict__ ml,
                                                   int chunks, int Bk, int nh, int nkv, u16* __restrict__ out) {
  pdl_wait();
  const int r = blockIdx.x, h = blockIdx.y, b = blockIdx.z, d = threadIdx.x, G = nh / nkv;
  if (r >= Bk * G) return;
  const i64 base = ((i64)b * nkv + h) * chunks;
  float M = NEG_INF;
  for (int c = 0; c < chunks; ++c) M = fmaxf(M, ml[(base + c) * QR + r].x);
  float num = 0.f, den = 0.f;
  if (M != NEG_INF)
    for (int c = 0; c < chunks; ++c) {
      const float2 p = ml[(base + c) * QR + r];
      if (p.x == NEG_INF) continue;
      const float w = exp2f(p.x - M);
      num += w * o_part[((base + c) * QR + r) * HD + d], den += w * p.y;
    }
  out[(((i64)b * Bk + r / G) * nh + h * G + r % G) * HD + d] = f2bf(den > 0.f ? num / den : 0.f);
}
