// w8a16_gemm_wg: w8a16_gemm's row-split form on Hopper's warpgroup MMA (sm_90a only; compiled after skinny_gemm.cu
// and w8a16_gemm.cu, whose ring loads, int8 decode, token-row staging and output sums it uses), for the 17-64 token
// rows of several drafter sessions.
// Why: from ~24 rows the mma.sync forms are bound by their MMAs and by the token fragments every warp reloads from
// shared memory (docs/kernel-notes/w8a16_gemm.md). A warpgroup MMA m64nNk16 reads the token rows (B, N = 8·NT) from
// shared memory once for the warpgroup's 64 weight rows, at twice mma.sync's rate. The weights stay int8 in shared
// memory and become the register A operand: each warp decodes its 16 rows' fragment as the mma.sync forms do (the
// storage's interleave makes ldmatrix's word the fragment), CUTLASS's mixed-input design.
//
// Block = G warpgroups (G·4 warps) sharing each chunk's token rows; warpgroup u owns 64·MT weight rows: its m64 tile
// m is rows row_b + 64(MT·u + m) .. + 63, warp w of it holds rows 16w .. 16w + 15 of each (the wgmma A layout).
// Stage = [warp][m][16 rows x 128 B] of int8 weights, then the chunk's token rows as two halves of 8·NT rows x 128 B
// (inputs 0-63, 64-127): w8_issue_x's XOR swizzle on 1024-byte atoms is wgmma's canonical K-major 128-byte-swizzle
// layout. Per two k-steps (32 inputs) each warp decodes its 2·MT fragments, the warpgroup issues 2·MT wgmmas and
// commits them as one group, then waits until only that group is pending, so a fragment's registers are rewritten
// only after the MMAs that read them (one k-step a group: within 2 %); at the chunk's
// end it waits for all, so the stage can be refilled. The cluster splits K and sums as the row-split form does.

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d[NT][4] += A[64 x 16] B[16 x 8·NT]: A from registers (the mma.sync A fragment of the warp's 16 rows), B K-major in
// shared memory (descriptor db). D layout: warp w rows 16w + g, + 8; lane 4g + t columns 8j + 2t, + 1. One
// specialization per N (NT = 3-8, the token tiles this form is built for): the instruction's shape and its 4·NT
// accumulator operands are literals.
template <int NT>
__device__ __forceinline__ void wgmma_ra(float (&d)[NT][4], const u32 (&a)[4], u64 db);
template <>
__device__ __forceinline__ void wgmma_ra<3>(float (&d)[3][4], const u32 (&a)[4], u64 db) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %17, 0;\nwgmma.mma_async.sync.aligned.m64n24k16.f32.bf16.bf16 "
               "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11}, "
               "{%12,%13,%14,%15}, %16, p, 1, 1, 0;\n}\n"
               : WG_F4(0), WG_F4(1), WG_F4(2)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
template <>
__device__ __forceinline__ void wgmma_ra<4>(float (&d)[4][4], const u32 (&a)[4], u64 db) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\nwgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
               "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "
               "{%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
               : WG_F4(0), WG_F4(1), WG_F4(2), WG_F4(3)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
template <>
__device__ __forceinline__ void wgmma_ra<5>(float (&d)[5][4], const u32 (&a)[4], u64 db) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %25, 0;\nwgmma.mma_async.sync.aligned.m64n40k16.f32.bf16.bf16 "
               "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
               "%16,%17,%18,%19}, "
               "{%20,%21,%22,%23}, %24, p, 1, 1, 0;\n}\n"
               : WG_F4(0), WG_F4(1), WG_F4(2), WG_F4(3), WG_F4(4)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
template <>
__device__ __forceinline__ void wgmma_ra<6>(float (&d)[6][4], const u32 (&a)[4], u64 db) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %29, 0;\nwgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 "
               "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
               "%16,%17,%18,%19,%20,%21,%22,%23}, "
               "{%24,%25,%26,%27}, %28, p, 1, 1, 0;\n}\n"
               : WG_F4(0), WG_F4(1), WG_F4(2), WG_F4(3), WG_F4(4), WG_F4(5)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
template <>
__device__ __forceinline__ void wgmma_ra<7>(float (&d)[7][4], const u32 (&a)[4], u64 db) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %33, 0;\nwgmma.mma_async.sync.aligned.m64n56k16.f32.bf16.bf16 "
               "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
               "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27}, "
               "{%28,%29,%30,%31}, %32, p, 1, 1, 0;\n}\n"
               : WG_F4(0), WG_F4(1), WG_F4(2), WG_F4(3), WG_F4(4), WG_F4(5), WG_F4(6)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
template <>
__device__ __forceinline__ void wgmma_ra<8>(float (&d)[8][4], const u32 (&a)[4], u64 db) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
               "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
               "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
               "{%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
               : WG_F4(0), WG_F4(1), WG_F4(2), WG_F4(3), WG_F4(4), WG_F4(5), WG_F4(6), WG_F4(7)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// The warp's MT weight tiles of chunk c (rows row + 64m, 16 of them, 128 B each) into its part of a stage.
template <int MT>
__device__ __forceinline__ void wg_issue_weights(u32 wst, const signed char* q, int N, int K, int row, int c) {
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    const int r = row + 64 * m;
    issue_rows<4, false>(wst + m * 2048, 0, reinterpret_cast<const u16*>(q + (i64)min(r, N) * K), K / 2, N - r,
                         K / 2, c);
  }
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// acc[m] += the chunk's 8 k-steps: weights of the warp's MT tiles at `wst`, token rows at `xst` (two halves), two
// k-steps a wgmma group.
// ldmatrix.x4 as w8_chunk_mma: r = {row g, row g + 8} x {k-step s, s + 1}. k-step ks reads B at 32·(ks & 3) bytes
// into half ks >> 2 (8-row groups 1024 B apart).
template <int NT, int MT>
__device__ __forceinline__ void wg_chunk_mma(float (&acc)[MT][NT][4], u32 wst, u32 xst) {
  const int lane = threadIdx.x, lr = (lane & 7) + 8 * ((lane >> 3) & 1), lp = lane >> 4, sw = lane & 7;
#pragma unroll
  for (int m = 0; m < MT; ++m) fence_regs<NT>(acc[m]);
#pragma unroll
  for (int s = 0; s < 8; s += 2) {
    u32 r[MT][4], a[2][MT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      ldsm4(r[m], wst + (16 * m + lr) * 128 + (((s + lp) ^ sw) << 4));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        i8x4_to_bf16(r[m][2 * h], a[h][m][0], a[h][m][2]);
        i8x4_to_bf16(r[m][2 * h + 1], a[h][m][1], a[h][m][3]);
      }
    }
    wgmma_fence();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int ks = s + h;
      const u64 db = sw128_desc(xst + (ks >> 2) * 8 * NT * 128 + (ks & 3) * 32, 16, 1024);
#pragma unroll
      for (int m = 0; m < MT; ++m) wgmma_ra<NT>(acc[m], a[h][m], db);
    }
    wgmma_commit();
    wgmma_wait<1>();
  }
  wgmma_wait<0>();
#pragma unroll
  for (int m = 0; m < MT; ++m) fence_regs<NT>(acc[m]);
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// Grid (ceil(N / 64·MT·G)·CS, ceil(M / 8·NT)) in clusters of CS along x; block (32, 4·G); dynamic smem
// ST·(G·MT·8192 + NT·2048) + 1024 B (1024-byte alignment of the swizzle atoms). Requirements as w8a16_gemm; bf16
// out. On other archs the body is empty: the launcher takes this form on compute capability 9.0 only.
template <int NT, int MT, int ST, int G>
__global__ void __launch_bounds__(256) w8a16_gemm_wg(const u16* __restrict__ x, int ldx,
                                                     const signed char* __restrict__ q,
                                                     const float* __restrict__ scale, const u16* add, u16* out, int M,
                                                     int N, int K, int CS, int ldo) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  const int warp = threadIdx.y, rank = (int)cluster_rank(), STAGE = G * MT * 8192 + NT * 2048;
  const int row_b = (blockIdx.x / CS) * G * 64 * MT;  // the block's first row; the warp's:
  const int row_w = row_b + 64 * MT * (warp >> 2) + 16 * (warp & 3);
  const i64 m0 = (i64)blockIdx.y * 8 * NT;
  x += m0 * ldx, out += m0 * ldo, add = add ? add + m0 * ldo : add, M = min(M - (int)m0, 8 * NT);
  const int chunks = (K + W8_CHUNK - 1) / W8_CHUNK, nch = rank < chunks ? (chunks - rank + CS - 1) / CS : 0;
  const u32 ring = smem_addr(smem), wofs = warp * MT * 2048, xofs = G * MT * 8192;
  float acc[MT][NT][4] = {};
#pragma unroll
  for (int s = 0; s < ST - 1; ++s)
    if (s < nch) wg_issue_weights<MT>(ring + s * STAGE + wofs, q, N, K, row_w, rank + s * CS);
  pdl_wait();
#pragma unroll
  for (int s = 0; s < ST - 1; ++s) {
    if (s < nch) w8_issue_x<NT, 128 * G>(ring + s * STAGE + xofs, x, ldx, M, K, rank + s * CS);
    cp_async_commit();
  }
  for (int i = 0; i < nch; ++i) {
    cp_async_wait<ST - 2>();
    fence_async_smem();  // this thread's token rows -> visible to the wgmmas (async proxy)
    __syncthreads();  // stage i is complete from every thread; every wgmma of stage i - 1 has completed
    if (i + ST - 1 < nch) {
      const u32 next = ring + ((i + ST - 1) % ST) * STAGE;
      const int c = rank + (i + ST - 1) * CS;
      wg_issue_weights<MT>(next + wofs, q, N, K, row_w, c);
      w8_issue_x<NT, 128 * G>(next + xofs, x, ldx, M, K, c);
    }
    cp_async_commit();
    const u32 st = ring + (i % ST) * STAGE;
    wg_chunk_mma<NT, MT>(acc, st + wofs, st + xofs);
  }
  cp_async_wait<0>();
  pdl_trigger();
  w8_finish_rows<NT, MT, true>(acc, smem, rank, CS, row_b, scale, add, out, M, N, ldo);
#endif
}
