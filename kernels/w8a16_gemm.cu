// out[M, N] = x[M, K] · (q[N, K] · scale[N])ᵀ (+ add[M, N]) for few rows: int8 weights with one fp32 scale per
// output row (weight-only quantization), bf16 activations, fp32 accumulation, bf16 out (OutT). Compiled after
// skinny_gemm.cu (kernels/w8a16_gemm.py), whose tiling, cluster split of K, ring loads (issue_rows) and epilogue
// (finish_tile) it shares: a weight stream of half skinny_gemm's bytes per parameter.
//
// A chunk is 128 inputs: 128 B of each of a warp's 16·MT weight rows (MT = 1: the same bytes per stage as
// skinny_gemm's 64-input chunk) and 256 B of each token row, staged as two 128-byte halves (inputs 0-63, then
// 64-127), each with issue_rows' swizzle. Stage = [16·MT weight rows][8·NT token rows, inputs 0-63][8·NT token rows,
// inputs 64-127]. MT > 1 reuses each token fragment for MT weight tiles: with 16-32 token rows the loop is bound by
// shared-memory reads of the token fragments, not by the MMAs or the weight stream.
//
// Storage (kernels/w8a16_gemm.py `quantize_int8`): within each group of 16 inputs the int8 columns are interleaved so
// that in k-step s (16 inputs, 16 B of a weight row = piece s) the word t that ldmatrix hands lane 4g + t from rows g
// and g + 8 is that lane's whole m16n8k16 A fragment: bytes 0 and 1 hold MMA slots 2t and 2t + 1, bytes 2 and 3
// slots 2t + 8 and 2t + 9 (stored byte 4t + j = input 2t + (j & 1) + 8·(j >> 1)). The token rows (B, or wgmma's
// shared-memory B) stay in their natural order. Products are exact (|q| <= 127 times a bf16); the scale multiplies
// each lane's fp32 sums before the warps are summed.

#define W8_CHUNK 128  // inputs per chunk

// Four int8 (one stored word) -> bf16x2 {byte 0, byte 1}, {byte 2, byte 3}, exactly: the fp32 bit pattern
// 0x4B000000 | (q + 128) is 2^23 + q + 128. (A bf16x2 form, 0x4300 | (q & 127) plus 0xC300 ^ (q & 128) by
// add.bf16x2, takes 7 instructions a word instead of 11 but ran 3-10 % slower on an H200.)
__device__ __forceinline__ void i8x4_to_bf16(u32 w, u32& lo, u32& hi) {
  const u32 u = w ^ 0x80808080u;  // q + 128 in each byte
  const float bias = 8388736.f;  // 2^23 + 128
  const float f0 = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7540)) - bias;
  const float f1 = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7541)) - bias;
  const float f2 = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7542)) - bias;
  const float f3 = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7543)) - bias;
  lo = pack_bf16x2(f0, f1);
  hi = pack_bf16x2(f2, f3);
}

// A 16-row tile's sums times their rows' scales: this lane's rows r (D rows g) and r + 8 (g + 8), 0 past N.
template <int NT>
__device__ __forceinline__ void w8_scale_tile(float (&acc)[NT][4], const float* scale, int r, int N) {
  const float s0 = r < N ? scale[r] : 0.f, s1 = r + 8 < N ? scale[r + 8] : 0.f;
#pragma unroll
  for (int n = 0; n < NT; ++n) acc[n][0] *= s0, acc[n][1] *= s0, acc[n][2] *= s1, acc[n][3] *= s1;
}

// One chunk's weights (16·MT rows, int8 viewed as 64 u16 a row) and both halves of its token rows into a stage.
template <int NT, int MT>
__device__ __forceinline__ void w8_issue(u32 stage, const u16* wt, int nrows, int K, const u16* x, int ldx, int M,
                                         int c, bool weights, bool tokens) {
  if (weights) issue_rows<4 * MT, false>(stage, 0, wt, K / 2, nrows, K / 2, c);
  if (tokens) {
    issue_rows<2 * NT, true>(stage, 16 * MT, x, ldx, M, K, 2 * c);
    issue_rows<2 * NT, true>(stage, 16 * MT + 8 * NT, x, ldx, M, K, 2 * c + 1);
  }
}

// acc[m][n] += the MMAs of one staged chunk: the warp's 16·MT weight rows at `st` (128 B a row) and the token
// rows at `xst` (two halves of 8·NT rows of 128 B, inputs 0-63 then 64-127). Each token fragment is loaded once
// for the MT weight tiles (shared-memory reads, not the MMAs, bound this loop as the token tiles grow).
// ldmatrix.x4 (A): lanes 8j..8j+7 address weight rows (l & 7) + 8(j & 1) of piece s + (j >> 1): r = {row g,
// row g + 8} x {k-step s, s + 1}. ldmatrix.x2 (B, per k-step ks): token rows l & 7 of pieces 2(ks & 3) + j of the
// ks < 4 or ks >= 4 half = inputs 0-7 and 8-15 (x4 over two k-steps would hold twice the B registers).
template <int NT, int MT>
__device__ __forceinline__ void w8_chunk_mma(float (&acc)[MT][NT][4], u32 st, u32 xst) {
  const int lane = threadIdx.x, lj = (lane >> 3) & 1, lr = (lane & 7) + 8 * lj, lp = lane >> 4, sw = lane & 7;
#pragma unroll
  for (int s = 0; s < 8; s += 2) {
    u32 r[MT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m) ldsm4(r[m], st + (16 * m + lr) * 128 + (((s + lp) ^ sw) << 4));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int ks = s + h;
      const u32 half = xst + (ks >> 2) * 8 * NT * 128;
      u32 b[NT][2];
#pragma unroll
      for (int n = 0; n < NT; ++n) ldsm2(b[n], half + (8 * n + sw) * 128 + (((2 * (ks & 3) + lj) ^ sw) << 4));
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        u32 a0, a1, a2, a3;
        i8x4_to_bf16(r[m][2 * h], a0, a2);
        i8x4_to_bf16(r[m][2 * h + 1], a1, a3);
#pragma unroll
        for (int n = 0; n < NT; ++n) mma_bf16(acc[m][n], a0, a1, a2, a3, b[n][0], b[n][1]);
      }
    }
  }
}

// One warp's K-slice of 16·MT weight rows, as skinny_gemm's warp_stream (ring of ST stages, commit groups, PDL
// order), over int8 weights: acc += q · x over chunks slot, slot + stride, ... (nch of them).
template <int NT, int MT, int ST>
__device__ __forceinline__ void w8_warp_stream(float (&acc)[MT][NT][4], u32 ring, const u16* wt, int nrows,
                                               const u16* x, int ldx, int M, int K, int slot, int stride, int nch) {
  constexpr int STAGE = 2048 * (MT + NT);
#pragma unroll
  for (int s = 0; s < ST - 1; ++s)
    if (s < nch) w8_issue<NT, MT>(ring + s * STAGE, wt, nrows, K, x, ldx, M, slot + s * stride, true, false);
  pdl_wait();
#pragma unroll
  for (int s = 0; s < ST - 1; ++s) {
    if (s < nch) w8_issue<NT, MT>(ring + s * STAGE, wt, nrows, K, x, ldx, M, slot + s * stride, false, true);
    cp_async_commit();
  }
  for (int i = 0; i < nch; ++i) {
    cp_async_wait<ST - 2>();
    __syncwarp();
    if (i + ST - 1 < nch)
      w8_issue<NT, MT>(ring + ((i + ST - 1) % ST) * STAGE, wt, nrows, K, x, ldx, M, slot + (i + ST - 1) * stride,
                       true, true);
    cp_async_commit();
    const u32 st = ring + (i % ST) * STAGE;
    w8_chunk_mma<NT, MT>(acc, st, st + MT * 2048);
  }
  cp_async_wait<0>();
}

// Grid: (ceil(N / 16·MT)·CS, ceil(M / 8·NT)) blocks in clusters of CS along x (blockIdx.x = group·CS + rank):
// a block owns 16·MT weight rows, its NW warps and the cluster's blocks split K as in skinny_gemm. Block (32, NW).
// Dynamic smem: NW·ST·2048·(MT + NT) B ring (reused by the warp reduction) + NT·512 B block sums.
// Requires K % 16 == 0, ldx % 8 == 0, q and x 16-byte aligned. out's rows are ldo apart; add: null, or bf16 [M, N]
// with row stride ldo (OutT = u16 only).
template <int NT, int MT, int ST, typename OutT>
__global__ void __launch_bounds__(256) w8a16_gemm(const u16* __restrict__ x, int ldx, const signed char* __restrict__ q,
                                                  const float* __restrict__ scale, const u16* add, OutT* out, int M,
                                                  int N, int K, int CS, int ldo) {
  constexpr int STAGE = 2048 * (MT + NT);
  extern __shared__ __align__(16) unsigned char smem[];
  const i64 m0 = (i64)blockIdx.y * 8 * NT;  // this block's first token row
  x += m0 * ldx, out += m0 * ldo, add = add ? add + m0 * ldo : add, M = min(M - (int)m0, 8 * NT);
  const int warp = threadIdx.y, NW = blockDim.y, g = threadIdx.x >> 2;
  const int rank = (int)cluster_rank(), row0 = (blockIdx.x / CS) * 16 * MT;
  const int chunks = (K + W8_CHUNK - 1) / W8_CHUNK, slot = rank * NW + warp, stride = CS * NW;
  const int nch = slot < chunks ? (chunks - slot + stride - 1) / stride : 0;
  float acc[MT][NT][4] = {};
  w8_warp_stream<NT, MT, ST>(acc, smem_addr(smem) + warp * ST * STAGE,
                             reinterpret_cast<const u16*>(q + (i64)row0 * K), N - row0, x, ldx, M, K, slot, stride,
                             nch);
  pdl_trigger();  // a PDL successor may start; it waits for this grid before reading out
#pragma unroll
  for (int m = 0; m < MT; ++m) {  // each 16-row tile: scale this lane's rows, then skinny_gemm's sums and stores
    w8_scale_tile<NT>(acc[m], scale, row0 + 16 * m + g, N);
    finish_tile<NT, OutT>(acc[m], reinterpret_cast<float4*>(smem), reinterpret_cast<float4*>(smem + NW * ST * STAGE),
                          rank, CS, add, out, M, N, ldo, row0 + 16 * m, 0);
  }
}

// Chunk c's token rows (both halves, 8·NT rows of 128 B each) into `xs`, by the block's NTH threads (a multiple of
// 128): piece p of half h's row r at (h·8·NT + r)·128 + (p ^ (r & 7))·16, as issue_rows places them; rows >= M and
// inputs >= K zero. Thread t copies piece t & 7 of half (t >> 3) & 1 of rows t / 16 + i·NTH / 16: its swizzle
// (r & 7) and its offsets stay the same for every chunk, only the rows step.
template <int NT, int NTH>
__device__ __forceinline__ void w8_issue_x(u32 xs, const u16* x, int ldx, int M, int K, int c) {
  constexpr int STEP = NTH / 16;  // rows apart, a multiple of 8
  const int t = threadIdx.y * 32 + threadIdx.x, p = t & 7, h = (t >> 3) & 1, r0 = t >> 4;
  const int k = (2 * c + h) * 64 + p * 8;
  const u32 dst = xs + (h * 8 * NT + r0) * 128 + ((p ^ (r0 & 7)) << 4);
#pragma unroll
  for (int i = 0; i < (8 * NT + STEP - 1) / STEP; ++i) {
    const int r = r0 + i * STEP;
    if (8 * NT % STEP != 0 && r >= 8 * NT) break;
    const bool ok = r < M && k < K;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;" ::"r"(dst + i * STEP * 128),
                 "l"(ok ? x + (i64)r * ldx + k : x), "r"(ok ? 16 : 0));
  }
}

// The outputs of a block whose NW warps each hold MT 16-row tiles: warp w's tile m is rows row_b + tile_row(w, m),
// tile_row = 64(MT·(w / 4) + m) + 16(w % 4) (WG: warpgroup w / 4's m64 tiles) or 16(w·MT + m) (the row-split
// form). Each lane's sums are scaled by their rows' scales (in every block of the cluster: the sums stay linear),
// parked in shared memory [NW][MT][NT][32 lanes], summed over the cluster's blocks in rank order (distributed
// shared memory), + add, rounded once and stored where token < M and row < N. `smem` must be free (the ring is
// done).
template <int NT, int MT, bool WG, typename OutT>
__device__ __forceinline__ void w8_finish_rows(float (&acc)[MT][NT][4], unsigned char* smem, int rank, int CS,
                                               int row_b, const float* scale, const u16* add, OutT* out, int M, int N,
                                               int ldo) {
  const int NW = blockDim.y, warp = threadIdx.y, lane = threadIdx.x, g = lane >> 2;
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    const int tile = WG ? 64 * (MT * (warp >> 2) + m) + 16 * (warp & 3) : 16 * (warp * MT + m);
    w8_scale_tile<NT>(acc[m], scale, row_b + tile + g, N);
  }
  float4* sums = reinterpret_cast<float4*>(smem);
  __syncthreads();  // every warp is done with the ring
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < NT; ++n)
      sums[((warp * MT + m) * NT + n) * 32 + lane] =
          make_float4(acc[m][n][0], acc[m][n][1], acc[m][n][2], acc[m][n][3]);
  cluster_sync();
  for (int e = rank * NW * 32 + warp * 32 + lane; e < NW * MT * NT * 32; e += CS * NW * 32) {
    float4 v = ld_cluster_f4(smem_addr(sums + e), 0);
    for (int p = 1; p < CS; ++p) {
      const float4 r = ld_cluster_f4(smem_addr(sums + e), p);
      v.x += r.x, v.y += r.y, v.z += r.z, v.w += r.w;
    }
    const int wm = e / (NT * 32), n = (e / 32) % NT, gg = (e & 31) >> 2, tt = e & 3;
    const int w = wm / MT, tile = WG ? 64 * (MT * (w >> 2) + wm % MT) + 16 * (w & 3) : 16 * wm;
    const float val[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int mm = 8 * n + 2 * tt + (j & 1), row = row_b + tile + gg + 8 * (j >> 1);
      if (mm >= M || row >= N) continue;
      const i64 o = (i64)mm * ldo + row;
      store_out(out + o, add ? val[j] + bf2f(add[o]) : val[j]);
    }
  }
  cluster_sync();  // no block leaves while another still reads its sums
}

// The row-split form, for 9+ token rows over weights of many tiles: warp w of a block owns rows 16·MT·w .. of the
// block's 16·MT·NW, and every warp walks the same chunks, so the block stages each chunk's token rows once for all
// its warps (the K-split form stages them per warp: at 16-32 rows those rings leave room for ~4 warps an SM, too
// few to hide the loop's latencies). The CS blocks of a cluster split K (block `rank` takes chunks rank, rank + CS,
// ...) and sum through distributed shared memory in rank order. Ring of ST stages of [NW·MT weight tiles of
// 2048 B][token rows 2·8·NT·128 B]; one __syncthreads a chunk frees the stage the next issue overwrites.
// Grid (ceil(N / 16·MT·NW)·CS, ceil(M / 8·NT)) in clusters of CS; block (32, NW = 4); dynamic smem
// ST·(NW·MT·2048 + 2048·NT) B (>= the NW·MT·NT·512 B of sums it is reused for). Requirements as w8a16_gemm.
template <int NT, int MT, int ST, typename OutT>
__global__ void __launch_bounds__(128) w8a16_gemm_rs(const u16* __restrict__ x, int ldx,
                                                     const signed char* __restrict__ q,
                                                     const float* __restrict__ scale, const u16* add, OutT* out, int M,
                                                     int N, int K, int CS, int ldo) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int NW = 4;  // RS_WARPS: w8_issue_x<NT, 128> stages the token rows with 128 threads
  const int warp = threadIdx.y;
  const int rank = (int)cluster_rank(), STAGE = NW * MT * 2048 + 2 * 8 * NT * 128;
  const int row0 = ((blockIdx.x / CS) * NW + warp) * 16 * MT;  // this warp's first weight row
  const i64 m0 = (i64)blockIdx.y * 8 * NT;
  x += m0 * ldx, out += m0 * ldo, add = add ? add + m0 * ldo : add, M = min(M - (int)m0, 8 * NT);
  const u16* wt = reinterpret_cast<const u16*>(q + (i64)min(row0, N) * K);
  const int chunks = (K + W8_CHUNK - 1) / W8_CHUNK, nrows = N - row0;
  const int nch = rank < chunks ? (chunks - rank + CS - 1) / CS : 0;
  const u32 ring = smem_addr(smem), wofs = warp * MT * 2048, xofs = NW * MT * 2048;
  float acc[MT][NT][4] = {};
#pragma unroll
  for (int s = 0; s < ST - 1; ++s)
    if (s < nch) issue_rows<4 * MT, false>(ring + s * STAGE + wofs, 0, wt, K / 2, nrows, K / 2, rank + s * CS);
  pdl_wait();
#pragma unroll
  for (int s = 0; s < ST - 1; ++s) {
    if (s < nch) w8_issue_x<NT, 128>(ring + s * STAGE + xofs, x, ldx, M, K, rank + s * CS);
    cp_async_commit();
  }
  for (int i = 0; i < nch; ++i) {
    cp_async_wait<ST - 2>();
    __syncthreads();  // stage i is complete from every thread; every warp is done with stage i - 1
    if (i + ST - 1 < nch) {
      const u32 next = ring + ((i + ST - 1) % ST) * STAGE;
      const int c = rank + (i + ST - 1) * CS;
      issue_rows<4 * MT, false>(next + wofs, 0, wt, K / 2, nrows, K / 2, c);
      w8_issue_x<NT, 128>(next + xofs, x, ldx, M, K, c);
    }
    cp_async_commit();
    const u32 st = ring + (i % ST) * STAGE;
    w8_chunk_mma<NT, MT>(acc, st + wofs, st + xofs);
  }
  cp_async_wait<0>();
  pdl_trigger();
  w8_finish_rows<NT, MT, false>(acc, smem, rank, CS, (blockIdx.x / CS) * NW * 16 * MT, scale, add, out, M, N, ldo);
}
