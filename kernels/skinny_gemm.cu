// out[M, N] = bf16(x[M, K] · W[N, K]ᵀ (+ add[M, N])) for few rows (M <= 8·NT <= 64) on tensor cores:
// the dense bf16 projections of a decode or tree-verify step, which are weight streams (M·2 FLOP per weight
// byte). fp32 accumulation, one rounding at the end (add is summed in fp32 first, as cuBLAS's beta = 1).
//
// Tiling: a block owns 16 weight rows (one m16n8k16 A tile; the tokens are the N = 8 side, NT tiles) and a
// K-slice; a cluster of CS blocks (blockIdx.x = tile·CS + rank) splits K further. Warp slot s = rank·NW +
// warp takes 64-input chunks s, s + CS·NW, ...: the warps of a tile read adjacent 128-byte pieces of each
// row at about the same time. Each warp streams its chunks through its own STAGES-deep cp.async ring (16
// rows × 128 B = 2 KB a stage, 16-byte pieces XOR-swizzled by row so ldmatrix is conflict-free), reads A
// with ldmatrix.x4 and B (x) with 4-byte loads in the mma fragment layout.
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

// One chunk of the warp's 16 rows into a ring stage: lane l copies piece l % 8 of rows l / 8 + 4i (i < 4);
// piece p of row r lands at r·128 + (p ^ (r & 7))·16. Rows >= N and inputs >= K are zero-filled.
__device__ __forceinline__ void issue_chunk(u32 stage, const u16* w, int row0, int N, int K, int c) {
  const int lane = threadIdx.x, p = lane & 7, k = c * SG_CHUNK + p * 8;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = (lane >> 3) + 4 * i;
    const bool ok = row0 + r < N && k < K;
    const u16* src = ok ? w + (i64)(row0 + r) * K + k : w;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 ::"r"(stage + r * 128 + ((p ^ (r & 7)) << 4)), "l"(src), "r"(ok ? 16 : 0));
  }
}

// x fragments of one chunk for token tile n: b[s] = {x[m][k + 2t..], x[m][k + 8 + 2t..]}, k = chunk + 16s
// (0 past K), m = 8n + g clamped to M - 1 (padded columns compute values that are never stored).
template <int NT>
__device__ __forceinline__ void load_x(u32 (&b)[NT][4][2], const u16* x, int ldx, int M, int K, int c) {
  const int g = threadIdx.x >> 2, t = threadIdx.x & 3;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const u16* xr = x + (i64)min(8 * n + g, M - 1) * ldx + c * SG_CHUNK + 2 * t;
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int k = c * SG_CHUNK + 16 * s + 8 * h;
        b[n][s][h] = k < K ? __ldg(reinterpret_cast<const u32*>(xr + 16 * s + 8 * h)) : 0u;
      }
  }
}

// Grid: tiles·CS blocks in clusters of CS (blockIdx.x = tile·CS + rank); block (32, NW).
// Dynamic smem: NW·SG_STAGES·2 KB ring (reused by the warp reduction: NW·NT·512 B) + NT·512 B block sums.
// Requires K % 8 == 0, ldx % 2 == 0, 16-byte-aligned w rows (K % 8) and x 4-byte aligned.
template <int NT>
__global__ void __launch_bounds__(256) skinny_gemm(const u16* __restrict__ x, int ldx, const u16* __restrict__ w,
                                                   const u16* add, u16* out, int M, int N, int K, int CS) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x, warp = threadIdx.y, NW = blockDim.y, tid = warp * 32 + lane;
  const int rank = (int)cluster_rank(), row0 = (blockIdx.x / CS) * 16;
  const int chunks = (K + SG_CHUNK - 1) / SG_CHUNK, slot = rank * NW + warp, stride = CS * NW;
  const int nch = slot < chunks ? (chunks - slot + stride - 1) / stride : 0;
  const u32 ring = smem_addr(smem) + warp * SG_STAGES * 2048;
#pragma unroll
  for (int s = 0; s < SG_STAGES - 1; ++s) {  // weights only: before the wait for the previous kernel
    if (s < nch) issue_chunk(ring + s * 2048, w, row0, N, K, slot + s * stride);
    cp_async_commit();
  }
  pdl_wait();
  // ldmatrix.x4: lanes 8j..8j+7 address rows (l & 7) + 8(j & 1) of piece 2s + (j >> 1): A = {rows g, g+8} x
  // {k 0-7, 8-15} of the k-step, the fragment order of mma_bf16.
  const int lr = (lane & 7) + 8 * ((lane >> 3) & 1), lp = lane >> 4;
  float acc[NT][4] = {};
  for (int i = 0; i < nch; ++i) {
    const int c = slot + i * stride;
    u32 b[NT][4][2];
    load_x<NT>(b, x, ldx, M, K, c);
    cp_async_wait<SG_STAGES - 2>();
    __syncwarp();
    if (i + SG_STAGES - 1 < nch)
      issue_chunk(ring + ((i + SG_STAGES - 1) % SG_STAGES) * 2048, w, row0, N, K, c + (SG_STAGES - 1) * stride);
    cp_async_commit();
    const u32 st = ring + (i % SG_STAGES) * 2048 + lr * 128;
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      u32 a[4];
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                   : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(st + (((2 * s + lp) ^ (lane & 7)) << 4)));
#pragma unroll
      for (int n = 0; n < NT; ++n) mma_bf16(acc[n], a[0], a[1], a[2], a[3], b[n][s][0], b[n][s][1]);
    }
  }
  cp_async_wait<0>();
  pdl_trigger();
  // Block sums: warps in order, into sums[n][lane] (the fragment layout), for the cluster to read.
  float4* red = reinterpret_cast<float4*>(smem);                            // [NW][NT][32]
  float4* sums = reinterpret_cast<float4*>(smem + NW * SG_STAGES * 2048);  // [NT][32]
  __syncthreads();
#pragma unroll
  for (int n = 0; n < NT; ++n) red[(warp * NT + n) * 32 + lane] = make_float4(acc[n][0], acc[n][1], acc[n][2], acc[n][3]);
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
  // Block `rank` finishes entries rank·NW·32 + tid, + CS·NW·32, ...: Σ over the cluster's blocks in rank order.
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
      const i64 o = (i64)m * N + row;
      out[o] = f2bf(add ? val[j] + bf2f(add[o]) : val[j]);
    }
  }
  cluster_sync();  // no block leaves while another still reads its sums
}
