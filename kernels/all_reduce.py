"""One-shot all-reduce over CUDA IPC peer buffers (NVLink P2P) for the verifier ranks of one host.

    one_shot_all_reduce(t, peers) -> t       (in place, like torch.distributed.all_reduce)
    one_shot_all_reduce_ref(t, peers) -> t   the same sum through torch.distributed.all_gather

t: bf16 or fp32, contiguous, t.nbytes % 16 == 0 and <= peers.max_bytes (`fits`). The sum is taken in fp32 in
rank order 0..N-1 and rounded once, identically on every rank, so the ranks' replicated latent caches stay equal
bit for bit. NCCL's ring sums bf16 pairwise in bf16; this is the more exact of the two.

Why: a verify step runs 122 all-reduces (two per layer) of T·7168 bf16 (14 KB for one row, 229 KB for 16).
NCCL's ring without NVLink multicast pays 2·(N-1) dependent hops per call; here each rank pushes its piece
into every rank's buffer (posted NVLink writes), raises one flag per rank, waits for the N flags of its own
buffer and sums locally: one hop (reference/perf.md §2.4: TRT-LLM/SGLang-style one-shot, 6-8 us on 8 H100s).

Buffer of each rank (one cudaMalloc, mapped into every other rank by cudaIpcOpenMemHandle), bytes:

    data   [2][N][max_bytes]      data[p][src]: rank src's input of the calls with parity p (alternate calls
                                  use alternate halves, so a rank's next call never overwrites what a slower
                                  peer is still summing)
    flags  [N][BLOCKS] u32        flags[src][b]: the last call whose piece b rank src has pushed here

Each rank also keeps `epochs` [BLOCKS] u32 (local): calls made, per block. Every call launches all BLOCKS blocks
(the same on every rank), so block b's count is the call count everywhere; flags only grow (wrap-safe compare),
so they are never reset. Graph-safe: no host state changes per call. A peer that never arrives (a dead rank)
makes the waiting block trap after `timeout_ns`, which fails the process instead of hanging it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from kernels._compile import _check, cuda_source, get_kernels, launch

BLOCKS, THREADS, MAX_RANKS = 32, 256, 8
# Programmatic dependent launch: the kernel launches while the projection before it runs (its blocks wait in
# griddepcontrol.wait, not on the flags) and lets the norm after it launch at once. Without it each of the step's
# 122 all-reduces pays a launch gap before and after. Off until measured on 2+ GPUs (session 47: built, not run).
PDL = False
CODE = r"""
#define AR_BLOCKS 32
#define AR_MAX_RANKS 8
__device__ __forceinline__ void st_release_sys(u32* p, u32 v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 ld_acquire_sys(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// L2, not L1: peers wrote these bytes into this GPU's memory over NVLink
__device__ __forceinline__ uint4 ld_cg(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// 16 bytes as fp32 lanes: 8 bf16 or 4 fp32
template <typename T> struct vec16;
template <> struct vec16<u16> {
  static constexpr int N = 8;
  static __device__ __forceinline__ void add(float* a, uint4 v, bool first) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float lo = bf2f(w[i] & 0xffff), hi = bf2f(w[i] >> 16);
      a[2 * i] = first ? lo : a[2 * i] + lo;
      a[2 * i + 1] = first ? hi : a[2 * i + 1] + hi;
    }
  }
  static __device__ __forceinline__ uint4 pack(const float* a) {
    return make_uint4(pack_bf16x2(a[0], a[1]), pack_bf16x2(a[2], a[3]), pack_bf16x2(a[4], a[5]),
                      pack_bf16x2(a[6], a[7]));
  }
};
template <> struct vec16<float> {
  static constexpr int N = 4;
  static __device__ __forceinline__ void add(float* a, uint4 v, bool first) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = first ? __uint_as_float(w[i]) : a[i] + __uint_as_float(w[i]);
  }
  static __device__ __forceinline__ uint4 pack(const float* a) {
    return make_uint4(__float_as_uint(a[0]), __float_as_uint(a[1]), __float_as_uint(a[2]), __float_as_uint(a[3]));
  }
};

// Grid AR_BLOCKS (every call, every rank), 256 threads. t: nvec 16-byte pieces, in place. bases[q]: rank q's
// buffer as mapped here; its data halves are `slot` bytes per source, its flags at byte `flags_at`. pdl: launched
// with programmatic dependent launch (then the kernel after it may launch early too).
template <typename T>
__global__ void __launch_bounds__(256) one_shot_all_reduce(uint4* t, int nvec, const unsigned long long* bases,
                                                           int rank, int world, i64 slot, i64 flags_at,
                                                           u32* epochs, unsigned long long timeout_ns,
                                                           int pdl) {
  __shared__ unsigned long long base[AR_MAX_RANKS];
  __shared__ u32 epoch;
  const int b = blockIdx.x, tid = threadIdx.x;
  if (pdl) pdl_trigger();  // launched with PDL (all_reduce.PDL): the norm after it may launch now; it waits for us
  if (tid < world) base[tid] = bases[tid];  // fixed at open
  pdl_wait();  // t (the projection before us) and epochs (the previous call) are final after it
  if (tid == 0) epoch = epochs[b] + 1;
  __syncthreads();
  const u32 e = epoch;
  const i64 half = (i64)(e & 1) * world;  // data[e % 2]
  const int per = (nvec + AR_BLOCKS - 1) / AR_BLOCKS, v0 = b * per, v1 = min(nvec, v0 + per);
  for (int v = v0 + tid; v < v1; v += blockDim.x) {  // push this rank's piece into every buffer
    const uint4 x = t[v];
    for (int q = 0; q < world; ++q) reinterpret_cast<uint4*>(base[q] + (half + rank) * slot)[v] = x;
  }
  __syncthreads();
  if (tid < world) {  // the block's pushes are visible system-wide before its flag in rank tid's buffer
    __threadfence_system();
    st_release_sys(reinterpret_cast<u32*>(base[tid] + flags_at) + rank * AR_BLOCKS + b, e);
    const u32* f = reinterpret_cast<const u32*>(base[rank] + flags_at) + tid * AR_BLOCKS + b;
    const unsigned long long t0 = global_ns();
    while ((int)(ld_acquire_sys(f) - e) < 0)
      if (global_ns() - t0 > timeout_ns) __trap();  // a rank never came: fail, do not hang
  }
  __syncthreads();
  for (int v = v0 + tid; v < v1; v += blockDim.x) {  // every rank sums in rank order: equal bits everywhere
    float a[vec16<T>::N];
    for (int q = 0; q < world; ++q)
      vec16<T>::add(a, ld_cg(reinterpret_cast<const uint4*>(base[rank] + (half + q) * slot) + v), q == 0);
    t[v] = vec16<T>::pack(a);
  }
  if (tid == 0) epochs[b] = e;
}
"""
_KERNEL = {torch.bfloat16: "one_shot_all_reduce<u16>", torch.float32: "one_shot_all_reduce<float>"}
NAMES = tuple(_KERNEL.values())


@dataclass(frozen=True)
class PeerBuffers:
    """Every rank's all-reduce buffer, mapped on this rank (module docstring: layout). `open` makes one."""

    rank: int
    world: int
    max_bytes: int  # largest input, bytes (a data slot per source)
    bases: torch.Tensor  # int64 [world]: rank q's buffer address as mapped here
    epochs: torch.Tensor  # int32 [BLOCKS], this rank's calls per block
    timeout_ns: int

    @property
    def flags_at(self) -> int:
        return 2 * self.world * self.max_bytes

    @classmethod
    def open(cls, rank: int, world: int, device: torch.device, gather, max_bytes: int,
             timeout_s: float) -> PeerBuffers:
        """Allocate this rank's buffer, zero it, exchange IPC handles through `gather(obj) -> [obj of every
        rank]` (a collective: after it, every rank's flags are zero) and map the peers' buffers. Raises
        RuntimeError where the GPUs cannot map each other's memory (no peer access). The buffers live as long
        as the process (the verifier's ranks end by exit_process)."""
        from cuda.bindings import runtime as rt

        assert 1 < world <= MAX_RANKS and max_bytes % 16 == 0 and max_bytes > 0
        _rt(rt.cudaSetDevice(device.index))
        size = 2 * world * max_bytes + world * BLOCKS * 4
        try:
            ptr = _rt(rt.cudaMalloc(size))
            _rt(rt.cudaMemset(ptr, 0, size))
            _rt(rt.cudaDeviceSynchronize())
            blob = ctypes.string_at(_rt(rt.cudaIpcGetMemHandle(ptr)).getPtr(), 64)
        except RuntimeError:
            blob = None  # still joins the gather, so that no rank waits in it for this one
        raw = gather(blob)
        if any(b is None for b in raw):
            raise RuntimeError(f"ranks {[q for q, b in enumerate(raw) if b is None]} could not export a buffer")
        mapped = []
        for q, blob in enumerate(raw):
            if q == rank:
                mapped.append(int(ptr))
                continue
            h = rt.cudaIpcMemHandle_t()
            ctypes.memmove(h.getPtr(), blob, 64)
            mapped.append(int(_rt(rt.cudaIpcOpenMemHandle(h, rt.cudaIpcMemLazyEnablePeerAccess))))
        bases = torch.tensor(mapped, dtype=torch.int64, device=device)
        epochs = torch.zeros(BLOCKS, dtype=torch.int32, device=device)
        return cls(rank, world, max_bytes, bases, epochs, int(timeout_s * 1e9))

    def fits(self, t: torch.Tensor) -> bool:
        """Inputs the kernel takes (others: NCCL)."""
        return (t.is_cuda and t.dtype in _KERNEL and t.is_contiguous() and t.nbytes % 16 == 0
                and 0 < t.nbytes <= self.max_bytes)


def one_shot_all_reduce(t: torch.Tensor, peers: PeerBuffers) -> torch.Tensor:
    assert peers.fits(t) and t.device == peers.bases.device, (t.shape, t.dtype, t.device)
    kernel = get_kernels(cuda_source(CODE), NAMES)[_KERNEL[t.dtype]]
    launch(kernel, BLOCKS, THREADS, t, t.nbytes // 16, peers.bases, peers.rank, peers.world,
           np.int64(peers.max_bytes), np.int64(peers.flags_at), peers.epochs, np.uint64(peers.timeout_ns), int(PDL),
           pdl=PDL)
    return t


def one_shot_all_reduce_ref(t: torch.Tensor, peers: PeerBuffers) -> torch.Tensor:
    """The kernel's sum: every rank's t (torch.distributed.all_gather on the default group), fp32 in rank order,
    rounded once."""
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(peers.world)]
    dist.all_gather(parts, t.contiguous())
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return t.copy_(acc)


def _rt(result):
    """cuda.bindings.runtime's (error, value...) -> value; raises on an error (`_compile._check`)."""
    err, *value = result if isinstance(result, tuple) else (result,)
    _check(err)
    return value[0] if len(value) == 1 else None
