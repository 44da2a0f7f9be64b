"""`ddtree bench kernels --preset k26`: every kernel against its torch reference at K2.6 sizes.

Also home of the random-input builders the GPU tests share (K2.6-shaped experts, paged MLA batches).
Times are medians of CUDA-graph replays timed with events (host launch cost excluded); bytes are the
fewest each kernel must move (packed weights + scales of the experts it touches, keys once, inputs
and outputs); the copy ceiling is a 2 GiB device-to-device copy measured in the same run. Each row also
gives its rate as a fraction of a plain stream that moves the same bytes (`same_size_stream`): small launches
cannot reach the 2 GiB copy's rate, whatever they do, and that column shows how far a pure stream of their size
gets.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
import time
from dataclasses import dataclass

import torch

K26 = dict(H=7168, I=2048, E=384, E_LOCAL=55, TOPK=8, HEADS=64, HEADS_RANK=10, LAYERS=61, PAGE=64)


@dataclass(frozen=True)
class Int4:  # what moe_w4a16 reads of verifier_service.int4.Int4Weight
    packed: torch.Tensor  # int32 [E, out, in/8]
    scale: torch.Tensor  # bf16 [E, out, in/32]
    tiled: bool = True  # random draws: read as the tiled order moe_w4a16 takes


@dataclass(frozen=True)
class Experts:  # what moe_w4a16 reads of verifier_service.moe.ExpertStack
    gate_proj: Int4
    up_proj: Int4
    down_proj: Int4
    first: int
    slices: int = 1
    rank: int = 0
    world: int = 1

    @property
    def count(self) -> int:
        return self.gate_proj.packed.shape[0]


def random_experts(E: int, H: int, I: int, first: int = 0, device="cuda", seed: int = 0, slices: int = 1,
                   rank: int = 0, world: int = 1) -> Experts:
    """Uniform random nibbles (q = -8 included), scales in [0.004, 0.02): outputs of order 1. slices > 1: E slices
    of I rows each, placed as verifier_service.expert_shard.ExpertShard(rank, world, slices) places them."""
    g = torch.Generator(device).manual_seed(seed)

    def mat(out: int, inp: int) -> Int4:
        packed = torch.randint(-2**31, 2**31, (E, out, inp // 8), generator=g, device=device, dtype=torch.int64)
        scale = torch.rand(E, out, inp // 32, generator=g, device=device) * 0.016 + 0.004
        return Int4(packed.to(torch.int32), scale.to(torch.bfloat16))

    return Experts(mat(I, H), mat(I, H), mat(H, I), first, slices, rank, world)


def spread_routing(T: int, k: int, active: int, E: int, device="cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs spread round-robin over local experts 0..active-1 (slot s of token t -> (t*k+s) % active);
    with active < k the extra slots route to other ranks' experts (ids >= E)."""
    t, s = torch.meshgrid(torch.arange(T, device=device), torch.arange(k, device=device), indexing="ij")
    ids = (t * k + s) % active if active >= k else torch.where(s < active, s, E + s)
    return ids.contiguous(), torch.rand(T, k, device=device).contiguous()


def mla_case(rows: list[int], prefixes: list[int], heads: int, page_size: int, device="cuda", seed: int = 0,
             capacity: int = 0):
    """A paged batch in BatchPlan layout: random trees, shuffled pages, NaN in every unwritten slot,
    a huge page id in unused page-table entries; `capacity`: the page table's width in keys at least (the served
    graphs size it by max_context). -> the positional arguments of mla_tree_attention."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(p / page_size) for p in prefixes] + [math.ceil(r / page_size) for r in rows]
    num_pages = sum(need) + 3
    perm = torch.randperm(num_pages, generator=g).tolist()
    kv = torch.full((num_pages, page_size, 576), float("nan"), dtype=torch.bfloat16)
    flat = kv.view(-1, 576)
    width = max([math.ceil(p / page_size) for p in prefixes] + [1, capacity // page_size])
    table = torch.full((len(rows), width), 1 << 30, dtype=torch.int64)
    masks, slots = [], []
    for b, (n, prefix) in enumerate(zip(rows, prefixes)):
        pages, scratch = perm[: need[b]], perm[need[b]: need[b] + need[len(rows) + b]]
        del perm[: need[b] + need[len(rows) + b]]
        table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int64)
        pos = torch.arange(prefix)
        prefix_slots = table[b, pos // page_size] * page_size + pos % page_size
        flat[prefix_slots] = torch.randn(prefix, 576, generator=g).bfloat16()
        row_slots = [scratch[r // page_size] * page_size + r % page_size for r in range(n)]
        flat[row_slots] = torch.randn(n, 576, generator=g).bfloat16()
        slots += row_slots
        for i in range(n):  # row i hangs under a random earlier row: ancestors + itself visible
            parent = int(torch.randint(0, i, (1,), generator=g)) if i else -1
            masks.append((list(masks[len(masks) - i + parent]) if i else [False] * max(rows)))
            masks[-1][i] = True
    T = sum(rows)
    q = torch.randn(T, heads, 576, generator=g).bfloat16()
    row_starts = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int64)
    args = (q, kv, table, torch.tensor(prefixes, dtype=torch.int64), row_starts,
            torch.tensor(masks, dtype=torch.bool).view(T, max(rows)), torch.tensor(slots, dtype=torch.int64))
    return tuple(a.to(device) for a in args)



def gpu_time(calls: list, reps: int = 20, graph: bool = True) -> float:
    """Median seconds per call. The calls (e.g. the same kernel on rotating inputs, so that nothing is
    served from L2) are captured back to back in one CUDA graph and its replays timed with events:
    one ~10 us graph-launch gap is then spread over all of them."""
    def run_all():
        for c in calls:
            c()

    run_all()
    torch.cuda.synchronize()
    run = run_all
    if graph:
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                run_all()
            run = g.replay
        except Exception as e:  # timing still works without the graph, launch gaps included
            print(f"# graph capture failed ({e!r}); timing plain calls")
            torch.cuda.synchronize()
        run()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times) / len(calls)


def kernel_breakdown(fn) -> str:
    """Per-kernel device time of one call, from the torch profiler: 'name us, ...'."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    return ", ".join(f"{e.name.split('(')[0][:24]} {e.device_time:.1f}" for e in events)


def copy_bandwidth(device: str = "cuda") -> float:
    """Bytes read + written per second of a large copy on `device`: 2 GiB device-to-device on CUDA (median
    of 10), 256 MiB on the CPU (best of 5). The floors of every bench divide by this."""
    if not device.startswith("cuda"):
        a = torch.empty(256 << 20, dtype=torch.uint8)
        b = torch.empty_like(a)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            b.copy_(a)
            best = min(best, time.perf_counter() - t0)
        return 2 * a.numel() / best
    with torch.cuda.device(device):
        a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda").random_()
        b = torch.empty_like(a)
        t = gpu_time([lambda: b.copy_(a)], reps=10, graph=False)
    return 2 * a.numel() / t


def copies_past_l2(nbytes: int) -> int:
    """How many copies of an `nbytes` working set rotating calls need (>= 2, >= 256 MB in all) so that none is
    read from the 60 MB L2 left by the calls before it: weights come from HBM, as in a 61-layer step."""
    return max(2, -(-(256 << 20) // nbytes))


@functools.cache
def same_size_stream(nbytes: int) -> float:
    """Seconds of an elementwise kernel that moves `nbytes` (torch.neg over fp32: reads half, writes half), timed
    as the kernels are: a CUDA graph of back-to-back launches over rotating buffers (copies_past_l2, at most 32
    pairs: below 8 MB moved they total less than 256 MB and some may come from L2, which can only flatter the
    stream). Not `copy_`: captured in a graph it becomes a memcpy node, which peaks at ~66 % of the 2 GiB
    copy's rate on the H200 where this kernel reaches 100 % (docs/BENCHMARKS.md, "same-size stream")."""
    half = max(16, -(-nbytes // 32) * 16)  # bytes read (= bytes written), a multiple of 16
    pairs = min(32, copies_past_l2(2 * half))
    bufs = [(torch.randn(half // 4, device="cuda"), torch.empty(half // 4, device="cuda")) for _ in range(pairs)]
    return gpu_time([lambda a=a, b=b: torch.neg(a, out=b) for a, b in bufs])


def result_row(kernel: str, case: str, t: float, nbytes: float, copy_bw: float, t_ref: float | None,
               flops: float = 0.0) -> dict:
    """One table row. copy_frac: bytes / time against the 2 GiB copy's rate; same_size_frac: against a plain
    stream of the same bytes (same_size_stream), i.e. its time over this time."""
    return dict(kernel=kernel, case=case, us=t * 1e6, MB=nbytes / 1e6, GBs=nbytes / t / 1e9,
                copy_frac=nbytes / t / copy_bw, same_size_frac=same_size_stream(int(nbytes)) / t,
                TFLOPs=flops / t / 1e12, ref_us=None if t_ref is None else t_ref * 1e6)


def bench_moe(copy_bw: float) -> list[dict]:
    from kernels import moe_w4a16 as moe
    from kernels.moe_w4a16 import moe_w4a16_ref

    H, I, E, k = K26["H"], K26["I"], K26["E_LOCAL"], K26["TOPK"]
    experts = random_experts(E, H, I)
    mats = (experts.gate_proj, experts.up_proj, experts.down_proj)
    per_expert = sum(w.packed.nbytes + w.scale.nbytes for w in mats) / E  # bytes one expert streams
    rows = []
    for active, n in ((1, 1), (3, 1), (8, 1), (8, 4), (8, 16), (16, 2), (55, 1), (55, 4), (55, 8), (55, 16),
                      (55, 596)):  # the last: prefill, T = 4098
        T = n if active < k else math.ceil(active * n / k)
        ids, w = spread_routing(T, k, active, E)
        x = torch.randn(T, H, device="cuda").bfloat16()
        used = int(ids[ids < E].unique().numel())
        # rotate the experts between calls so a small working set is never re-read from L2
        shifted = [torch.where(ids < E, (ids + r * active) % E, ids) for r in range(max(1, min(6, E // active)))]
        t_ref = gpu_time([lambda: moe_w4a16_ref(x, ids, w, experts)], reps=3, graph=False)
        t = gpu_time([lambda i=i: moe.moe_w4a16(x, i, w, experts) for i in shifted])
        t2 = gpu_time([lambda i=i: moe.moe_w4a16(x, i, w, experts) for i in shifted])  # run-to-run spread
        row = result_row("moe_w4a16", f"T={T} experts={used} tok/exp={T * k // max(used, 1) if active >= k else n}",
                         t, used * per_expert + 2 * x.nbytes, copy_bw, t_ref)
        row["spread_us"] = abs(t - t2) * 1e6
        if active in (1, 3, 8) or n == 16:
            row["breakdown_us"] = kernel_breakdown(lambda: moe.moe_w4a16(x, ids, w, experts))
        rows.append(row)
        for split in ((1, 2, 4) if active <= 8 and n <= 4 else ()):  # forced gate/up K split (auto above)
            moe.SPLIT = split
            try:
                t = gpu_time([lambda i=i: moe.moe_w4a16(x, i, w, experts) for i in shifted])
            finally:  # the rows after it (and the PDL row) run the automatic split
                moe.SPLIT = None
            rows.append(result_row("moe_w4a16", f"T={T} experts={used} split={split}", t,
                                   used * per_expert + 2 * x.nbytes, copy_bw, t_ref))
        if n == 1:  # the same with programmatic dependent launch flipped (on by default: moe.PDL)
            default, moe.PDL = moe.PDL, not moe.PDL
            try:
                t = gpu_time([lambda i=i: moe.moe_w4a16(x, i, w, experts) for i in shifted])
            finally:
                moe.PDL = default
            rows.append(result_row("moe_w4a16", f"T={T} experts={used} {'PDL' if not default else 'no PDL'}", t,
                                   used * per_expert + 2 * x.nbytes, copy_bw, t_ref))
    return rows


MLA_CASES = ((10, 1, 4096), (10, 16, 4096), (10, 64, 4096), (10, 16, 32768), (10, 64, 32768),
             (64, 1, 4096), (64, 16, 4096), (64, 64, 8192), (10, 1, 65536), (10, 16, 65536), (10, 64, 16384))
# (heads, sessions, rows, prefix): several sessions in one call, as the verifier batches a verify step; each session
# has `rows` rows and its own `prefix` keys, which the kernel reads once per session
MLA_BATCH_CASES = ((10, 8, 1, 4096), (10, 8, 16, 4096), (10, 4, 1, 16384), (10, 8, 1, 16384), (10, 4, 16, 16384))
BF16_FLOPS = 790e12  # dense bf16 matrix rate measured on the H200 (docs/BENCHMARKS.md)


def bench_mla(copy_bw: float, configs: tuple = (None,)) -> list[dict]:
    """Each case (MLA_CASES: one sequence; MLA_BATCH_CASES: several) at the launcher's own config (None) and at
    any forced (query rows, key stages) in `configs`. Bytes: every session's keys once + q and out; FLOPs: QK^T
    and PV of every (row, head) over its session's keys. roof_frac = max(bytes / copy bandwidth, FLOPs /
    BF16_FLOPS) / time. Batched cases also get a per-kernel breakdown (attention, split merge)."""
    from kernels import mla_tree_attention as mla

    rows, scale = [], 0.14467963
    for heads, sessions, n, prefix in [(h, 1, n, p) for h, n, p in MLA_CASES] + list(MLA_BATCH_CASES):
        copies = [mla_case([n] * sessions, [prefix] * sessions, heads, K26["PAGE"], seed=i)
                  for i in range(4)]  # rotate: defeat L2
        keys = prefix + n  # per session
        flops = sessions * 2 * n * heads * keys * (576 + 512)
        nbytes = sessions * (keys * 1152 + n * heads * (576 + 512) * 2)
        t_ref = gpu_time([lambda: mla.mla_tree_attention_ref(*copies[0], scale)], reps=3, graph=False)
        shape = f"h={heads} rows={n}" if sessions == 1 else f"h={heads} sessions={sessions} rows={n}"
        for config in configs:
            mla.CONFIG = config
            t = gpu_time([lambda c=c: mla.mla_tree_attention(*c, scale) for c in copies])
            tag = "auto" if config is None else config if isinstance(config, str) else "mt={} st={}".format(*config)
            row = result_row("mla_tree_attention", f"{shape} prefix={prefix} {tag}", t, nbytes, copy_bw, t_ref, flops)
            row["roof_frac"] = max(nbytes / copy_bw, flops / BF16_FLOPS) / t
            if sessions > 1:
                row["breakdown_us"] = kernel_breakdown(lambda: mla.mla_tree_attention(*copies[0], scale))
            rows.append(row)
        mla.CONFIG = None
    return rows


def bench_norms(copy_bw: float) -> list[dict]:
    """rms_norm (hidden and latent widths), add_rms_norm (against torch's add + the kernel) and rms_norm_pair
    (MLA's two latent norms in one launch, against the two launches it replaces)."""
    from kernels.rms_norm import (add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_pair, rms_norm_pair_ref,
                                  rms_norm_ref)

    rows = []
    for T, D in ((1, K26["H"]), (33, K26["H"]), (33, 1536), (33, 512), (4096, K26["H"])):  # hidden, q/kv latents
        xs = [torch.randn(T, D, device="cuda").bfloat16() for _ in range(8)]
        w = torch.randn(D, device="cuda").bfloat16()
        t = gpu_time([lambda x=x: rms_norm(x, w, 1e-6) for x in xs])
        t_ref = gpu_time([lambda x=x: rms_norm_ref(x, w, 1e-6) for x in xs])  # graphed too: ~6 launches
        rows.append(result_row("rms_norm", f"rows={T} width={D}", t, 2 * T * D * 2 + D * 2, copy_bw, t_ref))
    for T in (1, 17, 65):  # a decoder layer's residual add + norm: one launch, against torch's add + the kernel
        D = K26["H"]
        xs = [(torch.randn(T, D, device="cuda").bfloat16(), torch.randn(T, D, device="cuda").bfloat16())
              for _ in range(8)]
        w = torch.randn(D, device="cuda").bfloat16()
        t = gpu_time([lambda x=x, d=d: add_rms_norm(x, d, w, 1e-6) for x, d in xs])
        t_two = gpu_time([lambda x=x, d=d: rms_norm(x + d, w, 1e-6) for x, d in xs])
        t_ref = gpu_time([lambda x=x, d=d: add_rms_norm_ref(x, d, w, 1e-6) for x, d in xs])
        nbytes = 4 * T * D * 2 + D * 2  # x, delta in; h, out
        rows.append(result_row("add_rms_norm", f"rows={T} width={D}", t, nbytes, copy_bw, t_ref))
        rows.append(result_row("add_rms_norm", f"rows={T} torch add + rms_norm kernel", t_two, nbytes, copy_bw, t_ref))
    q, kv = 1536, 512  # K2.6's latent widths, column blocks of the fused [T, 2112] q/kv latent projection
    w1, w2 = (torch.randn(d, device="cuda").bfloat16() for d in (q, kv))
    for T in (1, 16, 64):
        xs = [torch.randn(T, 2112, device="cuda").bfloat16() for _ in range(8)]
        t = gpu_time([lambda x=x: rms_norm_pair(x[:, :q], w1, x[:, q:q + kv], w2, 1e-6) for x in xs])
        t_two = gpu_time([lambda x=x: (rms_norm(x[:, :q], w1, 1e-6), rms_norm(x[:, q:q + kv], w2, 1e-6)) for x in xs])
        t_ref = gpu_time([lambda x=x: rms_norm_pair_ref(x[:, :q], w1, x[:, q:q + kv], w2, 1e-6) for x in xs])
        nbytes = 2 * T * (q + kv) * 2 + (q + kv) * 2
        rows.append(result_row("rms_norm_pair", f"rows={T} widths={q}+{kv}", t, nbytes, copy_bw, t_ref))
        rows.append(result_row("rms_norm_pair", f"rows={T} two rms_norm launches", t_two, nbytes, copy_bw, t_ref))
    return rows


def bench_small(copy_bw: float) -> list[dict]:
    from kernels.kv_commit import kv_commit, kv_commit_ref
    from kernels.tree_accept import tree_accept, tree_accept_ref

    rows = []
    kv = torch.randn(K26["LAYERS"], 512, K26["PAGE"], 576, device="cuda").bfloat16()
    for n in (1, 8, 64):
        src = [torch.arange(n, device="cuda") + (100 + 2 * r) * K26["PAGE"] for r in range(20)]
        dst = [torch.arange(n, device="cuda") + (300 + 2 * r) * K26["PAGE"] for r in range(20)]
        nbytes = 2 * K26["LAYERS"] * n * 576 * 2
        t = gpu_time([lambda s=s, d=d: kv_commit(kv, s, d) for s, d in zip(src, dst)])
        t_ref = gpu_time([lambda: kv_commit_ref(kv, src[0], dst[0])], graph=False)
        rows.append(result_row("kv_commit", f"rows={n} layers={K26['LAYERS']}", t, nbytes, copy_bw, t_ref))
    for S, N in ((1, 16), (8, 64)):
        parents = torch.stack([torch.arange(N) // 2 for _ in range(S)]).cuda()  # binary-ish tree
        tokens = torch.randint(0, 4, (S, N), device="cuda")
        target = torch.randint(0, 4, (S, N + 1), device="cuda")
        t = gpu_time([lambda: tree_accept(tokens, parents, target)] * 20)
        t_ref = gpu_time([lambda: tree_accept_ref(tokens, parents, target)], reps=3, graph=False)
        rows.append(result_row("tree_accept", f"sessions={S} nodes={N}", t, tokens.nbytes * 3, copy_bw, t_ref))
    rows += bench_norms(copy_bw)
    from kernels.moe_gate import moe_gate, moe_gate_ref

    gate = torch.randn(K26["E"], K26["H"], device="cuda") * K26["H"] ** -0.5  # fp32, as K2.6 keeps it
    bias = torch.randn(K26["E"], device="cuda") * 0.1
    for T in (1, 16, 64):
        xs = [torch.randn(T, K26["H"], device="cuda").bfloat16() for _ in range(8)]
        t = gpu_time([lambda x=x: moe_gate(x, gate, bias, 8, 2.827) for x in xs])
        t_ref = gpu_time([lambda x=x: moe_gate_ref(x, gate, bias, 8, 2.827) for x in xs])
        rows.append(result_row("moe_gate", f"rows={T} experts={K26['E']}", t, gate.nbytes + T * K26["H"] * 2, copy_bw,
                               t_ref))
    from kernels.silu_mul import silu_mul, silu_mul_ref

    for T, I in ((1, 2048), (16, 2048), (16, 18432), (64, 2048)):  # shared expert, dense layer 0
        xs = [torch.randn(T, 2 * I, device="cuda").bfloat16() for _ in range(8)]
        t = gpu_time([lambda x=x: silu_mul(x) for x in xs])
        t_ref = gpu_time([lambda x=x: silu_mul_ref(x) for x in xs])  # two strided launches
        rows.append(result_row("silu_mul", f"rows={T} inter={I}", t, 3 * T * I * 2, copy_bw, t_ref))
    return rows


# (K, N): the tiny pair's fp32 target (q_a, q_b, kv_a, o_proj, lm_head, layer 0's gate and down). bf16 (K2.6)
# is kernels/skinny_gemm's (bench_linear_bf16).
LINEAR_CASES = ((384, 96), (96, 288), (384, 80), (192, 384), (384, 4352), (384, 1024), (1024, 384))


def bench_linear(copy_bw: float) -> list[dict]:
    """skinny_linear against F.linear (cuBLAS) at 1-64 fp32 rows; bytes = weight + x + y."""
    import torch.nn.functional as F

    from kernels.skinny_linear import skinny_linear

    rows = []
    for K, N in LINEAR_CASES:
        w = torch.randn(N, K, device="cuda") * K**-0.5
        for M in (1, 17, 33, 64):
            xs = [torch.randn(M, K, device="cuda") for _ in range(8)]
            t = gpu_time([lambda x=x: skinny_linear(x, w) for x in xs])
            t_ref = gpu_time([lambda x=x: F.linear(x, w) for x in xs])
            nbytes = (N * K + M * K + M * N) * 4
            rows.append(result_row("skinny_linear", f"fp32 rows={M} K={K} N={N}", t, nbytes, copy_bw, t_ref))
    return rows


# (N, K) of K2.6's dense bf16 projections on rank 0 of 7: qkv_a (replicated), q_b and o_proj (10 heads), the
# shared expert's gate/up and down (296 of 2048), layer 0's dense gate/up (2632 of 18432), lm_head (23408 rows).
GEMM_CASES = ((2112, 7168), (1920, 1536), (7168, 1280), (592, 7168), (7168, 296), (5264, 7168), (23408, 7168))


def bench_linear_bf16(copy_bw: float) -> list[dict]:
    """skinny_gemm against F.linear (cuBLAS) at 1-32 bf16 rows; bytes = weight + x + y. The calls rotate over
    enough weight copies (>= 256 MB) that every weight comes from HBM, as in a 61-layer step."""
    import torch.nn.functional as F

    from kernels._compile import device_limits
    from kernels.skinny_gemm import max_rows, pick_config, skinny_gemm

    rows, lim = [], device_limits(torch.cuda.current_device())
    for N, K in GEMM_CASES:
        ws = [torch.randn(N, K, device="cuda").bfloat16() for _ in range(copies_past_l2(2 * N * K))]
        for M in (m for m in (1, 8, 16, 24, 32) if m <= max_rows(N, lim.sms)):
            xs = [torch.randn(M, K, device="cuda").bfloat16() for _ in range(len(ws))]
            t = gpu_time([lambda x=x, w=w: skinny_gemm(x, w) for x, w in zip(xs, ws)])
            t_ref = gpu_time([lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, ws)])
            nbytes = (N * K + M * K + M * N) * 2
            case = f"bf16 rows={M} N={N} K={K} {pick_config(N, K, lim.sms, lim.smem_block)}"
            rows.append(result_row("skinny_gemm", case, t, nbytes, copy_bw, t_ref))
    return rows


def main(preset: str = "k26", out: str | None = None, only: str | None = None,
         settings: list[str] | None = None) -> int:
    from kernels import overrides

    assert preset == "k26" and torch.cuda.is_available(), "needs a CUDA GPU"
    applied = overrides.apply(settings)
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e9:.0f} GB/s (read + write)"
          + "".join(f"  --set {a}" for a in applied))
    rows = []
    from kernels.bench_drafter import bench_ddtree, bench_dflash, bench_linear_int8

    for bench in (bench_moe, bench_mla, bench_small, bench_linear, bench_linear_bf16, bench_linear_int8, bench_ddtree,
                  bench_dflash):
        if only is None or only in bench.__name__:  # --only moe / mla / small / linear / int8 / ddtree / dflash
            rows += bench(bw)
    # %copy: of the 2 GiB copy's rate; %same: of a plain stream that moves the same bytes (same_size_stream)
    print(f"{'kernel':<20} {'case':<44} {'us':>9} {'MB':>9} {'GB/s':>7} {'%copy':>6} {'%same':>6} {'TFLOP/s':>8} "
          f"{'ref us':>10} {'x ref':>6}")
    for r in rows:
        ref = r["ref_us"]
        print(f"{r['kernel']:<20} {r['case']:<44} {r['us']:>9.1f} {r['MB']:>9.2f} {r['GBs']:>7.0f} "
              f"{100 * r['copy_frac']:>5.0f}% {100 * r['same_size_frac']:>5.0f}% {r['TFLOPs']:>8.1f} {ref:>10.1f} "
              f"{ref / r['us']:>6.1f}"
              + (f" {100 * r['roof_frac']:>4.0f}% roof" if "roof_frac" in r else ""))
    for r in rows:
        if "breakdown_us" in r:
            print(f"# {r['kernel']} {r['case']}: {r['breakdown_us']}")
    if out:
        with open(out, "w") as f:
            f.writelines(json.dumps(dict(r, copy_GBs=bw / 1e9, gpu=torch.cuda.get_device_name(), overrides=applied))
                         + "\n" for r in rows)
    return 0
