// Routed-expert SwiGLU over compressed-tensors pack-quantized INT4 weights (reference/k26.md §4).
// Four launches: moe_route (group pairs by local expert) -> moe_gemm<0> (gate/up + SiLU·up -> act)
// -> moe_gemm<1> (down -> y per pair) -> moe_combine (Σ_k w·y per token, bf16).
//
// GEMM tiling: a block owns 16 output rows of one expert (both gate and up rows in mode 0) and all
// of that expert's tokens; its NW warps split K. Each warp streams its K-slice of packed words and
// scales through a STAGES-deep cp.async ring, decodes nibbles to bf16 in registers and runs
// m16n8k16 tensor-core MMAs with the tokens as the N=8 side. Weight bytes are read once per pass.
//
// K permutation: thread (g, t) of a quad holds word t of a 32-input scale group (inputs 8t..8t+7);
// nibble pairs (i, i+4) become bf16x2 fragments, and the activations get the same permutation
// (byte_perm), so each MMA covers exactly one scale group: the group scale multiplies the MMA result
// in fp32 (q·x is exact in the MMA; no bf16 rounding of q·scale).

#define CG 4                 // scale groups (32 inputs each) per stage: 64 B of words per row
#define STAGES 4
#define ROWW (CG * 4 + 4)    // words per staged row; the 4-word pad makes word reads bank-conflict free

// Pairs p = t*k + s of the [T, k] routing; local expert e = topk_ids[p] - first, owned iff 0 <= e < E.
// offsets[E+1]: sorted rows of expert e are offsets[e]..offsets[e+1]-1; order[row] = pair index;
// active[0..*num_active) = experts with rows, ascending. Row order inside an expert is irrelevant:
// every token column of the GEMMs is computed independently. Dynamic smem: 2*E ints.
extern "C" __global__ void moe_route(const i64* topk_ids, int P, i64 first, int E, int* offsets,
                                     int* order, int* active, int* num_active) {
  extern __shared__ int cnt[];  // [E] counts, then [E] cursors
  int* cur = cnt + E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    i64 e = topk_ids[p] - first;
    if (e >= 0 && e < E) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int off = 0, na = 0;
    for (int e = 0; e < E; ++e) {
      offsets[e] = cur[e] = off;
      if (cnt[e]) active[na++] = e;
      off += cnt[e];
    }
    offsets[E] = off;
    *num_active = na;
  }
  __syncthreads();
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    i64 e = topk_ids[p] - first;
    if (e >= 0 && e < E) order[atomicAdd(&cur[e], 1)] = p;
  }
}

// 8 nibbles (LSB first, stored q+8) -> bf16x2 pairs (0,4) (1,5) (2,6) (3,7) holding q exactly:
// 0x4300|v is bf16(128+v); one bf16x2 fma subtracts 136.
__device__ __forceinline__ void dequant(u32 w, u32 (&p)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    u32 t = ((w >> (4 * i)) & 0x000F000Fu) | 0x43004300u;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(p[i]) : "r"(t), "r"(0x3F803F80u), "r"(0xC308C308u));
  }
}

template <int MT>
struct Stage {  // one warp's share of one pipeline stage
  u32 w[MT][16 * ROWW];  // packed words, 16 rows x CG groups x 4 words (+pad)
  u16 s[MT][16 * CG];    // bf16 scales, 16 rows x CG groups
};

// MODE 0: W0/S0 = gate, W1/S1 = up [E, N, K/8] / [E, N, K/32]; B = x [T, K]; out = act bf16 [P, N]
//         (row = sorted row), act = silu(gate·x) * (up·x).
// MODE 1: W0/S0 = down; B = act [P, K]; out = y fp32 [P, N] (row = pair index), unweighted.
// Grid (N/16, min(E, P)); block (32, NW), NW <= 8; dynamic smem NW*STAGES*sizeof(Stage<MT>).
// Requires K % (32*CG*NW) == 0, N % 16 == 0.
template <int MODE, int NT>
__global__ void __launch_bounds__(256, 2) moe_gemm(const u32* __restrict__ W0, const u16* __restrict__ S0,
                                                const u32* __restrict__ W1, const u16* __restrict__ S1,
                                                const u16* __restrict__ B, int K, int N, int k_route,
                                                const int* offsets, const int* order, const int* active,
                                                const int* num_active, void* out) {
  constexpr int MT = MODE == 0 ? 2 : 1;
  if ((int)blockIdx.y >= *num_active) return;
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x, warp = threadIdx.y, NW = blockDim.y;
  const int g = lane >> 2, t = lane & 3;
  Stage<MT>* ring = reinterpret_cast<Stage<MT>*>(smem) + warp * STAGES;
  const int e = active[blockIdx.y], off = offsets[e], n_e = offsets[e + 1] - off;
  const int row0 = blockIdx.x * 16, KW = K / 8, KG = K / 32;
  // Warp w takes chunks w, w + NW, ...: the block's warps read adjacent 64-byte pieces of each row at
  // about the same time, so DRAM sees 64*NW contiguous bytes per row rather than scattered 64s.
  const int nch = KG / CG / NW;
  const u32* Wm[MT];
  const u16* Sm[MT];
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    Wm[m] = (m ? W1 : W0) + ((i64)e * N + row0) * KW;
    Sm[m] = (m ? S1 : S0) + ((i64)e * N + row0) * KG;
  }
  auto issue = [&](int c) {
    Stage<MT>& st = ring[c % STAGES];
    const int G0 = (c * NW + warp) * CG;
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
      for (int i = lane; i < 16 * CG; i += 32)
        cp_async16(&st.w[m][(i / CG) * ROWW + (i % CG) * 4], Wm[m] + (i64)(i / CG) * KW + (G0 + i % CG) * 4);
      if (lane < 16) cp_async8(&st.s[m][lane * CG], Sm[m] + (i64)lane * KG + G0);
    }
  };

  for (int p0 = 0; p0 < n_e; p0 += 8 * NT) {
    const int ntv = min(NT, (n_e - p0 + 7) / 8);  // n-tiles with at least one real token (warp-uniform)
    const u16* brow[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      int j = min(p0 + 8 * n + g, n_e - 1);  // clamp: padded columns compute garbage that is never stored
      brow[n] = B + (i64)(MODE == 0 ? order[off + j] / k_route : off + j) * K + 8 * t;
    }
    float acc[MT][NT][4] = {};
    // Activations: 8 inputs per thread per group; xc[n][q] is refilled with chunk c+1 as soon as
    // chunk c has consumed it, so loads run one chunk ahead with a single buffer.
    uint4 xc[NT][CG];
    auto load_x = [&](int n, int q, int c) {
      xc[n][q] = *reinterpret_cast<const uint4*>(brow[n] + ((c * NW + warp) * CG + q) * 32);
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < nch) issue(s);
      cp_async_commit();
    }
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int q = 0; q < CG; ++q)
        if (n < ntv) load_x(n, q, 0);
    for (int c = 0; c < nch; ++c) {
      cp_async_wait<STAGES - 2>();
      __syncwarp();
      if (c + STAGES - 1 < nch) issue(c + STAGES - 1);
      cp_async_commit();
      const Stage<MT>& st = ring[c % STAGES];
#pragma unroll
      for (int q = 0; q < CG; ++q) {
        u32 b[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const uint4 r = xc[n][q];
          b[n][0] = __byte_perm(r.x, r.z, 0x5410);  // inputs (0,4)
          b[n][1] = __byte_perm(r.x, r.z, 0x7632);  // (1,5)
          b[n][2] = __byte_perm(r.y, r.w, 0x5410);  // (2,6)
          b[n][3] = __byte_perm(r.y, r.w, 0x7632);  // (3,7)
          if (n < ntv && c + 1 < nch) load_x(n, q, c + 1);
        }
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          u32 lo[4], hi[4];
          dequant(st.w[m][g * ROWW + q * 4 + t], lo);
          dequant(st.w[m][(g + 8) * ROWW + q * 4 + t], hi);
          const float slo = bf2f(st.s[m][g * CG + q]), shi = bf2f(st.s[m][(g + 8) * CG + q]);
#pragma unroll
          for (int n = 0; n < NT; ++n) {
            if (n >= ntv) continue;
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
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with its ring: reuse it for the cross-warp sum
    float4* red = reinterpret_cast<float4*>(smem);  // [NW][MT][NT][32]
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int n = 0; n < NT; ++n)
        red[((warp * MT + m) * NT + n) * 32 + lane] =
            make_float4(acc[m][n][0], acc[m][n][1], acc[m][n][2], acc[m][n][3]);
    __syncthreads();
    for (int n = warp; n < ntv; n += NW) {  // warp w finishes n-tiles w, w+NW, ...
      float v[MT][4] = {};
      for (int w = 0; w < NW; ++w)
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          float4 r = red[((w * MT + m) * NT + n) * 32 + lane];
          v[m][0] += r.x, v[m][1] += r.y, v[m][2] += r.z, v[m][3] += r.w;
        }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int j = p0 + 8 * n + 2 * t + (i & 1), row = row0 + g + 8 * (i >> 1);
        if (j >= n_e) continue;
        if (MODE == 0) {
          const float gate = v[0][i], act = gate / (1.f + __expf(-gate)) * v[MT - 1][i];
          reinterpret_cast<u16*>(out)[(i64)(off + j) * N + row] = f2bf(act);
        } else {
          reinterpret_cast<float*>(out)[(i64)order[off + j] * N + row] = v[0][i];
        }
      }
    }
    __syncthreads();  // the next pass refills the ring
  }
}

// out[t] = bf16(Σ_s owned(t,s) topk_w[t,s] · y[t*k+s]) in slot order; tokens with no local expert get 0.
// Grid (T, ceil(H / 1024)); block 128; 8 outputs per thread. Requires H % 8 == 0.
extern "C" __global__ void moe_combine(const float* __restrict__ y, const i64* __restrict__ topk_ids,
                                       const float* __restrict__ topk_w, i64 first, int E, int k, int H,
                                       u16* __restrict__ out) {
  const int tok = blockIdx.x, h = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
  if (h >= H) return;
  float acc[8] = {};
  for (int s = 0; s < k; ++s) {
    const i64 p = (i64)tok * k + s, e = topk_ids[p] - first;
    if (e < 0 || e >= E) continue;
    const float w = topk_w[p];
    const float4* src = reinterpret_cast<const float4*>(y + p * H + h);
    const float4 a = src[0], b = src[1];
    acc[0] += w * a.x, acc[1] += w * a.y, acc[2] += w * a.z, acc[3] += w * a.w;
    acc[4] += w * b.x, acc[5] += w * b.y, acc[6] += w * b.z, acc[7] += w * b.w;
  }
  uint4 r = make_uint4(pack_bf16x2(acc[0], acc[1]), pack_bf16x2(acc[2], acc[3]), pack_bf16x2(acc[4], acc[5]),
                       pack_bf16x2(acc[6], acc[7]));
  *reinterpret_cast<uint4*>(out + (i64)tok * H + h) = r;
}
