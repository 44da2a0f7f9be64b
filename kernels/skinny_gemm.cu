// out[M, N] = x[M, K] · W[N, K]ᵀ (+ add[M, N]) for few rows on tensor cores, bf16 in, bf16 or fp32 out: the dense
// bf16 projections of a decode or tree-verify step, which are weight streams (M·2 FLOP per weight byte), and the
// MoE router's fp32 logits. fp32 accumulation, one rounding at the end (add is summed in fp32 first, as cuBLAS's
// beta = 1). Rows come in blocks of 8·NT (gridDim.y of them), each streaming the weights again (from L2).
//
// Tiling: a block owns 16 weight rows (one m16n8k16 A tile; the tokens are the N = 8 side, NT tiles) and a
// K-slice; a cluster of CS blocks (blockIdx.x = tile·CS + rank) splits K further. Warp slot s = rank·NW +
// warp takes 64-input chunks s, s + CS·NW, ...: the warps of a tile read adjacent 128-byte pieces of each
// row at about the same time. Each warp streams its chunks through its own STAGES-deep cp.async ring: a stage
// is the chunk's 16 weight rows and 8·NT token rows of x, 128 B each, 16-byte pieces XOR-swizzled by row so
// that ldmatrix is conflict-free; A and B both come from ldmatrix.x4.
// Sums, in a fixed order whatever M: each warp's chunks in order, the block's warps in order (shared
// memory), then the cluster's blocks in rank order (distributed shared memory). The split depends on
// (N, K) only, so a row's result is the same bits whatever M is and wherever the row sits in x (batch
// invariance: a tree's root row equals the one-row decode step's).
// PDL: the weights do not depend on the previous kernel, so the first stages are issued before
// griddepcontrol.wait; x and add are read, and out written, only after it.

#define SG_STAGES 4
#define SG_CHUNK 64  // inputs per chunk: 128 B of each of the 16 rows

__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// float4 at shared address `addr` of block `rank` of this cluster.
__device__ __forceinline__ float4 ld_cluster_f4(u32 addr, u32 rank) {
  u32 remote;
  float4 v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(remote) : "memory");
  return v;
}

// Rows [r0, r0 + 4·N4) of a ring stage from one chunk of an [nrows, K] matrix (row stride ld): lane l copies
// piece l % 8 of rows l / 8 + 4i; piece p of stage row r0 + r lands at (r0 + r)·128 + (p ^ (r & 7))·16 (r0 % 8 == 0).
// Rows >= nrows and inputs >= K are zero-filled. L1: the weights stream past it (.cg); x is cached in it (.ca),
// since every block on the SM reads the same x (from L2 alone, 448 blocks reading one x was 2x slower).
template <int N4, bool L1>
__device__ __forceinline__ void issue_rows(u32 stage, int r0, const u16* src, i64 ld, int nrows, int K, int c) {
  const int lane = threadIdx.x, p = lane & 7, k = c * SG_CHUNK + p * 8;
#pragma unroll
  for (int i = 0; i < N4; ++i) {
    const int r = (lane >> 3) + 4 * i;
    const bool ok = r < nrows && k < K;
    const u32 dst = stage + (r0 + r) * 128 + ((p ^ (r & 7)) << 4), bytes = ok ? 16 : 0;
    const u16* from = ok ? src + r * ld + k : src;
    if (L1)
      asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(from), "r"(bytes));
    else
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(from), "r"(bytes));
  }
}

// One warp's K-slice of a 16-row tile (weight rows wt[0..15], nrows of them real): acc[n] += W · x over chunks slot,
// slot + stride, ... (nch of them), token tile n in the fragment layout of mma_bf16. The first stages' weights
// go out before the wait for the previous kernel (they do not depend on it), their x after it; stage s's x
// closes commit group s, so the loop's waits see whole stages.
template <int NT>
__device__ __forceinline__ void warp_stream(float (&acc)[NT][4], u32 ring, const u16* wt, int nrows, const u16* x,
                                            int ldx, int M, int K, int slot, int stride, int nch) {
  constexpr int STAGE = (16 + 8 * NT) * 128;  // 16 weight rows, then 8·NT token rows of x
  const int lane = threadIdx.x;
#pragma unroll
  for (int s = 0; s < SG_STAGES - 1; ++s)
    if (s < nch) issue_rows<4, false>(ring + s * STAGE, 0, wt, K, nrows, K, slot + s * stride);
  pdl_wait();
#pragma unroll
  for (int s = 0; s < SG_STAGES - 1; ++s) {
    if (s < nch) issue_rows<2 * NT, true>(ring + s * STAGE, 16, x, ldx, M, K, slot + s * stride);
    cp_async_commit();
  }
  // ldmatrix.x4, A: lanes 8j..8j+7 address weight rows (l & 7) + 8(j & 1) of piece 2s + (j >> 1) = {rows g, g+8}
  // x {k 0-7, 8-15} of k-step s. B: token rows l & 7 of pieces 2s + j = {k 0-7, 8-15} of steps s and s + 1.
  const int lr = (lane & 7) + 8 * ((lane >> 3) & 1), lp = lane >> 4, sw = lane & 7;
  for (int i = 0; i < nch; ++i) {
    cp_async_wait<SG_STAGES - 2>();
    __syncwarp();
    if (i + SG_STAGES - 1 < nch) {
      const u32 next = ring + ((i + SG_STAGES - 1) % SG_STAGES) * STAGE;
      const int c = slot + (i + SG_STAGES - 1) * stride;
      issue_rows<4, false>(next, 0, wt, K, nrows, K, c);
      issue_rows<2 * NT, true>(next, 16, x, ldx, M, K, c);
    }
    cp_async_commit();
    const u32 st = ring + (i % SG_STAGES) * STAGE;
#pragma unroll
    for (int s = 0; s < 4; s += 2) {
      u32 b[NT][4];
#pragma unroll
      for (int n = 0; n < NT; ++n) ldsm4(b[n], st + (16 + 8 * n + sw) * 128 + (((2 * s + (lane >> 3)) ^ sw) << 4));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        u32 a[4];
        ldsm4(a, st + lr * 128 + (((2 * (s + h) + lp) ^ sw) << 4));
#pragma unroll
        for (int n = 0; n < NT; ++n) mma_bf16(acc[n], a[0], a[1], a[2], a[3], b[n][2 * h], b[n][2 * h + 1]);
      }
    }
  }
  cp_async_wait<0>();
}

__device__ __forceinline__ void store_out(u16* p, float v) { *p = f2bf(v); }
__device__ __forceinline__ void store_out(float* p, float v) { *p = v; }

// The tile's outputs from every warp's acc: the block's warps summed in order into sums[n][lane] (shared memory,
// `red` reused as scratch), then block `rank` finishes entries rank·NW·32 + tid, + CS·NW·32, ...: Σ over the
// cluster's blocks in rank order (distributed shared memory), + add, rounded once, stored where m < M, row < N.
template <int NT, typename OutT>
__device__ __forceinline__ void finish_tile(const float (&acc)[NT][4], float4* red, float4* sums, int rank, int CS,
                                            const u16* add, OutT* out, int M, int N, int ldo, int row0,
                                            int sigmoid) {
  const int lane = threadIdx.x, warp = threadIdx.y, NW = blockDim.y, tid = warp * 32 + lane;
  __syncthreads();  // every warp is done with its ring: reuse it
#pragma unroll
  for (int n = 0; n < NT; ++n)
    red[(warp * NT + n) * 32 + lane] = make_float4(acc[n][0], acc[n][1], acc[n][2], acc[n][3]);
  __syncthreads();
  for (int e = tid; e < NT * 32; e += NW * 32) {
    float4 v = red[e];
    for (int q = 1; q < NW; ++q) {
      const float4 r = red[q * NT * 32 + e];
      v.x += r.x, v.y += r.y, v.z += r.z, v.w += r.w;
    }
    sums[e] = v;
  }
  cluster_sync();
  for (int e = rank * NW * 32 + tid; e < NT * 32; e += CS * NW * 32) {
    float4 v = ld_cluster_f4(smem_addr(sums + e), 0);
    for (int q = 1; q < CS; ++q) {
      const float4 r = ld_cluster_f4(smem_addr(sums + e), q);
      v.x += r.x, v.y += r.y, v.z += r.z, v.w += r.w;
    }
    const int n = e >> 5, g = (e & 31) >> 2, t = e & 3;
    const float val[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int m = 8 * n + 2 * t + (j & 1), row = row0 + g + 8 * (j >> 1);
      if (m >= M || row >= N) continue;
      const i64 o = (i64)m * ldo + row;
      const float r = add ? val[j] + bf2f(add[o]) : val[j];
      store_out(out + o, sigmoid ? 1.f / (1.f + expf(-r)) : r);
    }
  }
  cluster_sync();  // no block leaves while another still reads its sums
}

// Grid: (tiles·CS, ceil(M / 8·NT), batch) blocks in clusters of CS along x (blockIdx.x = tile·CS + rank; blockIdx.y =
// row block, rows 8·NT·y ..; blockIdx.z = batch item b: x + b·bx, w + b·bw, out + b·bo); block (32, NW). Dynamic
// smem: NW·SG_STAGES·(16 + 8·NT)·128 B ring (reused by the warp reduction: NW·NT·512 B) + NT·512 B block sums.
// Requires K % 8 == 0, ldx % 8 == 0, and w and x 16-byte aligned. out's rows are ldo apart. add: null, or bf16
// [M, N] with row stride ldo (OutT = u16 only). sigmoid != 0: out = 1 / (1 + e^-y) (the MoE router's scores; each
// element once, over every block's threads). early != 0: the PDL successor may become resident from this kernel's
// start instead of its K loop's end (for a successor with work before its wait: the tree attention's prefix tiles).
template <int NT, typename OutT>
__global__ void __launch_bounds__(256) skinny_gemm(const u16* __restrict__ x, int ldx, const u16* __restrict__ w,
                                                   const u16* add, OutT* out, int M, int N, int K, int CS,
                                                   int sigmoid, int early, int ldo, i64 bx, i64 bw, i64 bo) {
  if (early) pdl_trigger();
  constexpr int STAGE = (16 + 8 * NT) * 128;
  extern __shared__ __align__(16) unsigned char smem[];
  const i64 m0 = (i64)blockIdx.y * 8 * NT;  // this block's first row
  x += blockIdx.z * bx + m0 * ldx, w += blockIdx.z * bw, out += blockIdx.z * bo + m0 * ldo;
  add = add ? add + blockIdx.z * bo + m0 * ldo : add, M = min(M - (int)m0, 8 * NT);
  const int warp = threadIdx.y, NW = blockDim.y;
  const int rank = (int)cluster_rank(), row0 = (blockIdx.x / CS) * 16;
  const int chunks = (K + SG_CHUNK - 1) / SG_CHUNK, slot = rank * NW + warp, stride = CS * NW;
  const int nch = slot < chunks ? (chunks - slot + stride - 1) / stride : 0;
  float acc[NT][4] = {};
  warp_stream<NT>(acc, smem_addr(smem) + warp * SG_STAGES * STAGE, w + (i64)row0 * K, N - row0, x, ldx, M, K, slot,
                  stride, nch);
  if (!early) pdl_trigger();  // a PDL successor may start; it waits for this grid before reading out
  finish_tile<NT, OutT>(acc, reinterpret_cast<float4*>(smem), reinterpret_cast<float4*>(smem + NW * SG_STAGES * STAGE),
                  rank, CS, add, out, M, N, ldo, row0, sigmoid);
}
