// DDTree construction on the device (drafter_service/tree.py) in one launch, grid (C chunks, S*L rows):
//  1. block (c, row) reads chunk c of one logits row once (CHUNK = 256 threads x 4 x 16 B) and writes
//     the chunk's max / sum-exp and its exact top-K keys (a per-thread candidate filter, no sort);
//  2. the row's last block to finish merges the C chunk results: log-sum-exp and top-K of the row;
//  3. the session's last row to finish builds the best-first tree in one warp.
// Keys: u64 = order-preserving u32 of the logit above, ~token id below, so that key order is "logit
// descending, then token id ascending" (torch's stable sort) and every key is distinct; 0 = none.
// Limits (asserted by the launcher): K <= 64, L <= 16, the fused tree <= TREE_WARP_MAX nodes.

#define NT 256           // threads of a top-K block (8 warps); the selection code assumes it
#define KMAX 64
#define CAP 2048         // candidate keys in shared memory, >= KMAX x elements per thread (32)
#define MS 3             // frontier slots per lane: warp trees of up to 32 * MS - 1 nodes
#define TREE_WARP_MAX (32 * MS - 1)
#define FULL 0xffffffffu

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(u16 v) { return bf2f(v); }
__device__ __forceinline__ u32 bits_of(float v) { return __float_as_uint(v); }
__device__ __forceinline__ u32 bits_of(u16 v) { return v; }
// Order-preserving u32 of a float (no NaN); -0 and +0 share a key, as they compare equal in torch.
__device__ __forceinline__ u32 okey(float f) {
  u32 u = __float_as_uint(f);
  u = (u << 1) ? u : 0u;
  return u ^ ((u >> 31) ? 0xFFFFFFFFu : 0x80000000u);
}
__device__ __forceinline__ float okey_inv(u32 k) {
  return __uint_as_float(k ^ ((k >> 31) ? 0x80000000u : 0xFFFFFFFFu));
}
__device__ __forceinline__ u64 ckey(u32 kv, int id) { return ((u64)kv << 32) | (u32)~id; }
__device__ __forceinline__ u32 bmax2(u32 a, u32 b) {  // two bf16 maxima at once
  u32 d;
  asm("max.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// Order-preserving u64 of a double score; never 0 for a non-NaN score (0 = empty slot).
__device__ __forceinline__ u64 dkey(double d) {
  u64 u = (u64)__double_as_longlong(d);
  u = (u << 1) ? u : 0ull;
  return (u >> 63) ? ~u : u | (1ull << 63);
}

template <class Op>
__device__ float block_reduce(float v, Op op, float* red) {  // every thread gets the result; fixed order
  for (int d = 16; d > 0; d >>= 1) v = op(v, __shfl_xor_sync(FULL, v, d));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = red[0];
  for (int w = 1; w < (int)(blockDim.x >> 5); ++w) v = op(v, red[w]);
  return v;
}

struct Smem {
  u64 cand[CAP];           // candidate keys; the tree reuses this space (TreeSmem)
  u64 sorted[NT / 32][32]; // each warp's keys, descending
  u64 top[KMAX];           // selection result, best first, 0-padded
  u64 lb;
  float red[32];
  float wm[NT / 32], ws[NT / 32];  // per warp: max logit, sum exp(x - max)
  u32 wb[NT / 32];                 // per warp: the candidate bound's logit key
  int n, flag;
};

// Number of keys > x in a descending array of 32.
__device__ __forceinline__ int count_greater(const u64* a, u64 x) {
  int c = 0;
#pragma unroll
  for (int s = 32; s > 0; s >>= 1)
    if (c + s <= 32 && a[c + s - 1] > x) c += s;
  return c;
}

// The K-th largest of the block's NT keys (distinct where nonzero), or 1 if fewer than K are nonzero:
// a bound with count(key >= bound) >= K. Bitonic sort per warp, then each key's rank by binary search.
__device__ u64 kth_largest(u64 x, int K, Smem& sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const u64 mine = x;
  for (int k = 2; k <= 32; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      const u64 y = __shfl_xor_sync(FULL, x, j);
      const bool keep_max = ((lane & k) == 0) == ((lane & j) == 0);  // k = 32: descending
      x = keep_max ? (x > y ? x : y) : (x < y ? x : y);
    }
  if (threadIdx.x == 0) sm.lb = 1;
  sm.sorted[warp][lane] = x;
  __syncthreads();
  if (mine != 0) {
    int rank = 0;
    for (int w = 0; w < NT / 32; ++w) rank += count_greater(sm.sorted[w], mine);
    if (rank == K - 1) sm.lb = mine;
  }
  __syncthreads();
  return sm.lb;
}

// Exact top-K (K <= 64) of the n distinct nonzero keys buf[0..n), n <= CAP, into sm.top (best first,
// 0-padded). While n > NT: thread t takes buf[t + NT j]; the K-th largest of the threads' maxima is a
// lower bound of the K-th largest key held by at most K threads, so at most K * ceil(n / NT) keys pass
// (2048 -> 512 -> 128). Then each of the <= NT survivors counts the keys above it: its rank.
__device__ void select_topk(u64* buf, int n, int K, Smem& sm) {
  const int tid = threadIdx.x;
  while (n > NT) {
    u64 mine[CAP / NT], best = 0;
#pragma unroll
    for (int j = 0; j < CAP / NT; ++j) {
      mine[j] = tid + j * NT < n ? buf[tid + j * NT] : 0ull;
      best = mine[j] > best ? mine[j] : best;
    }
    const u64 lb = kth_largest(best, K, sm);  // barriers: every read of buf is done
    if (tid == 0) sm.n = 0;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < CAP / NT; ++j)
      if (mine[j] >= lb) buf[atomicAdd(&sm.n, 1)] = mine[j];  // lb >= 1: zeros never pass
    __syncthreads();
    n = sm.n;
  }
  for (int r = tid; r < K; r += NT) sm.top[r] = 0;
  __syncthreads();
  if (tid < n) {
    const u64 x = buf[tid];
    int rank = 0;
    for (int j = 0; j < n; ++j) rank += buf[j] > x;
    if (rank < K) sm.top[rank] = x;
  }
  __syncthreads();
}

template <typename T>
struct Load {  // one 16-byte group: VEC elements
  static constexpr int VEC = 16 / sizeof(T), EPT = 4 * VEC, CHUNK = NT * EPT;
  static __device__ __forceinline__ u32 word(const uint4& q, int i) {
    return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w;
  }
  static __device__ __forceinline__ float elem(const uint4& q, int j) {
    if (sizeof(T) == 4) return __uint_as_float(word(q, j));
    return bf2f((u16)(word(q, j >> 1) >> ((j & 1) * 16)));
  }
  // Elements i0..i0+VEC of a row (one 16-byte load when in range and aligned); past V: -inf. A
  // padding element is never stored as a candidate (i < V tests) and ranks below every real one.
  static __device__ __forceinline__ uint4 group(const T* row, int i0, int V, bool vec_ok) {
    if (vec_ok && i0 + VEC <= V) return __ldg(reinterpret_cast<const uint4*>(row + i0));
    u32 w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const u32 b = i0 + j < V ? bits_of(row[i0 + j]) : (sizeof(T) == 4 ? 0xFF800000u : 0xFF80u);
      if (sizeof(T) == 4) w[j] = b;
      else w[j >> 1] |= b << ((j & 1) * 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
  static __device__ __forceinline__ float gmax(const uint4& q) {  // largest of the group's VEC logits
    if (sizeof(T) == 4)
      return fmaxf(fmaxf(__uint_as_float(q.x), __uint_as_float(q.y)),
                   fmaxf(__uint_as_float(q.z), __uint_as_float(q.w)));
    const u32 t = bmax2(bmax2(q.x, q.y), bmax2(q.z, q.w));
    return fmaxf(bf2f((u16)t), bf2f((u16)(t >> 16)));
  }
};

// Exact fallback of chunk_topk (block-uniform, when the cheap bound let more than CAP keys through:
// heavy ties): the K-th largest of the threads' (max logit, lowest id) keys bounds the candidates by
// K threads x EPT <= CAP. Re-reads the thread's logits (cached; a rolled loop keeps the registers of
// the common path low), refills sm.cand and returns the count.
template <typename T>
__device__ int chunk_exact(const T* row, int base, int V, int K, Smem& sm) {
  typedef Load<T> LD;
  u64 best = 0;
#pragma unroll 1
  for (int e = 0; e < LD::EPT; ++e) {
    const int i = base + (e / LD::VEC) * NT * LD::VEC + e % LD::VEC;
    const u64 key = i < V ? ckey(okey(to_f(row[i])), i) : 0ull;
    best = key > best ? key : best;
  }
  const u64 lb = kth_largest(best, K, sm);  // barriers: everyone has read sm.n
  if (threadIdx.x == 0) sm.n = 0;
  __syncthreads();
#pragma unroll 1
  for (int e = 0; e < LD::EPT; ++e) {
    const int i = base + (e / LD::VEC) * NT * LD::VEC + e % LD::VEC;
    const u64 key = i < V ? ckey(okey(to_f(row[i])), i) : 0ull;
    if (key >= lb) sm.cand[atomicAdd(&sm.n, 1)] = key;  // lb >= 1: no padding
  }
  __syncthreads();
  return sm.n;
}

// Phase 1: chunk [c0, c0 + CHUNK) of a row -> its top-K keys (0-padded) and (max, sum exp(x - max)).
// Thread t holds 4 groups of VEC elements at c0 + (g * NT + t) * VEC (coalesced 16-byte loads, each
// logit read once, kept in registers). Bound: each warp's c-th largest thread max (c = ceil(K / 8),
// by __reduce_max rounds), the least of the 8: at least 8c >= K logits reach it, so the top-K do.
template <typename T>
__device__ void chunk_topk(const T* row, int V, int K, int c0, bool vec_ok, Smem& sm, u64* keys, float2* ms) {
  typedef Load<T> LD;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int base = c0 + tid * LD::VEC;  // element (g, j): base + g * NT * VEC + j
  uint4 q[4];
  float gm[4];
#pragma unroll
  for (int g = 0; g < 4; ++g) q[g] = LD::group(row, base + g * NT * LD::VEC, V, vec_ok), gm[g] = LD::gmax(q[g]);
  const u32 km = okey(fmaxf(fmaxf(gm[0], gm[1]), fmaxf(gm[2], gm[3])));
  const u32 wk = __reduce_max_sync(FULL, km);
  u32 cur = km, bw = wk;
  for (int removed = 0, c = (K + NT / 32 - 1) / (NT / 32); removed < c;) {  // c rounds at most
    bw = __reduce_max_sync(FULL, cur);
    removed += __popc(__ballot_sync(FULL, cur == bw));
    cur = cur == bw ? 0u : cur;
  }
  const float mw = okey_inv(wk);  // warp max; sums relative to it
  float s = 0.f;
  if (mw != NEG_INF) {
#pragma unroll
    for (int g = 0; g < 4; ++g)
#pragma unroll
      for (int j = 0; j < LD::VEC; ++j) s += __expf(LD::elem(q[g], j) - mw);
  }
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(FULL, s, o);
  if (lane == 0) sm.wm[warp] = mw, sm.ws[warp] = s, sm.wb[warp] = bw;
  if (tid == 0) sm.n = 0;
  __syncthreads();
  float M = sm.wm[0], S = 0.f;
  u32 lbk = sm.wb[0];
#pragma unroll
  for (int w = 1; w < NT / 32; ++w) M = fmaxf(M, sm.wm[w]), lbk = min(lbk, sm.wb[w]);
#pragma unroll
  for (int w = 0; w < NT / 32; ++w)
    if (sm.wm[w] != NEG_INF) S += sm.ws[w] * __expf(sm.wm[w] - M);
  const float lbv = okey_inv(lbk);
#pragma unroll
  for (int g = 0; g < 4; ++g)
    if (gm[g] >= lbv) {  // rare
#pragma unroll
      for (int j = 0; j < LD::VEC; ++j) {
        const float x = LD::elem(q[g], j);
        const int i = base + g * NT * LD::VEC + j;
        if (x >= lbv && i < V) {
          const int p = atomicAdd(&sm.n, 1);
          if (p < CAP) sm.cand[p] = ckey(okey(x), i);
        }
      }
    }
  __syncthreads();
  int n = sm.n;
  if (n > CAP) n = chunk_exact<T>(row, base, V, K, sm);
  select_topk(sm.cand, n, K, sm);
  for (int r = tid; r < K; r += NT) keys[r] = sm.top[r];
  if (tid == 0) *ms = make_float2(M, S);
}

// Phase 2 (the row's last block): log-sum-exp of the chunks (fixed order) and the top-K of their C
// lists, through shared memory in tiles of CAP - KMAX keys plus the running top-K. -> ids, log-probs.
__device__ void merge_row(const u64* keys, const float2* ms, int C, int K, Smem& sm, i64* ids, float* lps) {
  const int tid = threadIdx.x;
  float m = NEG_INF;
  for (int c = tid; c < C; c += NT) m = fmaxf(m, __ldcg(ms + c).x);
  const float M = block_reduce(m, [](float a, float b) { return fmaxf(a, b); }, sm.red);
  float s = 0.f;
  for (int c = tid; c < C; c += NT) {
    const float2 p = __ldcg(ms + c);
    if (p.x != NEG_INF) s += p.y * __expf(p.x - M);
  }
  const float log_sum = logf(block_reduce(s, [](float a, float b) { return a + b; }, sm.red));
  for (int t0 = 0; t0 < C * K; t0 += CAP - KMAX) {
    if (tid == 0) sm.n = 0;
    __syncthreads();
    if (t0 > 0)
      for (int r = tid; r < K; r += NT)
        if (sm.top[r]) sm.cand[atomicAdd(&sm.n, 1)] = sm.top[r];
    for (int i = t0 + tid; i < min(C * K, t0 + CAP - KMAX); i += NT) {
      const u64 x = __ldcg(keys + i);
      if (x) sm.cand[atomicAdd(&sm.n, 1)] = x;
    }
    __syncthreads();
    select_topk(sm.cand, sm.n, K, sm);
  }
  for (int r = tid; r < K; r += NT) {  // K <= V: K real keys
    const u64 x = sm.top[r];
    ids[r] = (i64)(u32)~(u32)x;
    lps[r] = (okey_inv((u32)(x >> 32)) - M) - log_sum;  // torch's log_softmax: (x - max) - log(sum)
  }
}

// True in every thread of the block that makes the count reach n (then the count is reset to 0, for
// the next launch). Writes before the call are visible to that block (fence, then count).
__device__ bool arrive_last(int* counter, int n, Smem& sm) {
  __syncthreads();
  if (threadIdx.x == 0) {  // the block's writes, ordered by the barrier, released by thread 0's fence
    __threadfence();
    const bool last = atomicAdd(counter, 1) == n - 1;
    if (last) *counter = 0;
    __threadfence();
    sm.flag = last;
  }
  __syncthreads();
  return sm.flag;
}

struct TreeSmem {
  float lp[16 * KMAX];            // the session's log-probs [L, K]
  int rank[TREE_WARP_MAX + 1];    // node n (1-based): its rank and depth (-> its token)
  int depth[TREE_WARP_MAX + 1];
};

// Rank path of a node with one more digit r at position p (0-based depth): 6-bit digits, most
// significant first, depths 1..8 in hi and 9..16 in lo (as the heap tree packs them).
__device__ __forceinline__ void add_digit(u64& hi, u64& lo, int p, int r) {
  if (p < 8) hi |= (u64)r << (6 * (7 - p));
  else lo |= (u64)r << (6 * (15 - p));
}

// Lanes of eq whose word is the largest among eq's.
__device__ __forceinline__ unsigned keep_max(unsigned eq, u32 word) {
  const bool in = (eq >> (threadIdx.x & 31)) & 1;
  const u32 top = __reduce_max_sync(FULL, in ? word : 0u);
  return __ballot_sync(FULL, in && word == top);
}

// Best-first tree in one warp, exactly tree.py's heap: the heap always holds, for the root and each
// popped node x above depth L, x's best not-yet-popped child (x, c_x): popping (x, c) pushes (x, c+1)
// and ((x, c), 0). Node x's "slot" (lane x % 32, register x / 32; root = 0) keeps c_x, x's score and
// rank path, and the score of (x, c_x). One step: warp arg-max over the lanes' best slots of the
// order (score desc, depth asc, rank path asc) -- __reduce_max on the 32-bit words of the key
// dkey(score), then only on exact score ties on those of ~(depth, path) -- and two slot updates.
// Scores are fp64 sums as in tree.py. Writes parents/depths and ts; returns the node count.
__device__ int tree_warp(TreeSmem& ts, int L, int K, int budget, int* parents, int* depths) {
  const int lane = threadIdx.x & 31;
  double own[MS], sc[MS];   // slot node's score; its candidate child's score
  u64 key[MS], ph[MS], pl[MS];  // dkey(sc) (0 = no candidate); slot node's rank path
  int dep[MS], cr[MS];      // slot node's depth (root 0); candidate child's rank
#pragma unroll
  for (int i = 0; i < MS; ++i) own[i] = sc[i] = 0.0, key[i] = ph[i] = pl[i] = 0, dep[i] = cr[i] = 0;
  if (lane == 0 && L > 0 && K > 0 && budget > 0) sc[0] = 0.0 + (double)ts.lp[0], key[0] = dkey(sc[0]);
  int bi = 0, made = 0;  // this lane's best slot; nodes made
  bool dirty = true;     // this lane's slots changed: pick its best again
  while (made < budget) {
    if (dirty) {  // largest key; equal scores: lower depth, then lower rank path
      bi = 0;
      u64 kb = key[0], hb = ph[0], lb = pl[0];
      int db = dep[0];
      add_digit(hb, lb, dep[0], cr[0]);
#pragma unroll
      for (int i = 1; i < MS; ++i) {
        u64 hi = ph[i], lo = pl[i];
        add_digit(hi, lo, dep[i], cr[i]);
        const bool take = key[i] > kb || (key[i] == kb && kb != 0 &&
                                          (dep[i] < db || (dep[i] == db && (hi < hb || (hi == hb && lo < lb)))));
        if (take) bi = i, kb = key[i], hb = hi, lb = lo, db = dep[i];
      }
    }
    u64 bk = key[0], bh = ph[0], bl = pl[0];
    double bs = sc[0];
    int bd = dep[0], bc = cr[0];
#pragma unroll
    for (int i = 1; i < MS; ++i)
      if (i == bi) bk = key[i], bh = ph[i], bl = pl[i], bs = sc[i], bd = dep[i], bc = cr[i];
    add_digit(bh, bl, bd, bc);  // the candidate's rank path
    const u32 top = __reduce_max_sync(FULL, (u32)(bk >> 32));
    if (top == 0) break;  // heap empty
    unsigned eq = __ballot_sync(FULL, (u32)(bk >> 32) == top);
    if (eq & (eq - 1)) eq = keep_max(eq, (u32)bk);
    if (eq & (eq - 1)) {  // exact score tie (equal logits): depth, then rank path
      const u64 t1 = ~(((u64)bd << 48) | bh), t2 = ~bl;
      eq = keep_max(eq, (u32)(t1 >> 32));
      if (eq & (eq - 1)) eq = keep_max(eq, (u32)t1);
      if (eq & (eq - 1)) eq = keep_max(eq, (u32)(t2 >> 32));
      if (eq & (eq - 1)) eq = keep_max(eq, (u32)t2);
    }
    const int w = __ffs(eq) - 1;
    const int p = __shfl_sync(FULL, (bi << 16) | (bc << 8) | bd, w);
    const double s = __shfl_sync(FULL, bs, w);
    const u64 nh = __shfl_sync(FULL, bh, w), nl = __shfl_sync(FULL, bl, w);  // the new node's path
    const int x = w + 32 * (p >> 16), c = (p >> 8) & 255, d = (p & 255) + 1;  // node made+1: (x, c), depth d
    ++made;
    if (lane == 0) ts.rank[made] = c, ts.depth[made] = d, parents[made - 1] = x, depths[made - 1] = d;
    const bool moved = lane == w, grew = lane == (made & 31) && d < L && made < 32 * MS;
    // slot masks, not index compares: those the compiler turns into an indexed local-memory array
    const unsigned mv = moved ? 1u << bi : 0u, gr = grew ? 1u << (made >> 5) : 0u;
#pragma unroll
    for (int i = 0; i < MS; ++i) {
      if ((mv >> i) & 1) {  // x's slot: its next child
        cr[i] = c + 1;
        sc[i] = own[i] + (double)ts.lp[(d - 1) * K + (c + 1 < K ? c + 1 : 0)];
        key[i] = c + 1 < K ? dkey(sc[i]) : 0ull;
      }
      if ((gr >> i) & 1) {  // the new node's slot: its best child
        own[i] = s, dep[i] = d, cr[i] = 0, ph[i] = nh, pl[i] = nl;
        sc[i] = s + (double)ts.lp[d * K];
        key[i] = dkey(sc[i]);
      }
    }
    dirty = moved || grew;
  }
  __syncwarp();  // ts.rank / ts.depth for the token gather
  return made;
}

// Tree of session s from ids/lps [L, K] (lps already in ts.lp) -> outputs, padded to budget.
__device__ void tree_session(TreeSmem& ts, const i64* ids, int L, int K, int budget, i64* tokens, int* parents,
                             int* depths, float* logprobs, int* count) {
  const int made = tree_warp(ts, L, K, budget, parents, depths);
  for (int n = threadIdx.x; n < budget; n += 32) {
    if (n < made) {
      const int at = (ts.depth[n + 1] - 1) * K + ts.rank[n + 1];
      tokens[n] = __ldcg(ids + at), logprobs[n] = ts.lp[at];
    } else {
      tokens[n] = -1, parents[n] = -1, depths[n] = 0, logprobs[n] = 0.f;
    }
  }
  if (threadIdx.x == 0) *count = made;
}

// logits [S * L, V] -> ids [S * L, K] int64 and log-probs fp32 (best first), via part_keys
// [S * L, C, K] and part_ms [S * L, C]; with budget >= 0 (<= TREE_WARP_MAX) also the trees:
// tokens [S, budget] int64, parents/depths [S, budget] int32, logprobs [S, budget] fp32 (each node's
// log-prob at its depth), count [S]. counters [S * L + S] are
// zero before the launch and after it. Grid (C, S * L), NT threads.
template <typename T>
__global__ void __launch_bounds__(NT, 4)  // 64 registers: 4 blocks of 256 per SM
    ddtree_fused(const T* __restrict__ logits, int V, int K, int C, int L, int vec_ok, u64* part_keys, float2* part_ms,
                 i64* ids, float* lps, int* counters, int budget, i64* tokens, int* parents, int* depths,
                 float* logprobs, int* count) {
  __shared__ Smem sm;
  const int c = blockIdx.x, row = blockIdx.y;
  const i64 part = (i64)row * C;
  chunk_topk<T>(logits + (i64)row * V, V, K, c * Load<T>::CHUNK, vec_ok != 0, sm, part_keys + (part + c) * K,
                part_ms + part + c);
  if (!arrive_last(counters + row, C, sm)) return;
  merge_row(part_keys + part * K, part_ms + part, C, K, sm, ids + (i64)row * K, lps + (i64)row * K);
  if (budget < 0) return;
  const int s = row / L;
  if (!arrive_last(counters + gridDim.y + s, L, sm)) return;
  TreeSmem& ts = *reinterpret_cast<TreeSmem*>(sm.cand);
  static_assert(sizeof(TreeSmem) <= sizeof(sm.cand), "tree smem");
  for (int i = threadIdx.x; i < L * K; i += NT) ts.lp[i] = __ldcg(lps + (i64)s * L * K + i);
  __syncthreads();
  if (threadIdx.x >= 32) return;
  tree_session(ts, ids + (i64)s * L * K, L, K, budget, tokens + (i64)s * budget, parents + (i64)s * budget,
               depths + (i64)s * budget, logprobs + (i64)s * budget, count + s);
}

// ---- The heap tree (one thread), for budgets above TREE_WARP_MAX ----

struct Entry {  // a candidate node: its score, depth and rank path (6-bit digits, most significant first)
  double neg, parent_score;
  unsigned long long hi, lo;
  int depth, parent;
};
__device__ bool before(const Entry& a, const Entry& b) {  // score desc, depth asc, rank path asc
  if (a.neg != b.neg) return a.neg < b.neg;
  if (a.depth != b.depth) return a.depth < b.depth;
  return a.hi != b.hi ? a.hi < b.hi : a.lo < b.lo;
}
__device__ int digit(const Entry& e, int d) { return (int)(((d < 8 ? e.hi : e.lo) >> (6 * (7 - d % 8))) & 63); }
__device__ void set_digit(Entry& e, int d, unsigned long long r) {
  unsigned long long& w = d < 8 ? e.hi : e.lo;
  const int s = 6 * (7 - d % 8);
  w = (w & ~(63ull << s)) | (r << s);
}
__device__ void push(Entry* heap, int& n, Entry e) {
  int i = n++;
  for (; i > 0 && before(e, heap[(i - 1) / 2]); i = (i - 1) / 2) heap[i] = heap[(i - 1) / 2];
  heap[i] = e;
}
__device__ Entry pop(Entry* heap, int& n) {
  const Entry top = heap[0], last = heap[--n];
  int i = 0;
  for (int c = 1; c < n; i = c, c = 2 * c + 1) {
    if (c + 1 < n && before(heap[c + 1], heap[c])) ++c;
    if (!before(heap[c], last)) break;
    heap[i] = heap[c];
  }
  heap[i] = last;
  return top;
}

__device__ void tree_heap(Entry* heap, const i64* id, const float* lp, int L, int K, int budget, i64* tokens,
                          int* parents, int* depths, float* logprobs, int* count) {
  int n = 0, made = 0;
  if (budget > 0 && L > 0 && K > 0) push(heap, n, Entry{-(double)lp[0], 0.0, 0ull, 0ull, 1, 0});
  while (n > 0 && made < budget) {
    const Entry e = pop(heap, n);
    const int rank = digit(e, e.depth - 1);
    tokens[made] = id[(e.depth - 1) * K + rank], parents[made] = e.parent, depths[made] = e.depth;
    logprobs[made] = lp[(e.depth - 1) * K + rank];
    ++made;
    if (rank + 1 < K) {  // next sibling: same parent, next rank at this depth
      Entry sib = e;
      set_digit(sib, e.depth - 1, rank + 1);
      sib.neg = -(e.parent_score + (double)lp[(e.depth - 1) * K + rank + 1]);
      push(heap, n, sib);
    }
    if (e.depth < L) {  // first child: best token one depth further
      Entry child = e;
      set_digit(child, e.depth, 0);
      child.depth = e.depth + 1, child.parent = made, child.parent_score = -e.neg;
      child.neg = -(-e.neg + (double)lp[e.depth * K]);
      push(heap, n, child);
    }
  }
  for (int i = made; i < budget; ++i) tokens[i] = -1, parents[i] = -1, depths[i] = 0, logprobs[i] = 0.f;
  *count = made;
}

// One warp per session: ids/lps [S, L, K] -> tokens [S, budget] (-1 pad), parents/depths [S, budget]
// (parent 0 = root; -1 / 0 pad), logprobs [S, budget] (0 pad), count [S]. budget <= TREE_WARP_MAX: the warp
// tree; above: thread 0 runs the heap in dynamic smem, (2 * budget + 1) entries.
extern "C" __global__ void ddtree_tree(const i64* ids, const float* lps, int S, int L, int K, int budget,
                                       i64* tokens, int* parents, int* depths, float* logprobs, int* count) {
  extern __shared__ Entry heap[];
  __shared__ TreeSmem ts;
  const int s = blockIdx.x;
  const i64* id = ids + (i64)s * L * K;
  const float* lp = lps + (i64)s * L * K;
  tokens += (i64)s * budget, parents += (i64)s * budget, depths += (i64)s * budget, logprobs += (i64)s * budget;
  if (budget > TREE_WARP_MAX) {
    if (threadIdx.x == 0) tree_heap(heap, id, lp, L, K, budget, tokens, parents, depths, logprobs, count + s);
    return;
  }
  for (int i = threadIdx.x; i < L * K; i += 32) ts.lp[i] = lp[i];
  __syncwarp();
  tree_session(ts, id, L, K, budget, tokens, parents, depths, logprobs, count + s);
}
