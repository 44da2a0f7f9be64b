"""`ddtree bench verify --preset k26 --layers L`: one full-dimension verify step of one verifier rank.

Random K2.6 weights (L layers, this rank's experts and heads of an `--ep-size`-way split, and its share of
the shared / dense MLPs and lm_head unless `--no-split-replicated`, as the verifier serves), a committed
prefix of `--prefix` tokens in the paged latent cache, and a random tree of T rows verified in one
forward, for T in `--tree-sizes`: CUDA-kernel path eager and replayed from the verifier's CUDA graphs (a
GraphRunner sized for `--max-batch` sessions, the plan padded as a served step's is), next to the
torch reference path, and the bandwidth floor (bytes the step must read ÷ measured copy bandwidth).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import math
import os
import random

import torch

from kernels import overrides
from kernels.bench import copy_bandwidth
from kernels.cli import add_set_argument
from verifier_service.config import VerifierConfig
from verifier_service.budget import row_bucket
from verifier_service.graphs import GraphRunner
from verifier_service.kv_cache import PagedKVCache
from verifier_service import moe as moe_module, ranks, step_trace
from verifier_service.model import K2Model, identity
from verifier_service.expert_shard import ExpertShard, local_pairs
from verifier_service.plan import SeqRows, build_plan, plan_to, tree_parents
from verifier_service.ranks import split_range, split_rows
from verifier_service.synthetic import k26_config, random_target
from verifier_service.weights import Split

EXPERT_BYTES = 3 * (2048 * 7168 // 2 + 2048 * 7168 // 32 * 2)  # packed INT4 + bf16 scales, one K2.6 expert


def add_parser(bsub) -> None:
    p = bsub.add_parser("verify", help="time one full-dimension verify step (kernels vs torch reference)")
    p.add_argument("--preset", default="k26", choices=["k26"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ep-size", type=int, default=7, help="simulate rank 0 of this many verifier ranks")
    p.add_argument("--prefix", type=int, default=4096, help="committed tokens before the tree")
    p.add_argument("--max-context", type=int, default=VerifierConfig.max_context,
                   help="page-table width in tokens, as the served graphs size it (the verifier's --max-context)")
    p.add_argument("--max-batch", type=int, default=VerifierConfig.max_batch,
                   help="the graph column replays through the verifier's GraphRunner sized for this many sessions "
                        "(the verifier's --max-batch), padded as a served step is")
    p.add_argument("--sessions", type=int, default=1, help="live sessions in the step, each with its own prefix "
                                                                "and a tree of each --tree-sizes rows")
    p.add_argument("--tree-sizes", default="1,8,16,32,64")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-reference", action="store_true", help="skip the (slow) torch reference path")
    p.add_argument("--split-replicated", action=argparse.BooleanOptionalAction, default=True,
                   help="split the shared and dense MLPs and the lm_head over the ranks, as the verifier does by "
                        "default (--no-split-replicated: replicated on every rank)")
    p.add_argument("--expert-slices", type=int, default=VerifierConfig.expert_slices,
                   help="routed experts cut into this many slices dealt over the ranks (the verifier's flag)")
    p.add_argument("--routing", default="model", choices=("model", "uniform", "slowest"),
                   help="model: the synthetic router's choice; uniform: its cost, but uniform random top-k ids (this "
                        "rank then holds the mean rank's load); slowest: the same draws, each rotated so that this "
                        "rank holds the most loaded rank's experts, the load a served step waits for")
    p.add_argument("--route-pad-rows", action="store_true",
                   help="let a graph's pad rows (a tree size between row buckets) route to experts, as before session "
                        "44, instead of skipping them: what skipping saves")
    p.add_argument("--one-shot-all-reduce-kb", type=int, default=VerifierConfig.one_shot_all_reduce_kb,
                   help="under torchrun: all-reduces up to this many KiB by kernels/all_reduce (the verifier's "
                        "flag); 0 = NCCL for all")
    add_set_argument(p)
    p.add_argument("--out", help="also write the rows as JSON lines here")
    p.add_argument("--trace", metavar="DIR", help="also profile 5 graph replays of each tree size: Chrome traces "
                                                 "DIR/verify_rows<T>.json and a summary per step (step_trace.py)")
    p.set_defaults(func=main)


def time_ms(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def expert_bytes(cfg) -> int:
    """One routed expert's gate/up/down: packed INT4 words + bf16 scales per 32 inputs."""
    weights = cfg.moe_intermediate_size * cfg.hidden_size
    return 3 * (weights // 2 + weights // 32 * 2)


def floor_bytes(cfg, layers: int, experts: int, heads: int, rows: int, prefix: int,
                touched: float | None = None, split: int = 1) -> float:
    """Bytes one rank must read for a verify of `rows` rows: weights touched + its KV prefix (bf16).
    `touched`: routed experts the rank reads per MoE layer (default: the mean of its `experts` under
    uniform routing; the slowest of N ranks reads `expected_max_experts`). `split` > 1: the shared and
    dense MLPs and the lm_head are split over that many ranks (--split-replicated; rank 0's share)."""
    def share(n: int) -> int:
        return len(split_rows(n, 0, split))

    H = cfg.hidden_size
    attn = 2 * (cfg.q_lora_rank * H + heads * cfg.qk_head_dim * cfg.q_lora_rank + cfg.kv_cache_width * H
                + heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank + H * heads * cfg.v_head_dim)
    if touched is None:
        touched = experts * (1 - (1 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** rows)
    shared = 2 * 3 * H * share(cfg.moe_intermediate_size * cfg.n_shared_experts)
    moe = touched * expert_bytes(cfg) + shared + 2 * cfg.n_routed_experts * H  # bf16 router
    dense = 2 * 3 * H * share(cfg.intermediate_size)
    kv = (prefix + rows) * cfg.kv_cache_width * 2
    head = 2 * share(cfg.vocab_size) * H
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(layers))
    return layers * (attn + kv) + moe_layers * moe + (layers - moe_layers) * dense + head


def expert_owners(n: int, world: int, device=None) -> torch.Tensor:
    """int64 [n]: the rank holding each routed expert (contiguous ranges, split_range)."""
    return torch.tensor([r for r in range(world) for _ in split_range(n, r, world)], device=device)


def expected_max_experts(cfg, world: int, rows: int, trials: int = 2000, seed: int = 0) -> float:
    """E[max over the ranks of the experts one MoE layer reads] when each of `rows` tokens routes to
    top-k distinct experts uniformly at random (reference/perf.md §3.2, Monte Carlo): the rank with the
    most touched experts sets the step time under expert parallelism."""
    n, k, chunk = cfg.n_routed_experts, cfg.num_experts_per_tok, 250
    owner = expert_owners(n, world)
    g = torch.Generator().manual_seed(seed)
    total = 0.0
    for _ in range(0, trials, chunk):
        picks = torch.rand(chunk, rows, n, generator=g).topk(k, dim=-1).indices.flatten(1)  # [chunk, rows·k]
        touched = torch.zeros(chunk, n, dtype=torch.bool).scatter_(1, picks, True)
        total += float(torch.zeros(chunk, world).index_add_(1, owner, touched.float()).max(-1).values.sum())
    return total / (chunk * math.ceil(trials / chunk))


def floor_bytes_world(cfg, world: int, rows: int, prefix: int, split: bool = False) -> float:
    """Bytes the slowest of `world` verifier ranks reads for one verify over all cfg's layers: rank 0's
    heads (the most) and the expected maximum of touched experts; the replicated parts read on every rank,
    or (`split`) rank 0's share of them."""
    heads = len(split_range(cfg.num_attention_heads, 0, world))
    experts = len(split_range(cfg.n_routed_experts, 0, world))
    return floor_bytes(cfg, cfg.num_hidden_layers, experts, heads, rows, prefix,
                       touched=expected_max_experts(cfg, world, rows), split=world if split else 1)


def tree_plan(cache: PagedKVCache, rows: int, vocab: int, rng: random.Random, max_context: int = 0,
              sessions: int = 1):
    """A random tree of `rows` rows over each of `sessions` sessions' committed keys (s0, s1, …); the page
    tables padded (0) to max_context's pages + 1, the width the verifier's graphs give them (runner: max_pages)."""
    t, seqs = cache.table, []
    for sid in (f"s{i}" for i in range(sessions)):
        parents = [rng.randrange(i) if i > 1 else 0 for i in range(1, rows)]  # node i under [0, i)
        tokens = [rng.randrange(vocab) for _ in range(rows)]
        pages = t.pages(sid)
        pages = pages + [0] * (math.ceil(max_context / cache.page_size) + 1 - len(pages))
        seqs.append(SeqRows(tokens, tree_parents(parents), t.length(sid), pages, t.scratch(sid, rows)))
    return build_plan(seqs, device="cuda")


def time_step(model: K2Model, plan, host_plan, kv: torch.Tensor, graphs: GraphRunner, iters: int):
    """-> (eager ms, CUDA-graph ms) of one forward; the graph one as the verifier serves it: the host plan
    padded into the GraphRunner's graph for its shape (one host->device copy), replayed, output rows taken."""
    eager = time_ms(lambda: model.forward(plan, kv), iters)
    return eager, time_ms(lambda: graphs.forward(host_plan, ()), iters)


def to_slowest_rank(ids: torch.Tensor, n: int, world: int, slices: int = 1) -> torch.Tensor:
    """Expert ids [rows, k] rotated (mod n, a bijection) so that rank 0 carries the load a served step waits for.
    Whole experts: rank 0's contiguous range then holds the experts of the rank with the most distinct touched
    experts (one expert more at most, when that rank's range is shorter than rank 0's). `slices` S > 1 (slice
    e·S + s on rank (e·S + s) % world, ExpertShard): the first rotation that gives rank 0 as many touched slices
    as the most loaded rank holds in the draw (rotations do not permute the ranks' slice sets, 384·S % 7 != 0)."""
    if slices == 1:
        owner = expert_owners(n, world, ids.device)[ids.unique()]
        slowest = int(torch.bincount(owner, minlength=world).argmax())
        return (ids - split_range(n, slowest, world).start) % n
    ar = torch.arange(slices, device=ids.device)
    touched = ids.unique()
    most = int(torch.bincount(((touched[:, None] * slices + ar) % world).flatten(), minlength=world).max())
    shifted = (touched + torch.arange(n, device=ids.device)[:, None]) % n  # [rotation, touched]
    rank0 = ((shifted[..., None] * slices + ar) % world == 0).sum((1, 2))  # rank 0's slices under each rotation
    return (ids + int((rank0 - most).abs().argmin())) % n  # the first exact one (one always came in the tests)


@contextlib.contextmanager
def uniform_routing(cfg, rows: int, seed: int = 0, slowest_of: int = 0, slices: int = 1, route_pads: bool = False):
    """`--routing uniform`: each MoE layer's router still runs (its cost stays in the step), but the layer
    takes its top-k ids from a fixed uniform draw per layer and row, made here outside any graph: the
    routing the uniform floor assumes. The synthetic weights route a tree's rows almost alike.
    A graph pads the rows to its bucket with copies of one dummy row: with `route_pads` (`--route-pad-rows`) these
    route alike, to one more draw of their own, as pad rows did before session 44; else to no expert (-1), as the
    model's router gives them. The eager forward takes the first `rows` rows of the same draw.
    `slowest_of` = N ranks (`--routing slowest`): each draw `to_slowest_rank` (experts cut into `slices`)."""
    E, k, pads = cfg.n_routed_experts, cfg.num_experts_per_tok, row_bucket(rows) - rows
    g, g_pad = (torch.Generator(device="cuda").manual_seed(s) for s in (seed, seed + 1))
    draws = []  # per MoE layer: ids [bucket, k]
    for i in range(cfg.num_hidden_layers):
        if not cfg.is_moe_layer(i):
            continue
        real = torch.rand(rows, E, generator=g, device="cuda").topk(k).indices
        pad = torch.rand(1, E, generator=g_pad, device="cuda").topk(k).indices.expand(pads, k)
        ids = torch.cat([real, pad]) if route_pads else real
        if slowest_of > 1:
            ids = to_slowest_rank(ids, E, slowest_of, slices)
        draws.append(ids if route_pads else torch.cat([ids, ids.new_full((pads, k), -1)]))
    calls, real_route = itertools.count(), moe_module.route

    def route(x, w, cfg_, use_kernel=False, live_rows=None):
        _, weights = real_route(x, w, cfg_, use_kernel, live_rows)
        return draws[next(calls) % len(draws)][: x.shape[0]], weights

    moe_module.route = route  # moe_forward looks route up at each call
    try:
        yield
    finally:
        moe_module.route = real_route


def touched_experts(model: K2Model, plan, kv: torch.Tensor) -> float:
    """Mean over MoE layers of this rank's distinct experts the plan's rows route to (one eager forward with
    the model's routing hook; expert slices count 1/S each): the floor's expert bytes as routed, next to the
    uniform-routing estimate."""
    counts: list[float] = []

    def observe(layer: int, ids: torch.Tensor) -> None:
        stack = model.weights.layers[layer].mlp.experts
        local, _ = local_pairs(ids, torch.zeros(ids.shape, device=ids.device), stack)
        counts.append(int(local[local >= 0].unique().numel()) / stack.slices)

    model.on_experts = observe
    try:
        model.forward(plan, kv)
    finally:
        model.on_experts = None
    return sum(counts) / max(len(counts), 1)


def setup_ranks(ep_size: int, one_shot_kb: int):
    """Under torchrun (RANK set): NCCL ranks, each holding its own slice -> (rank, world, all_reduce, what carries
    the sums), the all-reduces up to `one_shot_kb` KiB by kernels/all_reduce as the verifier runs them. Otherwise
    one GPU simulating rank 0 of `ep_size` without collectives."""
    info = ranks.RankInfo.from_env()
    if info is None:
        return 0, ep_size, identity, "no collectives"
    device = torch.device("cuda", info.local_rank)
    control = ranks.Control(info, device, VerifierConfig.collective_timeout_s)
    peers = ranks.open_peers(control, device, one_shot_kb, VerifierConfig.collective_timeout_s)
    carrier = f"one-shot all-reduces up to {one_shot_kb} KiB, NCCL above" if peers else "NCCL"
    return info.rank, info.world_size, functools.partial(ranks.all_reduce, peers=peers), carrier


def trace_step(graphs: GraphRunner, host_plan, path: str, say) -> None:
    """Chrome trace of 5 replays of the graph time_step captured (its routing included) at `path` (every rank
    replays: the collectives need it), and a summary per step."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for line in step_trace.describe(step_trace.trace_replays(lambda: graphs.forward(host_plan, ()), path)):
        say(line)


def main(args) -> int:
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    applied = overrides.apply(args.set)
    cfg = k26_config(args.layers)
    rank, world, reduce, collectives = setup_ranks(args.ep_size, args.one_shot_all_reduce_kb)
    experts = (split_range(cfg.n_routed_experts, rank, world) if args.expert_slices == 1
               else ExpertShard(rank, world, args.expert_slices))
    heads = split_range(cfg.num_attention_heads, rank, world)
    split = Split(rank, world) if args.split_replicated else None
    weights = random_target(cfg, experts=experts, heads=heads, split=split)  # same seed: ranks agree
    gather = identity
    if split is not None and reduce is not identity:  # vocab-parallel logits, as the served verifier gathers them
        gather = ranks.all_gather_columns([len(split_rows(cfg.vocab_size, r, world)) for r in range(world)])
    fast = K2Model(cfg, weights, use_kernels=True, all_reduce=reduce, all_gather=gather)
    fast.skip_pad_rows = not args.route_pad_rows
    ref = K2Model(cfg, weights, use_kernels=False, all_reduce=reduce, all_gather=gather)
    say = print if rank == 0 else (lambda *a, **k: None)
    cache = PagedKVCache(num_layers=cfg.num_hidden_layers, width=cfg.kv_cache_width, page_size=64,
                         num_pages=args.sessions * (math.ceil(args.prefix / 64) + 4) + 1, dtype=torch.bfloat16,
                         device="cuda")
    for i in range(args.sessions):
        cache.table.open(f"s{i}")
        cache.table.extend(f"s{i}", args.prefix)
    cache.kv.normal_()
    bw = copy_bandwidth()
    held = len(experts) if isinstance(experts, range) else len(experts.pieces(cfg.n_routed_experts)) / experts.slices
    layout = "shared/dense/lm_head split" if split else "shared/dense/lm_head replicated"
    say(f"# {torch.cuda.get_device_name()}, K2.6 dims, {args.layers} layers, rank 0 of {world} ({collectives}): "
        f"{held:g} experts' worth, {len(heads)} heads, {layout}, {args.sessions} session(s) of prefix {args.prefix}, "
        f"{args.routing} routing; copy {bw / 1e9:.0f} GB/s" + "".join(f"; --set {a}" for a in applied))
    say(f"{'rows':>5} {'eager ms':>9} {'graph ms':>9} {'ref ms':>9} {'ref/graph':>9} {'floor ms':>9} "
        f"{'graph/floor':>11} {'experts':>7} {'floor@routed':>12} {'graph/floor@routed':>18}")
    rng, out_rows = random.Random(0), []
    graphs = GraphRunner(fast, cache, max_seqs=args.max_batch, max_pages=math.ceil(args.max_context / 64) + 1)
    for rows in [int(x) for x in args.tree_sizes.split(",")]:
        plan = tree_plan(cache, rows, cfg.vocab_size, rng, args.max_context, args.sessions)
        host_plan = plan_to(plan, "cpu")
        drawn = (uniform_routing(cfg, rows * args.sessions, slowest_of=world if args.routing == "slowest" else 0,
                                 slices=args.expert_slices, route_pads=args.route_pad_rows)
                 if args.routing != "model" else contextlib.nullcontext())
        with drawn:  # the trace too: the graphs replay the draws
            eager, replay = time_step(fast, plan, host_plan, cache.kv, graphs, args.iters)
            reference = float("nan") if args.no_reference else time_ms(lambda: ref.forward(plan, cache.kv), 3)
            touched = touched_experts(fast, plan, cache.kv)
            shape = (cfg, args.layers, held, len(heads), rows * args.sessions, args.prefix * args.sessions)
            shards = world if split else 1
            floor = 1e3 * floor_bytes(*shape, split=shards) / bw
            routed = 1e3 * floor_bytes(*shape, touched=touched, split=shards) / bw
            out_rows.append(dict(rows=rows, sessions=args.sessions, eager_ms=eager, graph_ms=replay, ref_ms=reference,
                                 floor_ms=floor, touched_experts=touched, floor_routed_ms=routed, routing=args.routing,
                                 pad_rows_routed=args.route_pad_rows, layers=args.layers, ranks=world,
                                 collectives=collectives, split_replicated=split is not None, prefix=args.prefix,
                                 overrides=applied, gpu=torch.cuda.get_device_name()))
            say(f"{rows:>5} {eager:>9.3f} {replay:>9.3f} {reference:>9.3f} {reference / replay:>9.1f} "
                f"{floor:>9.3f} {replay / floor:>11.2f} {touched:>7.1f} {routed:>12.3f} {replay / routed:>18.2f}")
            if args.trace:
                suffix = "" if reduce is identity else f"_rank{rank}"
                trace_step(graphs, host_plan, os.path.join(args.trace, f"verify_rows{rows}{suffix}.json"), say)
        if args.routing != "model":
            graphs.drop_all()  # its graphs read this size's draws, freed now: the next size captures its own
    if args.out and rank == 0:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in out_rows)
    return 0


if __name__ == "__main__":  # without the `ddtree` entry point (e.g. on a machine without the gRPC stubs)
    import sys

    parser = argparse.ArgumentParser(prog="bench_verify")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["verify", *sys.argv[1:]])
    sys.exit(main(args))
