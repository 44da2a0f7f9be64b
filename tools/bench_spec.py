"""`ddtree bench spec`: acceptance length, speed and step-time split of AR, CHAIN and DDTREE.

Prompts are the first lines (up to `--prompt-tokens` tokens) of held-out corpus files (tools/corpus.py
split, spread over packages). Every mode decodes every prompt for `--max-new` tokens, greedy and at
each `--temperatures` value (seeded: the same seed gives the same tokens in every mode, so T > 0 is
checked for exactness too). Two harnesses:

- in-process (`--in-process`, default on): verifier_service's K2Model + PagedKVCache + plan builder +
  acceptance walk, and drafter_service's DrafterEngine, called directly (no gRPC, no protos).
  Per step: draft (drafter inject + block forward), tree build (top-K + heap), verify (plan + target
  forward), accept/commit (target tokens, walk, KV commit, features).
- end to end (`--e2e`): drafter, verifier and gateway as separate processes on loopback (as
  tests/stack.py starts them), token-id prompts through the public Generate stream. Split from the
  verifier's Prometheus histograms: draft (drafter RPC incl. its compute), verify, accept/commit, and
  the rest of the wall time (gateway, streaming, scheduling).

Reports per mode: mean acceptance length τ (tokens per verify step, bonus included), decode tokens/s,
speedup vs AR at the same temperature, the step-time split, and lossless checks (every mode's tokens
vs AR's; on a difference, the first position and AR's top-2 logit gap there). Writes bench_spec.json
and bench_spec.png (τ and speedup vs budget; matplotlib when installed, else a built-in rasterizer).

    python -m tools.bench_spec --model models/kimi-tiny --device cpu --prompts 4 --max-new 64
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python tools/bench_spec.py`
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

AR, CHAIN, DDTREE = "ar", "chain", "ddtree"
DEFAULT_BUDGETS = (4, 8, 16, 32, 64)
SPLIT_KEYS = ("draft", "tree_build", "verify", "accept_commit", "rpc", "other")


# ------------------------------------------------------------------ prompts

def heldout_prompts(tokenizer_dir: str | Path, count: int, prompt_tokens: int, *, per_mille: int = 30,
                    min_tokens: int = 16) -> list[dict]:
    """First lines of `count` held-out files (fixed hash order of their keys), each cut at a line end
    so that it holds at most `prompt_tokens` tokens (and at least `min_tokens`)."""
    from gateway.tokenizer import KimiTokenizer
    from tools import corpus

    tok = KimiTokenizer.from_dir(tokenizer_dir)
    files, _ = corpus.list_files()
    _, heldout = corpus.split(files, per_mille)
    heldout = sorted(heldout, key=lambda f: corpus.key_hash("order", f.key))
    prompts = []
    for f in heldout:
        text, ids = "", []
        for line in f.text.splitlines(keepends=True):
            cand = tok.encode(text + line)
            if len(cand) > prompt_tokens:
                break
            text, ids = text + line, cand
        if len(ids) >= min_tokens and text.strip():
            prompts.append({"key": f.key, "text": text, "ids": ids})
        if len(prompts) == count:
            break
    return prompts


# ------------------------------------------------------------------ in-process pair

@dataclass
class GenResult:
    tokens: list[int]
    steps: int
    committed: list[int]  # tokens committed per verify step (accepted + bonus)
    times: dict[str, float]  # decode-step seconds per split key
    decode_s: float  # wall seconds of the verify steps (prefill excluded)
    prefill_s: float
    top2_gap: list[float] = field(default_factory=list)  # AR only: target top-2 logit gap per emitted token


class _Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.t = time.perf_counter()

    def lap(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        return dt


class _TreeClock:
    """Accumulates the seconds drafter_service.engine spends in topk_logprobs + build_tree (tree build)."""

    def __init__(self, device: torch.device):
        self.seconds, self.device = 0.0, device

    @contextlib.contextmanager
    def installed(self):
        from drafter_service import engine as eng

        originals = eng.topk_logprobs, eng.build_tree

        def wrap(fn):
            def timed(*a, **kw):
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    self.seconds += time.perf_counter() - t
            return timed

        eng.topk_logprobs, eng.build_tree = wrap(originals[0]), wrap(originals[1])
        try:
            yield self
        finally:
            eng.topk_logprobs, eng.build_tree = originals


class InProcessPair:
    """The target and the drafter of one checkpoint, driven step by step like the verifier's engine."""

    def __init__(self, model_dir: str | Path, drafter_dir: str | Path | None = None, *, device: str = "cpu",
                 dtype: torch.dtype | None = None, kv_cache_mb: int = 64, page_size: int = 64):
        from drafter_service.engine import DrafterEngine, EngineOptions
        from verifier_service.kv_cache import PagedKVCache
        from verifier_service.model import K2Model
        from verifier_service.model_config import K2Config
        from verifier_service.weights import load_target_weights

        self.device = torch.device(device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.cfg = K2Config.from_json(model_dir)
        weights = load_target_weights(model_dir, self.cfg, dtype=self.dtype, device=self.device,
                                      progress=lambda p: None)
        self.model = K2Model(self.cfg, weights)
        self.cache = PagedKVCache.from_budget(kv_cache_mb * 2**20, num_layers=self.cfg.num_hidden_layers,
                                              width=self.cfg.kv_cache_width, page_size=page_size,
                                              dtype=self.dtype, device=self.device)
        drafter_dir = Path(drafter_dir) if drafter_dir else Path(model_dir) / "drafter"
        self.drafter = DrafterEngine.load(drafter_dir, model_dir, device=self.device, dtype=self.dtype,
                                          options=EngineOptions(cache_bytes=32 << 20, window=4096,
                                                                max_tree_budget=1024))
        info = self.drafter.info()
        self.layer_ids, self.block_size = info.target_layer_ids, info.block_size
        self.tree_clock = _TreeClock(self.device)

    def _pick(self, logits: torch.Tensor, depths: list[int], rng, temperature: float) -> list[int]:
        from verifier_service.acceptance import filter_probs, sample_with_uniforms

        if temperature <= 0:
            return logits.argmax(-1).tolist()
        u = rng.peek(max(depths) + 1)[torch.tensor(depths)]
        return sample_with_uniforms(filter_probs(logits, temperature, 0, 1.0).cpu(), u).tolist()

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_new: int, mode: str, budget: int = 16, temperature: float = 0.0,
                 seed: int = 0, record_gaps: bool = False) -> GenResult:
        from drafter_service.engine import DraftMode, Proposal, ProposeItem
        from verifier_service.acceptance import SessionRng, walk_tree
        from verifier_service.plan import SeqRows, build_plan, chain_parents, tree_parents

        table, dev = self.cache.table, self.device
        sid = uuid.uuid4().hex
        rng = SessionRng(seed)
        layer_ids = () if mode == AR else self.layer_ids
        times = dict.fromkeys(SPLIT_KEYS, 0.0)
        committed, gaps = [], []
        table.open(sid)
        try:
            clock = _Timer(dev)
            n = len(prompt)
            slots = table.extend(sid, n)
            plan = build_plan([SeqRows(prompt, chain_parents(n), 0, table.pages(sid), slots)], logit_rows=[n - 1],
                              explicit_mla=True, device=dev)
            out = self.model.forward(plan, self.cache.kv, layer_ids)
            first = self._pick(out.logits, [0], rng, temperature)
            if record_gaps:
                gaps.append(_top2_gap(out.logits[0]))
            rng.advance(1)
            emitted, pending = [first[0]], first[0]
            feats, feat_start = out.hidden, 0
            prefill_s = clock.lap()
            decode_t0 = time.perf_counter()
            while len(emitted) < max_new:
                length = table.length(sid)
                tokens, parents = [], []
                if mode != AR:
                    tree_before = self.tree_clock.seconds
                    with self.tree_clock.installed():
                        res = self.drafter.propose([ProposeItem(
                            session_id=sid, start_position=feat_start, features=feats, root_token=pending,
                            tree_budget=budget, mode=DraftMode.CHAIN if mode == CHAIN else DraftMode.DDTREE)])[0]
                    if not isinstance(res, Proposal):
                        raise RuntimeError(f"drafter answered {res}")
                    tokens, parents = res.tree.tokens.tolist(), res.tree.parents.tolist()
                    dt = clock.lap()
                    tree_s = self.tree_clock.seconds - tree_before
                    times["tree_build"] += tree_s
                    times["draft"] += dt - tree_s
                scratch = table.scratch(sid, len(tokens) + 1)
                plan = build_plan([SeqRows([pending, *tokens], tree_parents(parents), length, table.pages(sid),
                                           scratch)], device=dev)
                out = self.model.forward(plan, self.cache.kv, layer_ids)
                logits = out.logits
                times["verify"] += clock.lap()
                depths = [0]
                for p in parents:
                    depths.append(depths[p] + 1)
                targets = self._pick(logits, depths, rng, temperature)
                walk = walk_tree(tokens, parents, targets)
                self.cache.commit(sid, walk.accepted_rows)
                if mode != AR:
                    feats = out.hidden[torch.tensor(walk.accepted_rows, device=dev)]
                    feat_start = length
                if record_gaps:
                    gaps.append(_top2_gap(logits[0]))
                rng.advance(len(walk.tokens))
                emitted += walk.tokens
                pending = walk.tokens[-1]
                committed.append(len(walk.tokens))
                times["accept_commit"] += clock.lap()
            decode_s = time.perf_counter() - decode_t0
        finally:
            table.close(sid)
            if mode != AR:
                with contextlib.suppress(KeyError):
                    self.drafter.release(sid)
        return GenResult(emitted[:max_new], len(committed), committed, times, decode_s, prefill_s, gaps[:max_new])


def _top2_gap(logits: torch.Tensor) -> float:
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


# ------------------------------------------------------------------ running modes

def mode_list(modes: list[str], budgets: list[int]) -> list[tuple[str, int]]:
    out = []
    for m in modes:
        if m == DDTREE:
            out += [(DDTREE, b) for b in budgets]
        else:
            out.append((m, 0))
    return out


def mode_name(mode: str, budget: int) -> str:
    return f"ddtree-{budget}" if mode == DDTREE else mode


def _summarize(results: list[GenResult], ar: list[GenResult] | None, mode: str, budget: int,
               temperature: float, block_size: int) -> dict:
    steps = sum(r.steps for r in results)
    committed = sum(sum(r.committed) for r in results)
    decode_tokens = sum(len(r.tokens) - 1 for r in results)
    decode_s = sum(r.decode_s for r in results)
    split = {k: sum(r.times[k] for r in results) / max(steps, 1) * 1e3 for k in SPLIT_KEYS}
    row = {"mode": mode, "budget": budget if mode == DDTREE else (block_size - 1 if mode == CHAIN else 0),
           "name": mode_name(mode, budget), "temperature": temperature, "prompts": len(results),
           "steps": steps, "tau": round(committed / max(steps, 1), 3),
           "tokens_per_s": round(decode_tokens / decode_s, 2) if decode_s else None,
           "step_ms": round(decode_s / max(steps, 1) * 1e3, 3),
           "split_ms": {k: round(v, 3) for k, v in split.items()},
           "prefill_ms": round(statistics.mean(r.prefill_s for r in results) * 1e3, 2)}
    if ar is not None:
        row.update(_lossless(results, ar))
    return row


def _lossless(results: list[GenResult], ar: list[GenResult]) -> dict:
    diverged = []
    for i, (r, a) in enumerate(zip(results, ar)):
        n = min(len(r.tokens), len(a.tokens))
        pos = next((k for k in range(n) if r.tokens[k] != a.tokens[k]), None)
        if pos is not None:
            gap = a.top2_gap[pos] if pos < len(a.top2_gap) else None
            diverged.append({"prompt": i, "position": pos, "ar_top2_gap": None if gap is None else round(gap, 5),
                             "ar": a.tokens[pos], "mode": r.tokens[pos]})
    return {"matches_ar": not diverged, "divergences": diverged}


def run_in_process(pair: InProcessPair, prompts: list[dict], *, modes: list[tuple[str, int]],
                   temperatures: list[float], max_new: int, seed: int, log=print,
                   deadline: float | None = None) -> list[dict]:
    """deadline: time.monotonic() after which no further mode is started."""
    rows = []
    # Warm-up (allocator, kernels, lazy init) so the first mode timed is not penalized.
    pair.generate(prompts[0]["ids"], min(8, max_new), DDTREE if any(m != AR for m, _ in modes) else AR, 4)
    for temp in temperatures:
        ar = None
        for mode, budget in modes:
            if deadline is not None and time.monotonic() > deadline:
                log(f"bench: out of time, skipping T={temp:g} {mode_name(mode, budget)}")
                continue
            res = [pair.generate(p["ids"], max_new, mode, budget, temp, seed + i, record_gaps=mode == AR)
                   for i, p in enumerate(prompts)]
            if mode == AR:
                ar = res
            row = _summarize(res, ar if mode != AR else None, mode, budget, temp, pair.block_size)
            row["harness"] = "in_process"
            rows.append(row)
            log(_format_row(row))
    _add_speedups(rows)
    return rows


def _add_speedups(rows: list[dict]) -> None:
    base = {(r["harness"], r["temperature"]): r["tokens_per_s"] for r in rows if r["mode"] == AR}
    for r in rows:
        b = base.get((r["harness"], r["temperature"]))
        r["speedup_vs_ar"] = round(r["tokens_per_s"] / b, 3) if b and r["tokens_per_s"] else None


def _format_row(r: dict) -> str:
    split = " ".join(f"{k}={v:.2f}" for k, v in r["split_ms"].items() if v)
    lossless = "" if "matches_ar" not in r else (" lossless" if r["matches_ar"] else
                                                  f" DIVERGED {r['divergences'][:2]}")
    return (f"[{r['harness']}] T={r['temperature']:g} {r['name']:>10}: tau {r['tau']:.2f}  "
            f"{r['tokens_per_s']} tok/s  step {r['step_ms']:.2f} ms ({split}){lossless}")


# ------------------------------------------------------------------ end to end (gRPC)

def _metric_sums(port: int) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("ddtree_") and (line.split(" ")[0].endswith(("_sum", "_count", "_total"))):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def run_e2e(model_dir: str | Path, drafter_dir: str | Path, prompts: list[dict], *, modes: list[tuple[str, int]],
            temperatures: list[float], max_new: int, seed: int, device: str, dtype: str, log_dir: Path,
            log=print) -> list[dict]:
    """Three service processes on loopback; one Generate stream per prompt and mode."""
    import os
    import signal
    import socket
    import subprocess

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from ddtree.v1 import generation_pb2 as pb
    from ddtree.v1 import generation_pb2_grpc as pb_grpc

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDTREE_")}
    env.update(PYTHONUNBUFFERED="1")
    if device == "cpu":
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    ports = {k: free_port() for k in ("drafter", "verifier", "gateway", "verifier_metrics")}
    base = [sys.executable, "-m", "service_kit.cli"]
    common = ["--host", "127.0.0.1", "--log-format", "json", "--grace-s", "1"]
    max_budget = max([b for _, b in modes] + [16])
    cmds = {
        "drafter": [*base, "drafter", "--port", str(ports["drafter"]), "--model", str(drafter_dir),
                    "--target-model", str(model_dir), "--device", device, "--dtype", dtype,
                    "--cache-mb", "32", "--max-tree-budget", str(max(max_budget, 64)), *common],
        "verifier": [*base, "verifier", "--port", str(ports["verifier"]), "--model", str(model_dir),
                     "--device", device, "--dtype", dtype, "--drafter", f"127.0.0.1:{ports['drafter']}",
                     "--kv-cache-mb", "64", "--max-tree-budget", str(max(max_budget, 64)),
                     "--metrics-port", str(ports["verifier_metrics"]), *common],
        "gateway": [*base, "gateway", "--port", str(ports["gateway"]), "--model", str(model_dir),
                    "--verifier", f"127.0.0.1:{ports['verifier']}", *common],
    }
    services = {"drafter": "ddtree.internal.v1.Drafter", "verifier": "ddtree.internal.v1.Verifier",
                "gateway": "ddtree.v1.Generation"}
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = {}
    try:
        for name in ("drafter", "verifier", "gateway"):
            logf = open(log_dir / f"{name}.log", "ab")
            procs[name] = subprocess.Popen(cmds[name], cwd=repo, env=env, stdin=subprocess.DEVNULL, stdout=logf,
                                           stderr=subprocess.STDOUT, start_new_session=True)
            logf.close()
            deadline = time.monotonic() + 180
            with grpc.insecure_channel(f"127.0.0.1:{ports[name]}") as ch:
                while True:
                    if procs[name].poll() is not None:
                        raise RuntimeError(f"{name} exited ({procs[name].returncode}); see {log_dir / name}.log")
                    try:
                        r = health_pb2_grpc.HealthStub(ch).Check(
                            health_pb2.HealthCheckRequest(service=services[name]), timeout=1)
                        if r.status == health_pb2.HealthCheckResponse.SERVING:
                            break
                    except grpc.RpcError:
                        pass
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{name} not SERVING after 180 s")
                    time.sleep(0.2)
        pb_mode = {AR: pb.SPEC_MODE_AR, CHAIN: pb.SPEC_MODE_CHAIN, DDTREE: pb.SPEC_MODE_DDTREE}
        rows = []
        with grpc.insecure_channel(f"127.0.0.1:{ports['gateway']}") as ch:
            stub = pb_grpc.GenerationStub(ch)

            def one(prompt, mode, budget, temp, s):
                req = pb.GenerateRequest(request_id=uuid.uuid4().hex)
                req.token_ids.ids.extend(prompt)
                req.stopping.max_new_tokens = max_new
                req.stopping.ignore_eos = True
                req.speculation.mode = pb_mode[mode]
                if mode == DDTREE:
                    req.speculation.tree_budget = budget
                if temp > 0:
                    req.sampling.temperature = temp
                    req.sampling.seed = s
                ids, final, t0, t_first = [], None, time.perf_counter(), None
                for msg in stub.Generate(req, timeout=600):
                    if msg.HasField("chunk"):
                        if t_first is None:
                            t_first = time.perf_counter()
                        ids += msg.chunk.token_ids
                    else:
                        final = msg.final
                return ids, final, time.perf_counter() - (t_first or t0), time.perf_counter() - t0

            one(prompts[0]["ids"], DDTREE, 4, 0.0, seed)  # warm-up
            for temp in temperatures:
                ar_ids = None
                for mode, budget in modes:
                    before = _metric_sums(ports["verifier_metrics"])
                    outs = [one(p["ids"], mode, budget, temp, seed + i) for i, p in enumerate(prompts)]
                    after = _metric_sums(ports["verifier_metrics"])
                    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                    steps = sum(o[1].spec_stats.verify_steps for o in outs)
                    committed = sum(o[1].spec_stats.verify_steps * o[1].spec_stats.mean_acceptance_length for o in outs)
                    decode_s = sum(o[2] for o in outs)
                    decode_tokens = sum(len(o[0]) - 1 for o in outs)
                    n_steps = max(d.get("ddtree_verify_step_seconds_count", 0.0), 1.0)
                    split = {"draft": d.get("ddtree_draft_seconds_sum", 0.0),
                             "verify": d.get("ddtree_verify_step_seconds_sum", 0.0),
                             "accept_commit": d.get("ddtree_accept_commit_seconds_sum", 0.0)}
                    wall = sum(o[3] for o in outs)
                    split["other"] = max(wall - sum(split.values()), 0.0)
                    row = {"harness": "e2e", "mode": mode, "name": mode_name(mode, budget),
                           "budget": budget if mode == DDTREE else 0, "temperature": temp, "prompts": len(outs),
                           "steps": steps, "tau": round(committed / max(steps, 1), 3),
                           "tokens_per_s": round(decode_tokens / decode_s, 2) if decode_s else None,
                           "step_ms": round(decode_s / max(steps, 1) * 1e3, 3),
                           "split_ms": {k: round(v / n_steps * 1e3, 3) for k, v in split.items()},
                           "split_note": "draft = the verifier waiting for the drafter RPC (split into draft "
                                         "compute + rpc when the in-process harness ran too); other = wall time "
                                         "outside verifier steps (gateway, streaming, prefill)"}
                    ids = [o[0] for o in outs]
                    if mode == AR:
                        ar_ids = ids
                    elif ar_ids is not None:
                        bad = [{"prompt": i, "position": next((k for k in range(min(len(a), len(b))) if a[k] != b[k]),
                                                              min(len(a), len(b)))}
                               for i, (a, b) in enumerate(zip(ar_ids, ids)) if a != b]
                        row.update(matches_ar=not bad, divergences=bad)
                    rows.append(row)
                    log(_format_row(row))
        _add_speedups(rows)
        return rows
    finally:
        for p in procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)


# ------------------------------------------------------------------ plot

def plot(rows: list[dict], path: Path) -> str:
    """τ and speedup vs budget per (harness, temperature); chain as a dashed reference line."""
    series = {}
    for r in rows:
        if r["mode"] in (CHAIN, DDTREE):
            key = (r["harness"], r["temperature"])
            series.setdefault(key, {"ddtree": [], "chain": None})
            if r["mode"] == DDTREE:
                series[key]["ddtree"].append((r["budget"], r["tau"], r.get("speedup_vs_ar") or 0.0))
            else:
                series[key]["chain"] = (r["tau"], r.get("speedup_vs_ar") or 0.0)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _plot_raster(series, path)
        return "builtin"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for (harness, temp), s in sorted(series.items()):
        pts = sorted(s["ddtree"])
        label = f"{harness} T={temp:g}"
        for ax, idx in ((axes[0], 1), (axes[1], 2)):
            line, = ax.plot([p[0] for p in pts], [p[idx] for p in pts], marker="o", label=f"DDTree {label}")
            if s["chain"] is not None:
                ax.axhline(s["chain"][idx - 1], ls="--", color=line.get_color(), alpha=0.6, label=f"chain {label}")
    for ax, title in ((axes[0], "mean acceptance length τ"), (axes[1], "speedup vs AR (tokens/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree budget N")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "matplotlib"


# A 3x5 pixel font for the built-in rasterizer (rows top to bottom, 3 bits each).
_FONT = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
    "8": "111101111101111", "9": "111101111001111", ".": "000000000000010", "=": "000111000111000",
    "-": "000000111000000", " ": "000000000000000", "a": "000011101101011", "b": "100110101101110",
    "c": "000011100100011", "d": "001011101101011", "e": "000111111100011", "g": "011101011001110",
    "h": "100110101101101", "i": "010000010010010", "k": "100101110101101", "l": "010010010010010",
    "n": "000110101101101", "o": "000010101101010", "p": "000110101110100", "r": "000011100100100",
    "s": "000011110001110", "t": "010111010010011", "u": "000101101101011", "v": "000101101101010",
    "x": "000101010101101", "y": "101101011001110", "w": "000101101111101", "f": "011100110100100",
    "m": "000111111101101", "q": "000011101011001", "j": "001000001001110", "z": "000111001010111",
    "T": "111010010010010", "N": "101111111111101", "A": "010101111101101", "R": "110101110101101",
}
_COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)]


def _plot_raster(series: dict, path: Path, width: int = 900, height: int = 380) -> None:
    import numpy as np

    img = np.full((height, width, 3), 255, dtype=np.uint8)

    def text(x: int, y: int, s: str, color=(0, 0, 0), scale: int = 2) -> None:
        for ch in s:
            glyph = _FONT.get(ch, _FONT.get(ch.lower(), _FONT[" "]))
            for k, bit in enumerate(glyph):
                if bit == "1":
                    r, c = divmod(k, 3)
                    img[y + r * scale:y + (r + 1) * scale, x + c * scale:x + (c + 1) * scale] = color
            x += 4 * scale

    def line(x0, y0, x1, y1, color, dashed=False, thick=1):
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for i in range(n):
            if dashed and (i // 6) % 2:
                continue
            x = int(round(x0 + (x1 - x0) * i / max(n - 1, 1)))
            y = int(round(y0 + (y1 - y0) * i / max(n - 1, 1)))
            img[max(y - thick + 1, 0):y + thick, max(x - thick + 1, 0):x + thick] = color

    budgets = sorted({b for s in series.values() for b, _, _ in s["ddtree"]}) or [1, 2]
    lo_b, hi_b = math.log2(budgets[0]), math.log2(budgets[-1]) if budgets[-1] > budgets[0] else math.log2(budgets[0]) + 1
    for panel, (idx, title) in enumerate(((1, "tau"), (2, "speedup vs ar"))):
        x0, y0, w, h = 60 + panel * 450, 30, 360, 290
        vals = [p[idx] for s in series.values() for p in s["ddtree"]]
        vals += [s["chain"][idx - 1] for s in series.values() if s["chain"] is not None]
        vmax = max(vals + [1.0]) * 1.1
        line(x0, y0 + h, x0 + w, y0 + h, (0, 0, 0))
        line(x0, y0, x0, y0 + h, (0, 0, 0))
        text(x0 + w // 2 - 40, 8, title)
        for k in range(5):
            v = vmax * k / 4
            y = y0 + h - int(h * v / vmax)
            line(x0 - 4, y, x0, y, (0, 0, 0))
            text(x0 - 42, y - 5, f"{v:.1f}")
        for b in budgets:
            x = x0 + int(w * (math.log2(b) - lo_b) / (hi_b - lo_b))
            line(x, y0 + h, x, y0 + h + 4, (0, 0, 0))
            text(x - 6, y0 + h + 8, str(b))
        text(x0 + w // 2 - 30, y0 + h + 26, "budget n")
        for ci, (key, s) in enumerate(sorted(series.items())):
            color = _COLORS[ci % len(_COLORS)]
            pts = sorted(s["ddtree"])
            xy = [(x0 + int(w * (math.log2(q[0]) - lo_b) / (hi_b - lo_b)), y0 + h - int(h * q[idx] / vmax)) for q in pts]
            for (ax, ay), (bx, by) in zip(xy, xy[1:]):
                line(ax, ay, bx, by, color, thick=2)
            for ax, ay in xy:
                img[ay - 3:ay + 4, ax - 3:ax + 4] = color
            if s["chain"] is not None:
                y = y0 + h - int(h * s["chain"][idx - 1] / vmax)
                line(x0, y, x0 + w, y, color, dashed=True)
            if panel == 0:
                text(x0 + 10, y0 + 6 + 14 * ci, f"{key[0]} t={key[1]:g}", color)
    _write_png(path, img)


def _write_png(path: Path, img) -> None:
    import struct
    import zlib

    h, w, _ = img.shape
    raw = b"".join(b"\x00" + img[y].tobytes() for y in range(h))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    Path(path).write_bytes(png)


# ------------------------------------------------------------------ CLI

def run(args) -> int:
    model = Path(args.model or _default_model())
    drafter = Path(args.drafter_model) if args.drafter_model else model / "drafter"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = heldout_prompts(model, args.prompts, args.prompt_tokens)
    if not prompts:
        print("bench spec: no held-out prompts found", file=sys.stderr)
        return 1
    modes = mode_list(args.modes.split(","), [int(b) for b in args.budgets.split(",")])
    temps = [float(t) for t in args.temperatures.split(",")]
    report = {"model": str(model), "drafter": str(drafter), "device": args.device, "dtype": args.dtype,
              "max_new": args.max_new, "prompt_tokens": args.prompt_tokens,
              "prompts": [{"key": p["key"], "tokens": len(p["ids"])} for p in prompts],
              "torch": torch.__version__, "rows": []}
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    log = lambda s: print(s, flush=True)  # noqa: E731
    if args.in_process:
        pair = InProcessPair(model, drafter, device=args.device, dtype=dtype)
        report["block_size"] = pair.block_size
        report["rows"] += run_in_process(pair, prompts, modes=modes, temperatures=temps, max_new=args.max_new,
                                         seed=args.seed, log=log)
        del pair
    if args.e2e:
        report["rows"] += run_e2e(model, drafter, prompts, modes=modes, temperatures=temps, max_new=args.max_new,
                                  seed=args.seed, device=args.device, dtype=args.dtype, log_dir=out / "logs", log=log)
    estimate_rpc(report["rows"])
    report["summary"] = summary(report["rows"])
    (out / "bench_spec.json").write_text(json.dumps(report, indent=2) + "\n")
    backend = plot(report["rows"], out / "bench_spec.png")
    print(json.dumps(report["summary"], indent=2))
    print(f"bench spec: wrote {out / 'bench_spec.json'} and {out / 'bench_spec.png'} ({backend})")
    return 0


def estimate_rpc(rows: list[dict]) -> None:
    """e2e rows: split the verifier's draft wait into the drafter's compute (the in-process draft + tree
    build of the same mode and temperature) and `rpc` (the rest: serialization, transport, scheduling)."""
    ip = {(r["name"], r["temperature"]): r for r in rows if r["harness"] == "in_process"}
    for r in rows:
        ref = ip.get((r["name"], r["temperature"]))
        if r["harness"] != "e2e" or ref is None or r["mode"] == AR:
            continue
        compute = ref["split_ms"]["draft"] + ref["split_ms"]["tree_build"]
        wait = r["split_ms"]["draft"]
        r["split_ms"].update(draft=round(min(compute, wait), 3), rpc=round(max(wait - compute, 0.0), 3))


def summary(rows: list[dict]) -> dict:
    out = {}
    for (harness, temp) in sorted({(r["harness"], r["temperature"]) for r in rows}):
        rs = [r for r in rows if r["harness"] == harness and r["temperature"] == temp]
        chain = next((r for r in rs if r["mode"] == CHAIN), None)
        trees = [r for r in rs if r["mode"] == DDTREE]
        best_tau = max(trees, key=lambda r: r["tau"], default=None)
        best_speed = max(trees + ([chain] if chain else []), key=lambda r: r.get("speedup_vs_ar") or 0, default=None)
        out[f"{harness} T={temp:g}"] = {
            "tau": {r["name"]: r["tau"] for r in rs},
            "speedup_vs_ar": {r["name"]: r.get("speedup_vs_ar") for r in rs},
            "best_ddtree_tau_over_chain": round(best_tau["tau"] / chain["tau"], 3) if best_tau and chain else None,
            "fastest": best_speed["name"] if best_speed else None,
            "lossless": all(r.get("matches_ar", True) for r in rs),
        }
    return out


def _default_model() -> str:
    from service_kit.launcher import resolve_model
    return str(resolve_model(None))


def configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", default=None, help="target dir (default: the shipped models/kimi-tiny)")
    p.add_argument("--drafter-model", default=None, help="DFlash drafter dir (default: MODEL/drafter)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--modes", default="ar,chain,ddtree")
    p.add_argument("--budgets", default=",".join(map(str, DEFAULT_BUDGETS)))
    p.add_argument("--temperatures", default="0,1", help="0 = greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch default)")
    p.add_argument("--in-process", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--e2e", action=argparse.BooleanOptionalAction, default=False,
                   help="also run through the three gRPC services (needs the generated stubs)")
    p.add_argument("--out", default="bench-out")
    p.set_defaults(func=_run_cmd)
    return p


def _run_cmd(args) -> int:
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    return run(args)


def add_parser(bsub) -> None:
    """`ddtree bench spec`: service_kit/tools.py calls this with the `bench` subparsers."""
    configure(bsub.add_parser("spec", help="acceptance length and speed of AR / CHAIN / DDTREE"))


def main(argv: list[str] | None = None) -> int:
    args = configure(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
