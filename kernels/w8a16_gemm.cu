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
// The MMA's k order is permuted so that each lane's A fragment is one 32-bit word of int8 per row: in k-step s
// (16 inputs, 16 B of a weight row = piece s), lane 4g + t holds word t = inputs 16s + 4t .. 16s + 4t + 3 of
// rows g and g + 8 (ldmatrix), and MMA slots {2t, 2t + 1, 2t + 8, 2t + 9} stand for inputs 16s + 4t + {0, 1, 2,
// 3}. The B fragment follows: token g's inputs 16s + 4t .. + 3, 8 contiguous bytes of its staged row. Products
// are exact (|q| <= 127 times a bf16); the scale multiplies each lane's fp32 sums before the warps are summed.

#define W8_CHUNK 128  // inputs per chunk

// Four int8 (one word, inputs 4j .. 4j + 3) -> bf16x2 {in 0, in 1}, {in 2, in 3}, exactly: the fp32 bit pattern
// 0x4B000000 | (q + 128) is 2^23 + q + 128.
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

__device__ __forceinline__ void lds64(u32& a, u32& b, u32 addr) {
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(a), "=r"(b) : "r"(addr));
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
// row g + 8} x {k-step s, s + 1}. B: token row g, 8 bytes at (k-step s & 3)·32 + 8t of the s < 4 or s >= 4 half.
template <int NT, int MT>
__device__ __forceinline__ void w8_chunk_mma(float (&acc)[MT][NT][4], u32 st, u32 xst) {
  const int lane = threadIdx.x, lr = (lane & 7) + 8 * ((lane >> 3) & 1), lp = lane >> 4, sw = lane & 7;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int s = 0; s < 8; s += 2) {
    u32 r[MT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m) ldsm4(r[m], st + (16 * m + lr) * 128 + (((s + lp) ^ sw) << 4));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int ks = s + h, piece = 2 * (ks & 3) + (t >> 1);
      const u32 half = xst + (ks >> 2) * 8 * NT * 128;
      u32 b[NT][2];
#pragma unroll
      for (int n = 0; n < NT; ++n) lds64(b[n][0], b[n][1], half + (8 * n + g) * 128 + ((piece ^ g) << 4) + 8 * (t & 1));
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
    const int r = row0 + 16 * m + g;
    const float s0 = r < N ? scale[r] : 0.f, s1 = r + 8 < N ? scale[r + 8] : 0.f;
#pragma unroll
    for (int n = 0; n < NT; ++n) acc[m][n][0] *= s0, acc[m][n][1] *= s0, acc[m][n][2] *= s1, acc[m][n][3] *= s1;
    finish_tile<NT, OutT>(acc[m], reinterpret_cast<float4*>(smem), reinterpret_cast<float4*>(smem + NW * ST * STAGE),
                          rank, CS, add, out, M, N, ldo, row0 + 16 * m, 0);
  }
}

// Chunk c's token rows (both halves, 8·NT rows of 128 B each) into `xs`, by all the block's threads: piece p of
// half h's row r at (h·8·NT + r)·128 + (p ^ (r & 7))·16, as issue_rows places them; rows >= M, inputs >= K zero.
template <int NT>
__device__ __forceinline__ void w8_issue_x(u32 xs, const u16* x, int ldx, int M, int K, int c) {
  const int tid = threadIdx.y * 32 + threadIdx.x, nthreads = blockDim.y * 32;
  for (int e = tid; e < 2 * 8 * NT * 8; e += nthreads) {
    const int h = e / (8 * NT * 8), r = (e >> 3) % (8 * NT), p = e & 7, k = (2 * c + h) * 64 + p * 8;
    const bool ok = r < M && k < K;
    const u32 dst = xs + (h * 8 * NT + r) * 128 + ((p ^ (r & 7)) << 4), bytes = ok ? 16 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(ok ? x + (i64)r * ldx + k : x),
                 "r"(bytes));
  }
}

// The row-split form, for 9+ token rows over weights of many tiles: warp w of a block owns rows 16·MT·w .. of the
// block's 16·MT·NW, and every warp walks the same chunks, so the block stages each chunk's token rows once for all
// its warps (the K-split form stages them per warp: at 16-32 rows those rings leave room for ~4 warps an SM, too
// few to hide the loop's latencies). The CS blocks of a cluster split K (block `rank` takes chunks rank, rank + CS,
// ...) and sum through distributed shared memory in rank order. Ring of ST stages of [NW·MT weight tiles of
// 2048 B][token rows 2·8·NT·128 B]; one __syncthreads a chunk frees the stage the next issue overwrites.
// Grid (ceil(N / 16·MT·NW)·CS, ceil(M / 8·NT)) in clusters of CS; block (32, NW); dynamic smem
// ST·(NW·MT·2048 + 2048·NT) B (>= the NW·MT·NT·512 B of sums it is reused for). Requirements as w8a16_gemm.
template <int NT, int MT, int ST, typename OutT>
__global__ void __launch_bounds__(256) w8a16_gemm_rs(const u16* __restrict__ x, int ldx,
                                                     const signed char* __restrict__ q,
                                                     const float* __restrict__ scale, const u16* add, OutT* out, int M,
                                                     int N, int K, int CS, int ldo) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int NW = blockDim.y, warp = threadIdx.y, lane = threadIdx.x, g = lane >> 2;
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
    if (s < nch) w8_issue_x<NT>(ring + s * STAGE + xofs, x, ldx, M, K, rank + s * CS);
    cp_async_commit();
  }
  for (int i = 0; i < nch; ++i) {
    cp_async_wait<ST - 2>();
    __syncthreads();  // stage i is complete from every thread; every warp is done with stage i - 1
    if (i + ST - 1 < nch) {
      const u32 next = ring + ((i + ST - 1) % ST) * STAGE;
      const int c = rank + (i + ST - 1) * CS;
      issue_rows<4 * MT, false>(next + wofs, 0, wt, K / 2, nrows, K / 2, c);
      w8_issue_x<NT>(next + xofs, x, ldx, M, K, c);
    }
    cp_async_commit();
    const u32 st = ring + (i % ST) * STAGE;
    w8_chunk_mma<NT, MT>(acc, st + wofs, st + xofs);
  }
  cp_async_wait<0>();
  pdl_trigger();
#pragma unroll
  for (int m = 0; m < MT; ++m) {  // scale this lane's rows first (every block of the cluster: sums stay linear)
    const int r = row0 + 16 * m + g;
    const float s0 = r < N ? scale[r] : 0.f, s1 = r + 8 < N ? scale[r + 8] : 0.f;
#pragma unroll
    for (int n = 0; n < NT; ++n) acc[m][n][0] *= s0, acc[m][n][1] *= s0, acc[m][n][2] *= s1, acc[m][n][3] *= s1;
  }
  float4* sums = reinterpret_cast<float4*>(smem);  // [NW][MT][NT][32 lanes]
  __syncthreads();  // every warp is done with the ring
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < NT; ++n)
      sums[((warp * MT + m) * NT + n) * 32 + lane] =
          make_float4(acc[m][n][0], acc[m][n][1], acc[m][n][2], acc[m][n][3]);
  cluster_sync();
  const int row_b = (blockIdx.x / CS) * NW * 16 * MT;  // the block's first weight row
  for (int e = rank * NW * 32 + warp * 32 + lane; e < NW * MT * NT * 32; e += CS * NW * 32) {
    float4 v = ld_cluster_f4(smem_addr(sums + e), 0);
    for (int p = 1; p < CS; ++p) {
      const float4 r = ld_cluster_f4(smem_addr(sums + e), p);
      v.x += r.x, v.y += r.y, v.z += r.z, v.w += r.w;
    }
    const int wm = e / (NT * 32), n = (e / 32) % NT, gg = (e & 31) >> 2, tt = e & 3;
    const float val[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int mm = 8 * n + 2 * tt + (j & 1), row = row_b + wm * 16 + gg + 8 * (j >> 1);
      if (mm >= M || row >= N) continue;
      const i64 o = (i64)mm * ldo + row;
      store_out(out + o, add ? val[j] + bf2f(add[o]) : val[j]);
    }
  }
  cluster_sync();  // no block leaves while another still reads its sums
}
