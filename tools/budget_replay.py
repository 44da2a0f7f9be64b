"""Tree-budget policies replayed on recorded drafts (`ddtree bench budget`).

Whether a tree-budget policy pays depends on two things no single run shows at once: how well the drafter's
trees hit the target's text, and what a verify row costs on the target's hardware. They separate exactly: the
target's output does not depend on the trees (lossless; sampled output too, given the seed), so a node is accepted iff
its path spells the target's next tokens. One run records, at every position of each prompt's continuation, the
drafter's full tree with each node's log-probability (`record`). Any policy is then replayed on those trees
against any step-cost table (`replay`): the positions it visits, the nodes it keeps, what they accept and what the
steps cost under the table. The K2.6 tables are the 61-layer rank-0 graph times of docs/BENCHMARKS.md.

    python -m tools.budget_replay --model models/kimi-tiny --prompts 8 --max-new 256
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Step costs, ms. verify: row bucket -> graph ms of one verify step (61 layers, rank 0 of 7, 4K prefix, one
# session; docs/BENCHMARKS.md "Session 22" model routing, "Session 21" uniform routing); wait: a K2.6 drafter's
# Propose (docs/BENCHMARKS.md "The drafter's Propose at full dimensions", 3.2 ms) plus its loopback round trip;
# fixed: the rest of a step's cycle (accept, commit, the engine loop).
COST_TABLES = {
    "k26-model": {"verify": {1: 4.752, 8: 5.871, 16: 7.011, 32: 9.081, 64: 12.694}, "wait": 3.4, "fixed": 0.3},
    "k26-uniform": {"verify": {1: 4.684, 8: 9.536, 16: 12.828, 32: 18.764, 64: 26.346}, "wait": 3.4,
                    "fixed": 0.3},
    # 4 full-dimension layers and their drafter on one GPU (tools/fullscale_run, session 26): a short wait
    "k26-4layers": {"verify": {1: 1.909, 16: 2.001}, "wait": 0.6, "fixed": 0.65},
}


@dataclass
class Position:
    """The drafter's full tree below one emitted token (the root). Node i is tokens[i - 1], best first."""
    tokens: np.ndarray  # [N] int64
    parents: np.ndarray  # [N] int32, parents[i - 1] in [0, i)
    logprobs: np.ndarray  # [N] float32: log q_d(token) of each node at its depth (not the path's sum)
    matched: np.ndarray  # [N] bool: the node's path spells the target's next tokens


@dataclass
class Trace:
    emitted: list[int]  # the target's tokens after the prompt (greedy, or sampled at `temperature`)
    positions: list[Position]  # positions[k]: the tree below emitted[k]
    temperature: float = 0.0


def matched_nodes(tokens, parents, following: list[int]) -> np.ndarray:
    """following = the target's tokens after the root. Node i matches iff its parent does and its token is
    following[depth(i) - 1]."""
    from verifier_service.acceptance import tree_depths

    parents = [int(p) for p in parents]
    depth = tree_depths(parents)
    ok = np.zeros(len(parents) + 1, dtype=bool)
    ok[0] = True
    for i in range(1, len(parents) + 1):
        ok[i] = ok[parents[i - 1]] and depth[i] <= len(following) and int(tokens[i - 1]) == following[depth[i] - 1]
    return ok[1:]


def record(pair, prompt: list[int], max_new: int, budget: int, temperature: float = 0.0, seed: int = 0) -> Trace:
    """Plain decoding of `prompt` one token a step, and at every step the drafter's `budget`-node tree below the
    newest token, its drafter cache fed the target's feature rows as the verifier feeds it. Sampled (temperature > 0)
    with the session's uniforms as the engine draws them: the node at depth d below emitted[k] meets the uniform of
    position k + d, so DDTree's sampled output is this same sequence, and a node is accepted iff its path spells it,
    as with greedy decoding."""
    import torch

    from drafter_service.engine import DraftMode, Proposal, ProposeItem
    from verifier_service.acceptance import SessionRng

    table, sid, rng = pair.cache.table, uuid.uuid4().hex, SessionRng(seed)
    table.open(sid)
    trees, emitted = [], []
    try:
        with torch.inference_mode():
            out = pair._prefill(sid, prompt, pair.layer_ids)
            feats, fed = out.hidden, 0
            while True:
                emitted.append(pair._pick(out.logits[:1], [0], rng, temperature)[0])
                rng.advance(1)
                if len(emitted) == max_new:
                    break
                res = pair.drafter.propose([ProposeItem(sid, fed, feats, emitted[-1], budget, DraftMode.DDTREE)])[0]
                if not isinstance(res, Proposal):
                    raise RuntimeError(f"drafter answered {res}")
                fed += len(feats)
                trees.append(res.tree)
                out = pair._verify(sid, emitted[-1], [], [], table.length(sid), pair.layer_ids)
                pair.cache.commit(sid, [0])
                feats = out.hidden[:1]
    finally:
        table.close(sid)
        pair.drafter.release(sid)
    positions = [Position(t.tokens, t.parents, t.logprobs, matched_nodes(t.tokens, t.parents, emitted[k + 1:]))
                 for k, t in enumerate(trees)]
    return Trace(emitted, positions, temperature)


class Fixed:
    """Every step drafts and verifies the first n nodes (n = 0: plain decoding, no draft)."""

    def __init__(self, n: int):
        self.n = n
        self.name = "AR" if n == 0 else f"fixed {n}"

    def drafts(self, sid: str) -> bool:
        return self.n > 0

    def keep(self, sid: str, pos: Position) -> np.ndarray:
        return np.arange(1, min(self.n, len(pos.tokens)) + 1)

    def record(self, sid: str, kept: np.ndarray, accepted: list[int], sampled: bool) -> None:
        pass


class Adaptive:
    """verifier_service.budget.AdaptiveBudget, called as the engine calls it, with its step costs set to the
    table's instead of measured."""

    def __init__(self, table: dict):
        from verifier_service.budget import AdaptiveBudget

        self.budget = AdaptiveBudget()
        set_costs(self.budget.costs, table)
        self.name = "adaptive"

    def drafts(self, sid: str) -> bool:
        return self.budget.draft_pays([sid])

    def keep(self, sid: str, pos: Position) -> np.ndarray:
        from verifier_service.drafter_client import Draft

        # the node numbers as tokens: the budget does not read tokens, and its cut tree then names the kept nodes
        n = len(pos.tokens)
        draft = Draft(list(range(1, n + 1)), pos.parents.tolist(), pos.logprobs.tolist())
        return np.array(self.budget.trim({sid: draft}, 1, 1)[sid].tokens, dtype=np.int64)

    def record(self, sid: str, kept: np.ndarray, accepted: list[int], sampled: bool) -> None:
        self.budget.plan_next([sid])  # during the forward, before the step's record
        renumbered = [int(np.searchsorted(kept, i)) + 1 for i in accepted]
        self.budget.record(sid, len(kept), [0, *renumbered], sampled=sampled)


def set_costs(costs, table: dict) -> None:
    """A StepCosts with the table's times (ms) instead of measured ones."""
    costs.verify = {rows: ms / 1e3 for rows, ms in table["verify"].items()}
    costs.fixed, costs.wait = table["fixed"] / 1e3, table["wait"] / 1e3


def replay(traces: list[Trace], policy, table: dict) -> dict:
    """Decode every trace under `policy`: each step keeps the policy's nodes of the tree below the newest token
    (or drafts nothing), accepts those that match, and costs the table's time for its rows."""
    from verifier_service.budget import StepCosts

    costs = StepCosts()
    set_costs(costs, table)
    tokens = steps = rows = skipped = 0
    seconds = 0.0
    for t, trace in enumerate(traces):
        sid, k = f"trace{t}", 0
        while k < len(trace.positions):
            pos = trace.positions[k]
            if policy.drafts(sid):
                kept = policy.keep(sid, pos)
                accepted = [int(i) for i in kept if pos.matched[i - 1]]
                seconds += costs.step(1 + len(kept))
            else:
                kept, accepted = np.zeros(0, dtype=np.int64), []
                seconds += costs.step(1, drafting=False)
                skipped += 1
            policy.record(sid, kept, accepted, trace.temperature > 0)
            gained = min(len(accepted) + 1, len(trace.positions) - k)
            k, tokens, steps, rows = k + gained, tokens + gained, steps + 1, rows + 1 + len(kept)
    return {"policy": policy.name, "tokens": tokens, "steps": steps, "tau": tokens / steps,
            "rows_per_step": rows / steps, "skipped": skipped, "tok_s": tokens / seconds}


def policies(table: dict, fixed: list[int]) -> list:
    return [Fixed(n) for n in fixed] + [Adaptive(table)]


def format_row(cost: str, r: dict) -> str:
    return (f"| {cost} | {r['policy']} | {r['tau']:.2f} | {r['rows_per_step']:.1f} | "
            f"{r['skipped'] / r['steps']:.0%} | {r['tok_s']:.1f} |")


def run(args) -> int:
    traces = load_or_record(args)
    if args.miss_all:  # the same trees from a drafter of no use: nothing matches
        traces = [Trace(t.emitted, [Position(p.tokens, p.parents, p.logprobs, np.zeros_like(p.matched))
                                    for p in t.positions], t.temperature) for t in traces]
    positions = sum(len(t.positions) for t in traces)
    print(f"{len(traces)} traces, {positions} positions, mean nodes accepted of the full tree "
          f"{np.mean([p.matched.sum() for t in traces for p in t.positions]):.2f}")
    print("| step costs | policy | tokens / step | rows / step | steps not drafted | tokens / s |")
    print("|---|---|---:|---:|---:|---:|")
    for cost in args.costs:
        table = COST_TABLES[cost]
        for policy in policies(table, args.fixed):
            print(format_row(cost, replay(traces, policy, table)), flush=True)
    return 0


def load_or_record(args) -> list[Trace]:
    """The traces of --trace if that file exists, else recorded (and written there when --trace is given)."""
    if args.trace and Path(args.trace).exists():
        return [_trace_from(d) for d in json.loads(Path(args.trace).read_text())]
    from tools.bench_spec import heldout_prompts
    from tools.spec_inprocess import InProcessPair

    pair = InProcessPair(args.model, device=args.device)
    traces = []
    for i, p in enumerate(heldout_prompts(args.model, args.prompts, args.prompt_tokens)):
        t0 = time.perf_counter()
        traces.append(record(pair, p["ids"], args.max_new, args.budget, args.temperature, args.seed + i))
        print(f"recorded {p['key']}: {len(p['ids'])} prompt tokens, {time.perf_counter() - t0:.1f} s", flush=True)
    if args.trace:
        Path(args.trace).write_text(json.dumps([_trace_to(t) for t in traces]))
    return traces


def _trace_to(t: Trace) -> dict:
    positions = [{"tokens": p.tokens.tolist(), "parents": p.parents.tolist(), "logprobs": p.logprobs.tolist()}
                 for p in t.positions]
    return {"emitted": t.emitted, "temperature": t.temperature, "positions": positions}


def _trace_from(d: dict) -> Trace:
    emitted, positions = d["emitted"], []
    for k, p in enumerate(d["positions"]):
        tokens, parents = np.array(p["tokens"], dtype=np.int64), np.array(p["parents"], dtype=np.int32)
        positions.append(Position(tokens, parents, np.array(p["logprobs"], dtype=np.float32),
                                  matched_nodes(tokens, parents, emitted[k + 1:])))
    return Trace(emitted, positions, d.get("temperature", 0.0))


def configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", default="models/kimi-tiny", help="target checkpoint with its drafter in <model>/drafter")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts (tools/bench_spec.py's)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="record sampled decoding (the replay is exact at "
                   "any temperature: DDTree's sampled output is plain sampling's with the same uniforms)")
    p.add_argument("--seed", type=int, default=0, help="prompt i's sampling seed is seed + i")
    p.add_argument("--budget", type=int, default=64, help="nodes of each recorded tree (the most a policy can keep)")
    p.add_argument("--fixed", type=lambda s: [int(x) for x in s.split(",")], default=[0, 2, 4, 8, 16, 32, 64],
                   help="fixed budgets to replay (0 = plain decoding)")
    p.add_argument("--costs", type=lambda s: s.split(","), default=list(COST_TABLES),
                   help=f"step-cost tables: {', '.join(COST_TABLES)}")
    p.add_argument("--trace", help="JSON file of recorded trees: read if it exists, else written")
    p.add_argument("--miss-all", action="store_true", help="replay the trees as if no node were ever accepted (what a "
                   "drafter of no use costs, its confidence unchanged)")
    p.set_defaults(func=run)
    return p


def add_parser(bsub) -> None:
    """`ddtree bench budget`: service_kit/tools.py calls this with the `bench` subparsers."""
    configure(bsub.add_parser("budget", help="tree-budget policies replayed on recorded drafts against step costs"))


def main(argv: list[str] | None = None) -> int:
    args = configure(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
