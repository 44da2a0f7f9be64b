// DDTree construction on the device (drafter_service/tree.py): per (session, depth) row a log-softmax
// and the exact top-K tokens; then per session the best-first heap over rank paths.
// Limits (asserted by the launcher): K <= 64 (ranks are 6-bit digits), L <= 16 (two u64 of digits).

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(u16 v) { return bf2f(v); }
// Order-preserving u32 key of a float: a > b (as floats, no NaN) iff okey(a) > okey(b).
__device__ __forceinline__ u32 okey(float f) {
  const u32 u = __float_as_uint(f);
  return u ^ ((u >> 31) ? 0xFFFFFFFFu : 0x80000000u);
}

template <class Op>
__device__ float block_reduce(float v, Op op, float* red) {
  for (int d = 16; d > 0; d >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, d));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = red[0];
  for (int w = 1; w < (int)(blockDim.x >> 5); ++w) v = op(v, red[w]);
  return v;
}

// tau with count(key > tau) < want <= count(key >= tau) over the elements key_of accepts; 8 bits a
// pass. Leaves count(key == tau) in sh[3].
template <class KeyOf>
__device__ u32 radix_select(int V, int want, KeyOf key_of, int* hist, int* sh, int* above_out) {
  u32 prefix = 0, mask = 0;
  int above = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    for (int base = 0; base < V; base += blockDim.x) {  // block-uniform trip count: every lane matches
      const int i = base + threadIdx.x;
      u32 k;
      const bool in = i < V && key_of(i, k) && (k & mask) == prefix;
      const u32 bin = in ? (k >> shift) & 255 : 256u;
      const unsigned peers = __match_any_sync(0xffffffffu, bin);  // one atomic per distinct bin per warp
      if (in && (threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int b = 255, acc = above;
      for (; b > 0 && acc + hist[b] < want; --b) acc += hist[b];
      sh[0] = b, sh[1] = acc;
    }
    __syncthreads();
    prefix |= (u32)sh[0] << shift, mask |= 255u << shift, above = sh[1];
    if (shift == 0 && threadIdx.x == 0) sh[3] = hist[sh[0]];  // count(key == tau)
    __syncthreads();
  }
  *above_out = above;
  return prefix;
}

// Exact top-K by radix select on the logits (the fallback): the K winners into key[0..K), idx[0..K).
template <typename T>
__device__ void topk_radix(const T* row, int V, int K, int* hist, int* sh, u32* key, int* idx) {
  int above, ties_above;
  const u32 tau = radix_select(V, K, [&](int i, u32& k) { k = okey(to_f(row[i])); return true; }, hist, sh, &above);
  // More logits equal tau than places left: keep the K - above lowest token ids (select on ~id).
  u32 itau = 0;
  if (above + sh[3] > K)
    itau = radix_select(V, K - above, [&](int i, u32& k) { k = ~(u32)i; return okey(to_f(row[i])) == tau; },
                        hist, sh, &ties_above);
  if (threadIdx.x == 0) sh[2] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    const u32 k = okey(to_f(row[i]));
    if (k > tau || (k == tau && ~(u32)i >= itau)) {
      const int p = atomicAdd(&sh[2], 1);
      key[p] = k, idx[p] = i;
    }
  }
}

#define CAND 2048  // candidates kept in shared memory by the fast path

// One block (1024 threads) per row of logits [rows, V] -> ids [rows, K] int64 and log-probs [rows, K]
// fp32, best first; order = logit descending, then token id ascending (exact ties included).
// Fast path, two passes over the row: the K-th largest of the threads' own maxima bounds the K-th
// largest logit from below, so only logits >= that bound (usually ~K of them) are candidates; they
// are ranked in shared memory. More than CAND candidates (massive ties): exact radix select instead.
template <typename T>
__global__ void __launch_bounds__(1024) ddtree_topk(const T* __restrict__ logits, int V, int K, i64* ids, float* lps) {
  __shared__ int hist[256], sh[4], cidx[CAND];
  __shared__ u32 ckey[CAND], tmax[1024];
  __shared__ float red[32];
  const int tid = threadIdx.x;
  const T* row = logits + (i64)blockIdx.x * V;
  float m = NEG_INF, sum = 0.f;  // online log-sum-exp of this thread's elements
  for (int i = tid; i < V; i += blockDim.x) {
    const float x = to_f(row[i]);
    if (x > m) sum = sum * expf(m - x) + 1.f, m = x;
    else sum += expf(x - m);
  }
  tmax[tid] = tid < V ? okey(m) : 0u;
  const float mx = block_reduce(m, [](float a, float b) { return fmaxf(a, b); }, red);
  const float mine = m == NEG_INF ? 0.f : sum * expf(m - mx);
  const float total = block_reduce(mine, [](float a, float b) { return a + b; }, red);
  const float lse = mx + logf(total);
  int above;
  const u32 lb = radix_select(blockDim.x, K, [&](int i, u32& k) { k = tmax[i]; return k != 0u; }, hist, sh, &above);
  if (tid == 0) sh[2] = 0;
  __syncthreads();
  for (int i = tid; i < V; i += blockDim.x) {
    const u32 k = okey(to_f(row[i]));
    if (k >= lb) {
      const int p = atomicAdd(&sh[2], 1);
      if (p < CAND) ckey[p] = k, cidx[p] = i;
    }
  }
  __syncthreads();
  const int n = sh[2];
  if (n > CAND) {  // block-uniform
    topk_radix(row, V, K, hist, sh, ckey, cidx);
    __syncthreads();
  }
  const int cand = n > CAND ? K : n;
  for (int j = tid; j < cand; j += blockDim.x) {
    int rank = 0;
    for (int l = 0; l < cand; ++l) rank += ckey[l] > ckey[j] || (ckey[l] == ckey[j] && cidx[l] < cidx[j]);
    if (rank < K) {
      ids[(i64)blockIdx.x * K + rank] = cidx[j];
      lps[(i64)blockIdx.x * K + rank] = to_f(row[cidx[j]]) - lse;
    }
  }
}

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

// One block (thread 0 works) per session: ids/lps [S, L, K] -> tokens [S, budget] (-1 pad),
// parents/depths [S, budget] (parent 0 = root; -1 / 0 pad), count [S]. Scores are fp64 sums of the
// fp32 log-probs, as in tree.py. Dynamic smem: the heap, (2 * budget + 1) entries.
extern "C" __global__ void ddtree_tree(const i64* ids, const float* lps, int S, int L, int K, int budget,
                                       i64* tokens, int* parents, int* depths, int* count) {
  extern __shared__ Entry heap[];
  const int s = blockIdx.x;
  if (threadIdx.x != 0) return;
  int n = 0, made = 0;
  const i64* id = ids + (i64)s * L * K;
  const float* lp = lps + (i64)s * L * K;
  if (budget > 0 && L > 0 && K > 0) push(heap, n, Entry{-(double)lp[0], 0.0, 0ull, 0ull, 1, 0});
  while (n > 0 && made < budget) {
    const Entry e = pop(heap, n);
    const int rank = digit(e, e.depth - 1);
    tokens[(i64)s * budget + made] = id[(e.depth - 1) * K + rank];
    parents[(i64)s * budget + made] = e.parent;
    depths[(i64)s * budget + made] = e.depth;
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
  for (int i = made; i < budget; ++i) {
    const i64 o = (i64)s * budget + i;
    tokens[o] = -1, parents[o] = -1, depths[o] = 0;
  }
  count[s] = made;
}
