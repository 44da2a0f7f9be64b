// Absorbed-MLA tree attention over the paged 576-wide latent cache (reference/k26.md §3.6).
// MQA: every (row, head) query of a sequence attends the same keys [ĉ ; k_rope] (576) and values ĉ (512).
//
// Block = 8 warps, a tile of 32 query rows (flat (row, head) rows of one sequence) x one split of
// that sequence's keys. Keys stream in 32-key tiles through NBUF cp.async buffers; per tile:
//   S = Q Kᵀ   warp (mw, nw) computes rows 16mw..+15 x keys 8nw..+7 over 576 dims (mma m16n8k16)
//   softmax    online, fp32, base 2; ancestor mask for tree keys; P rounded to bf16
//   O += P V   warp w owns value dims 64w..64w+63 for all 32 rows (64 fp32 accumulators per thread)
// Splits (gridDim.z > 1) write normalized partial O and base-2 LSE; mla_combine merges them.
// Keys past a split's end are zero-filled, never read, so NaN in unused cache slots cannot leak.

#define D 576      // key width: 512 latent + 64 rope
#define DV 512     // value width (the latent)
#define KT 32      // keys per tile
#define QT 32      // query rows per block
#define LDS 584    // smem row stride (u16): 1168 B, rows land 4 banks apart -> conflict-free ldmatrix
#define SS 36      // fp32 score row stride
#define PS 40      // bf16 P row stride: 80 B

template <int NBUF>
struct Smem {
  u16 q[QT * LDS];
  u16 k[NBUF][KT * LDS];
  float s[QT * SS];
  u16 p[QT * PS];
  float m[QT], l[QT], alpha[QT];
};

// Grid (ceil(R*h / QT), B, splits); block 256; dynamic smem sizeof(Smem<NBUF>): 80 KB with one key
// buffer (the default: two blocks share an SM and overlap each other's loads; fits sm_120's 99 KB),
// 117 KB with a 2-deep ring (one block per SM; sm_90 only).
// q [T*h, 576] bf16; kv [slots, 576] bf16 (one layer); page_table [B, npages]; prefix_lens [B];
// row_starts [B+1]; tree_mask [T, R] bool; write_slots [T]. scale2 = softmax_scale * log2(e).
// splits == 1: out [T*h, 512] bf16. splits > 1: o_part [splits, T*h, 512] fp32, lse_part [splits, T*h].
template <int NBUF>
__global__ void __launch_bounds__(256) mla_tree_attn(
    const u16* __restrict__ q, const u16* __restrict__ kv, const i64* __restrict__ page_table, int npages,
    int page_size, const i64* __restrict__ prefix_lens, const i64* __restrict__ row_starts,
    const unsigned char* __restrict__ tree_mask, int R, const i64* __restrict__ write_slots, int h,
    float scale2, int chunk, int TH, u16* __restrict__ out, float* __restrict__ o_part,
    float* __restrict__ lse_part) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem<NBUF>& sm = *reinterpret_cast<Smem<NBUF>*>(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  const int b = blockIdx.y;
  const i64 r0 = row_starts[b], rb = row_starts[b + 1] - r0, L = prefix_lens[b];
  const i64 q0 = r0 * h + (i64)blockIdx.x * QT, q_end = (r0 + rb) * h;
  const i64 kbeg = (i64)blockIdx.z * chunk, kend = min(kbeg + chunk, L + rb);
  if (q0 >= q_end || kbeg >= kend) return;

  for (int i = tid; i < QT * (D / 8); i += 256) {  // Q tile: 72 16-byte pieces per row
    const int r = i / (D / 8), c = i % (D / 8);
    const bool ok = q0 + r < q_end;
    cp_async16_zfill(&sm.q[r * LDS + c * 8], q + (ok ? (q0 + r) * D + c * 8 : 0), ok);
  }
  auto load_keys = [&](int buf, i64 kb) {
    for (int i = tid; i < KT * (D / 8); i += 256) {
      const int r = i / (D / 8), c = i % (D / 8);
      const i64 j = kb + r;
      i64 slot = 0;
      if (j < kend) slot = j < L ? page_table[(i64)b * npages + j / page_size] * page_size + j % page_size
                                 : write_slots[r0 + (j - L)];
      cp_async16_zfill(&sm.k[buf][r * LDS + c * 8], kv + slot * D + c * 8, j < kend);
    }
  };
  load_keys(0, kbeg);
  cp_async_commit();
  if (tid < QT) sm.m[tid] = NEG_INF, sm.l[tid] = 0.f;

  float o[2][8][4] = {};
  const int ntiles = (int)((kend - kbeg + KT - 1) / KT);
  for (int it = 0; it < ntiles; ++it) {
    const int buf = it % NBUF;
    const i64 kb = kbeg + (i64)it * KT;
    if (NBUF == 2) {
      if (it + 1 < ntiles) load_keys(buf ^ 1, kb + KT);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    {  // S = Q Kᵀ; four independent accumulator chains over k-steps hide the MMA latency
      const int mw = warp >> 2, nw = warp & 3;
      float s[4][4] = {};
      const u16* qa = &sm.q[(16 * mw + (lane & 15)) * LDS + (lane >> 4) * 8];
      const u16* kb_ = &sm.k[buf][(8 * nw + (lane & 7)) * LDS + (lane >> 3) * 8];
#pragma unroll 3
      for (int ks = 0; ks < D / 16; ks += 4) {
        u32 a[4][4], bk[2][4];
#pragma unroll
        for (int i = 0; i < 4; ++i) ldmatrix_x4(a[i], qa + (ks + i) * 16);
        ldmatrix_x4(bk[0], kb_ + ks * 16);  // dims ks*16 + {0, 8, 16, 24}
        ldmatrix_x4(bk[1], kb_ + ks * 16 + 32);
#pragma unroll
        for (int i = 0; i < 4; ++i)
          mma_bf16(s[i], a[i][0], a[i][1], a[i][2], a[i][3], bk[i >> 1][2 * (i & 1)], bk[i >> 1][2 * (i & 1) + 1]);
      }
      float* srow = &sm.s[(16 * mw + g) * SS + 8 * nw + 2 * t4];
      *reinterpret_cast<float2*>(srow) =
          make_float2(s[0][0] + s[1][0] + s[2][0] + s[3][0], s[0][1] + s[1][1] + s[2][1] + s[3][1]);
      *reinterpret_cast<float2*>(srow + 8 * SS) =
          make_float2(s[0][2] + s[1][2] + s[2][2] + s[3][2], s[0][3] + s[1][3] + s[2][3] + s[3][3]);
    }
    __syncthreads();
    {  // online softmax: 8 threads per row, 4 keys each
      const int row = tid >> 3, sub = tid & 7;
      const i64 qr = q0 + row, trow = qr / h;
      float x[4], mx = NEG_INF;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const i64 j = kb + 4 * sub + i;
        const bool vis = qr < q_end && j < kend && (j < L || tree_mask[trow * R + (j - L)]);
        x[i] = vis ? sm.s[row * SS + 4 * sub + i] * scale2 : NEG_INF;
        mx = fmaxf(mx, x[i]);
      }
#pragma unroll
      for (int d = 1; d < 8; d <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, d));
      const float m_old = sm.m[row], m_new = fmaxf(m_old, mx), m_use = m_new == NEG_INF ? 0.f : m_new;
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < 4; ++i) sum += (x[i] = exp2f(x[i] - m_use));
#pragma unroll
      for (int d = 1; d < 8; d <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, d);
      *reinterpret_cast<uint2*>(&sm.p[row * PS + 4 * sub]) =
          make_uint2(pack_bf16x2(x[0], x[1]), pack_bf16x2(x[2], x[3]));
      __syncwarp();  // every lane of the row has read sm.m[row] before lane 0 rewrites it
      if (sub == 0) {
        const float alpha = exp2f(m_old - m_use);
        sm.alpha[row] = alpha, sm.m[row] = m_new, sm.l[row] = sm.l[row] * alpha + sum;
      }
    }
    __syncthreads();
    {  // O = alpha * O + P V over this warp's 64 value dims
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        const float alo = sm.alpha[16 * m + g], ahi = sm.alpha[16 * m + g + 8];
#pragma unroll
        for (int n = 0; n < 8; ++n) o[m][n][0] *= alo, o[m][n][1] *= alo, o[m][n][2] *= ahi, o[m][n][3] *= ahi;
      }
#pragma unroll
      for (int kk = 0; kk < KT / 16; ++kk) {
        u32 a[2][4];
#pragma unroll
        for (int m = 0; m < 2; ++m) ldmatrix_x4(a[m], &sm.p[(16 * m + (lane & 15)) * PS + kk * 16 + (lane >> 4) * 8]);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          u32 v[4];
          ldmatrix_x4_trans(v, &sm.k[buf][(kk * 16 + (lane & 15)) * LDS + 64 * warp + 16 * np + (lane >> 4) * 8]);
#pragma unroll
          for (int m = 0; m < 2; ++m) {
            mma_bf16(o[m][2 * np], a[m][0], a[m][1], a[m][2], a[m][3], v[0], v[1]);
            mma_bf16(o[m][2 * np + 1], a[m][0], a[m][1], a[m][2], a[m][3], v[2], v[3]);
          }
        }
      }
    }
    __syncthreads();  // the next tile may now overwrite this buffer
    if (NBUF == 1 && it + 1 < ntiles) {
      load_keys(0, kb + KT);
      cp_async_commit();
    }
  }

  const bool split = gridDim.z > 1;
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int row = 16 * m + g + 8 * hf;
      const i64 qr = q0 + row;
      if (qr >= q_end) continue;
      const float l = sm.l[row], inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const int col = 64 * warp + 8 * n + 2 * t4;
        const float v0 = o[m][n][2 * hf] * inv, v1 = o[m][n][2 * hf + 1] * inv;
        if (split)
          *reinterpret_cast<float2*>(&o_part[((i64)blockIdx.z * TH + qr) * DV + col]) = make_float2(v0, v1);
        else
          *reinterpret_cast<u32*>(&out[qr * DV + col]) = pack_bf16x2(v0, v1);
      }
    }
  if (split && tid < QT && q0 + tid < q_end)
    lse_part[(i64)blockIdx.z * TH + q0 + tid] = sm.l[tid] > 0.f ? sm.m[tid] + __log2f(sm.l[tid]) : NEG_INF;
}

// Merge splits: out[r] = Σ_z 2^(lse_z - M) o_z / Σ_z 2^(lse_z - M). Grid T*h; block 512 = 4 split
// groups x 128 float4 columns, so each thread has only nsplit/4 independent loads in its chain.
// Requires splits <= 256.
extern "C" __global__ void __launch_bounds__(512) mla_combine(
    const float* __restrict__ o_part, const float* __restrict__ lse_part, const i64* __restrict__ prefix_lens,
    const i64* __restrict__ row_starts, int B, int h, int chunk, int TH, u16* __restrict__ out) {
  __shared__ float wz[256], red[16];
  __shared__ float4 part[3][DV / 4];
  const i64 qr = blockIdx.x, t = qr / h;
  const int tid = threadIdx.x, col = tid & 127, zg = tid >> 7;
  int b = 0;
  while (b + 1 < B && row_starts[b + 1] <= t) ++b;
  const i64 kv_len = prefix_lens[b] + row_starts[b + 1] - row_starts[b];
  const int nsplit = (int)((kv_len + chunk - 1) / chunk);
  float mx = NEG_INF;
  for (int z = tid; z < nsplit; z += 512) mx = fmaxf(mx, wz[z] = lse_part[(i64)z * TH + qr]);
  for (int d = 16; d > 0; d >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, d));
  if ((tid & 31) == 0) red[tid >> 5] = mx;
  __syncthreads();
  mx = red[0];
  for (int w = 1; w < 16; ++w) mx = fmaxf(mx, red[w]);
  __syncthreads();  // red is reused below
  float wsum = 0.f;
  for (int z = tid; z < nsplit; z += 512) wsum += (wz[z] = exp2f(wz[z] - mx));  // -inf (saw no key) -> 0
  for (int d = 16; d > 0; d >>= 1) wsum += __shfl_xor_sync(0xffffffffu, wsum, d);
  if ((tid & 31) == 0) red[tid >> 5] = wsum;
  __syncthreads();
  wsum = 0.f;
  for (int w = 0; w < 16; ++w) wsum += red[w];
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
  for (int z = zg; z < nsplit; z += 4) {
    const float w = wz[z];
    const float4 v = reinterpret_cast<const float4*>(o_part + ((i64)z * TH + qr) * DV)[col];
    acc.x += w * v.x, acc.y += w * v.y, acc.z += w * v.z, acc.w += w * v.w;
  }
  if (zg) part[zg - 1][col] = acc;
  __syncthreads();
  if (zg == 0) {
    for (int j = 0; j < 3; ++j) {
      const float4 p = part[j][col];
      acc.x += p.x, acc.y += p.y, acc.z += p.z, acc.w += p.w;
    }
    const float inv = 1.f / wsum;
    *reinterpret_cast<uint2*>(out + qr * DV + 4 * col) =
        make_uint2(pack_bf16x2(acc.x * inv, acc.y * inv), pack_bf16x2(acc.z * inv, acc.w * inv));
  }
}
