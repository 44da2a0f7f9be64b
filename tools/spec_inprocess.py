"""In-process harness of `ddtree bench spec`: the target and the drafter driven step by step, no gRPC.

verifier_service's K2Model + PagedKVCache + plan builder + acceptance walk and drafter_service's
DrafterEngine, called directly. Per verify step the split is: draft (drafter inject + block
forward), tree build (top-K + heap), verify (plan + target forward), accept/commit (target tokens,
walk, KV commit, features).
"""

from __future__ import annotations

import contextlib
import statistics
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tools.spec_report import AR, CHAIN, DDTREE, SPLIT_KEYS, add_speedups, format_row, mode_name, speed_fields


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
                 dtype: torch.dtype | None = None, drafter_dtype: torch.dtype | None = None, kv_cache_mb: int = 64,
                 page_size: int = 64, drafter_quantization: str = "none"):
        from drafter_service.engine import DrafterEngine, EngineOptions
        from drafter_service.int8 import quantize_drafter
        from drafter_service.weights import load_drafter
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
        drafter = load_drafter(drafter_dir, model_dir, device=self.device, dtype=drafter_dtype or self.dtype)
        if drafter_quantization == "int8":  # the drafter service's --quantization int8
            quantize_drafter(drafter)
        self.drafter = DrafterEngine(drafter, EngineOptions(cache_bytes=32 << 20, window=4096, max_tree_budget=1024),
                                     name=drafter_dir.name)
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
        from verifier_service.acceptance import SessionRng

        table = self.cache.table
        sid = uuid.uuid4().hex
        rng = SessionRng(seed)
        layer_ids = () if mode == AR else self.layer_ids
        times = dict.fromkeys(SPLIT_KEYS, 0.0)
        committed, gaps = [], []
        table.open(sid)
        try:
            clock = _Timer(self.device)
            out = self._prefill(sid, prompt, layer_ids)
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
                    tokens, parents = self._draft(sid, mode, budget, feats, feat_start, pending, clock, times)
                out = self._verify(sid, pending, tokens, parents, length, layer_ids)
                times["verify"] += clock.lap()
                walk = self._accept(sid, out.logits, tokens, parents, rng, temperature)
                if mode != AR:
                    feats = out.hidden[torch.tensor(walk.accepted_rows, device=self.device)]
                    feat_start = length
                if record_gaps:
                    gaps.append(_top2_gap(out.logits[0]))
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

    def _prefill(self, sid: str, prompt: list[int], layer_ids):
        """The prompt's KV written, logits of its last position only."""
        from verifier_service.plan import SeqRows, build_plan, chain_parents

        table, n = self.cache.table, len(prompt)
        slots = table.extend(sid, n)
        plan = build_plan([SeqRows(prompt, chain_parents(n), 0, table.pages(sid), slots)], logit_rows=[n - 1],
                          explicit_mla=True, device=self.device)
        return self.model.forward(plan, self.cache.kv, layer_ids)

    def _draft(self, sid: str, mode: str, budget: int, feats: torch.Tensor, feat_start: int, root: int,
               clock: _Timer, times: dict[str, float]) -> tuple[list[int], list[int]]:
        """The drafter's tree below `root` -> (tokens, parents); its time split into draft and tree_build."""
        from drafter_service.engine import DraftMode, Proposal, ProposeItem

        tree_before = self.tree_clock.seconds
        with self.tree_clock.installed():
            res = self.drafter.propose([ProposeItem(
                session_id=sid, start_position=feat_start, features=feats, root_token=root,
                tree_budget=budget, mode=DraftMode.CHAIN if mode == CHAIN else DraftMode.DDTREE)])[0]
        if not isinstance(res, Proposal):
            raise RuntimeError(f"drafter answered {res}")
        tokens, parents = res.tree.tokens.tolist(), res.tree.parents.tolist()
        dt = clock.lap()
        tree_s = self.tree_clock.seconds - tree_before
        times["tree_build"] += tree_s
        times["draft"] += dt - tree_s
        return tokens, parents

    def _verify(self, sid: str, root: int, tokens: list[int], parents: list[int], length: int, layer_ids):
        """Target forward of [root, *tokens] (tree attention) at positions from `length`, into scratch KV."""
        from verifier_service.plan import SeqRows, build_plan, tree_parents

        table = self.cache.table
        scratch = table.scratch(sid, len(tokens) + 1)
        plan = build_plan([SeqRows([root, *tokens], tree_parents(parents), length, table.pages(sid), scratch)],
                          device=self.device)
        return self.model.forward(plan, self.cache.kv, layer_ids)

    def _accept(self, sid: str, logits: torch.Tensor, tokens: list[int], parents: list[int], rng,
                temperature: float):
        """The target's token at every tree row, the acceptance walk, and the KV commit of its rows."""
        from verifier_service.acceptance import walk_tree

        depths = [0]
        for p in parents:
            depths.append(depths[p] + 1)
        targets = self._pick(logits, depths, rng, temperature)
        walk = walk_tree(tokens, parents, targets)
        self.cache.commit(sid, walk.accepted_rows)
        return walk


def _top2_gap(logits: torch.Tensor) -> float:
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


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
            log(format_row(row))
    add_speedups(rows)
    return rows


def _summarize(results: list[GenResult], ar: list[GenResult] | None, mode: str, budget: int,
               temperature: float, block_size: int) -> dict:
    steps = sum(r.steps for r in results)
    committed = sum(sum(r.committed) for r in results)
    decode_tokens = sum(len(r.tokens) - 1 for r in results)
    decode_s = sum(r.decode_s for r in results)
    split = {k: sum(r.times[k] for r in results) / max(steps, 1) * 1e3 for k in SPLIT_KEYS}
    row = {"mode": mode, "budget": budget if mode == DDTREE else (block_size - 1 if mode == CHAIN else 0),
           "name": mode_name(mode, budget), "temperature": temperature, "prompts": len(results),
           **speed_fields(steps, committed, decode_tokens, decode_s),
           "split_ms": {k: round(v, 3) for k, v in split.items()},
           "prefill_ms": round(statistics.mean(r.prefill_s for r in results) * 1e3, 2)}
    if ar is not None:
        row.update(_lossless(results, ar))
    return row


def _lossless(results: list[GenResult], ar: list[GenResult]) -> dict:
    """Every prompt's tokens vs AR's; a divergence gives the first differing position and AR's top-2 logit
    gap there (a small gap points at a numerical near-tie rather than a wrong token)."""
    diverged = []
    for i, (r, a) in enumerate(zip(results, ar)):
        n = min(len(r.tokens), len(a.tokens))
        pos = next((k for k in range(n) if r.tokens[k] != a.tokens[k]), None)
        if pos is not None:
            gap = a.top2_gap[pos] if pos < len(a.top2_gap) else None
            diverged.append({"prompt": i, "position": pos, "ar_top2_gap": None if gap is None else round(gap, 5),
                             "ar": a.tokens[pos], "mode": r.tokens[pos]})
    return {"matches_ar": not diverged, "divergences": diverged}
