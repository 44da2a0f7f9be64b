"""Adaptive tree budget: how many of each session's drafted nodes a step verifies (DESIGN §8, reference/ddtree.md
§4.2 CaDDTree and P16).

On K2.6 a verify row is not free: every row routes to 8 experts, so a 16-row verify reads ~5x the expert bytes of a
one-row step. What a node is worth depends on the drafter and the text. This module weighs the two every step:

- Node i of a drafted tree (1-based, best-first order: drafter_service/tree.py pops nodes by path probability, and
  parents come before children, so any first-n prefix is a tree) lies on the accepted path with probability a_i.
  That does not depend on which other nodes the tree holds: greedy or sampled, the walk follows the target's token
  at each accepted node. So keeping a session's first n nodes yields 1 + Σ_{i<=n} a_i tokens in expectation.
  `NodeAcceptance` estimates a_i per session from how often its i-th node was accepted when verified, with the
  engine-wide rates as a prior (worth PRIOR_STEPS observations), made non-increasing in i by pooling adjacent
  violators (which keeps their sum: a deep node the drafter ranks late can be accepted more often than a sibling).
- A step of R rows costs C + T(R): T, the verify time, measured per row bucket (the forward's CUDA graphs pad R to
  a power of two, so T is a step function of R), C, the rest of the step's cycle (drafting wait, accept, the
  loop), both as exponential moving averages of measured steps (`StepCosts`).
- Each step keeps the nodes that maximize Σ_s E_s / (C + T(R)), the sessions' expected tokens per second: for any
  node total m the best choice is the m largest a's (a prefix of each session's tree, since a_i does not increase
  with i), so `choose` scans m. One session: its own tokens per second, the per-stream latency users see.

Exploration: every EXPLORE_EVERY-th step of a session verifies its whole tree, so ranks that the choice has dropped
keep being measured (a drafter that improves as the context grows gets its nodes back). Until a row bucket's verify
time has been seen, costs above the largest measured one are extrapolated linearly (pessimistic: T grows slower).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from verifier_service.graphs import BUCKETS

PRIOR_STEPS = 2.0  # observations the engine-wide rate counts for in a session's estimate
SESSION_DECAY = 0.98  # per verified step: a session's old observations fade (its text changes)
GLOBAL_RATE = 0.02  # EMA step of the engine-wide rates
COST_RATE = 0.2  # EMA step of the measured step costs
BACK_TO_BACK_S = 0.05  # a step that starts within this of the previous one's end continues its cycle
EXPLORE_EVERY = 16  # a session's steps 0, 16, 32, ... verify every drafted node
MARGIN = 0.03  # fewer nodes only when that is this much better: the estimates are noisy, a row bucket's time too


@functools.lru_cache(maxsize=4096)
def row_bucket(rows: int) -> int:
    """The forward's row bucket (graphs.BUCKETS), or the next power of two above them."""
    return next((b for b in BUCKETS if b >= rows), 1 << max(rows - 1, 0).bit_length())


class StepCosts:
    """Seconds per step: verify time per row bucket and the fixed rest, as moving averages of measured steps."""

    def __init__(self):
        self.verify: dict[int, float] = {}  # row bucket -> seconds
        self.fixed: float | None = None

    def observe(self, rows: int, verify_s: float, fixed_s: float) -> None:
        b = row_bucket(rows)
        old = self.verify.get(b)
        self.verify[b] = verify_s if old is None else old + COST_RATE * (verify_s - old)
        self.fixed = fixed_s if self.fixed is None else self.fixed + COST_RATE * (fixed_s - self.fixed)

    def step(self, rows: int) -> float | None:
        """Expected seconds of a step of `rows` rows, or None before any step was measured."""
        if self.fixed is None or not self.verify:
            return None
        b = row_bucket(rows)
        if b in self.verify:
            return self.fixed + self.verify[b]
        above = [k for k in self.verify if k > b]
        if above:  # a larger bucket's time bounds this one's
            return self.fixed + self.verify[min(above)]
        top = max(self.verify)
        return self.fixed + self.verify[top] * b / top


class NodeAcceptance:
    """How often node i of a session's trees lay on the accepted path (decayed counts), per rank i."""

    def __init__(self, size: int):
        self.shown = np.zeros(size)
        self.hits = np.zeros(size)

    def record(self, verified: int, accepted_nodes: list[int], decay: float) -> None:
        """A step verified nodes 1..verified; accepted_nodes (1-based) were on the accepted path."""
        self.shown *= decay
        self.hits *= decay
        self.shown[:verified] += 1
        for i in accepted_nodes:
            if i <= verified:
                self.hits[i - 1] += 1

    def rates(self, n: int, prior: np.ndarray) -> np.ndarray:
        """Estimated acceptance of nodes 1..n, non-increasing."""
        return non_increasing((self.hits[:n] + PRIOR_STEPS * prior[:n]) / (self.shown[:n] + PRIOR_STEPS))


class GlobalAcceptance:
    """The engine-wide rates every session starts from: an EMA over every verified node of every session.
    Starts optimistic (so new engines verify whole trees and measure them) at `start` for every rank."""

    def __init__(self, size: int, start: float = 0.9):
        self.rate = np.full(size, start)

    def record(self, verified: int, accepted_nodes: list[int]) -> None:
        hit = np.zeros(verified)
        for i in accepted_nodes:
            if i <= verified:
                hit[i - 1] = 1.0
        self.rate[:verified] += GLOBAL_RATE * (hit - self.rate[:verified])


def non_increasing(x: np.ndarray) -> np.ndarray:
    """The closest non-increasing sequence in squared error (isotonic regression; the same as pooling adjacent
    violators, which replaces each run that rises by its mean, so every prefix ending at a pool boundary keeps its
    sum): y_i = min over j <= i of max over k >= i of mean(x[j..k]). Vectorized over the n x n (j, k) means: n is at
    most the tree budget, and a Python pool loop cost ~100 us a step."""
    n = len(x)
    if n < 2 or (np.diff(x) <= 0).all():
        return np.asarray(x, dtype=float)
    c = np.concatenate([[0.0], np.cumsum(x)])
    j, k = np.arange(n)[:, None], np.arange(n)[None, :]
    mean = np.where(k >= j, (c[1:][None, :] - c[:-1][:, None]) / np.maximum(k - j + 1, 1), -np.inf)  # [j, k]
    most = np.maximum.accumulate(mean[:, ::-1], axis=1)[:, ::-1]  # [j, i]: max over k >= i
    return np.where(j <= k, most, np.inf).min(axis=0)


def choose(rates: list[np.ndarray], fixed_rows: int, base_tokens: int, step_s) -> list[int] | None:
    """Nodes to keep per session: rates[s] = session s's non-increasing node acceptance estimates (one per drafted
    node), fixed_rows = rows the step has anyway (every decoding session's root, prefill chunks), base_tokens =
    tokens it yields with no node (one per decoding session), step_s(rows) -> expected seconds or None. Maximizes
    expected tokens per second, preferring more nodes unless fewer are MARGIN better; None when a cost is unknown
    (verify everything then). A node never accepted is never worth a row. Within a row bucket the cost is flat and
    every further node adds tokens, so only each bucket's fullest total is a candidate."""
    flat = np.concatenate(rates) if rates else np.zeros(0)
    owner = np.repeat(np.arange(len(rates)), [len(r) for r in rates])  # session of each node
    useful = flat > 0
    flat, owner = flat[useful], owner[useful]
    order = np.argsort(-flat, kind="stable")  # largest first; equal ones in session, then node order
    gain = np.concatenate([[0.0], np.cumsum(flat[order])])  # tokens from the m best nodes
    totals, b = {0, len(order)}, row_bucket(max(fixed_rows, 1))
    while b - fixed_rows < len(order):
        totals.add(max(b - fixed_rows, 0))
        b = row_bucket(b + 1)
    best_m, best_value = 0, -math.inf
    for m in sorted(totals, reverse=True):
        cost = step_s(fixed_rows + m)
        if cost is None:
            return None
        value = (base_tokens + gain[m]) / cost
        if value > best_value * (1 + MARGIN):
            best_m, best_value = m, value
    return np.bincount(owner[order[:best_m]], minlength=len(rates)).tolist()


class AdaptiveBudget:
    """The engine's side: each session's estimates, the step costs, and the trimming of a step's drafts."""

    def __init__(self, max_nodes: int):
        self.max_nodes = max_nodes
        self.costs = StepCosts()
        self.prior = GlobalAcceptance(max_nodes)
        self.sessions: dict[str, list] = {}  # session id -> [NodeAcceptance, steps verified]
        self._last: tuple[float, float, int, float] | None = None  # the last step: start, end, rows, verify_s

    def trim(self, drafts: dict, sessions: int, fixed_rows: int) -> dict:
        """drafts: session id -> Draft (tokens, parents; best-first) -> the same with each tree cut to the chosen
        first n nodes. sessions: decoding sessions in the step (one token each at least); fixed_rows: their roots
        plus the step's prefill rows."""
        from verifier_service.drafter_client import Draft

        chosen, rates = [], []
        base = float(sessions)
        for sid, d in drafts.items():
            acc, steps = self.sessions.setdefault(sid, [NodeAcceptance(self.max_nodes), 0])
            r = acc.rates(len(d.tokens), self.prior.rate)
            if steps % EXPLORE_EVERY == 0:  # verify the whole tree: its ranks stay measured
                fixed_rows += len(d.tokens)
                base += float(r.sum())
            else:
                chosen.append(sid)
                rates.append(r)
        keep = choose(rates, fixed_rows, base, self.costs.step) if chosen else []
        if keep is None:
            return drafts
        out = dict(drafts)
        for sid, n in zip(chosen, keep):
            d = drafts[sid]
            out[sid] = Draft(d.tokens[:n], d.parents[:n])
        return out

    def record(self, sid: str, verified: int, accepted_rows: list[int]) -> None:
        """After a session's walk: it verified nodes 1..verified, accepted_rows = [0 (root), its accepted nodes]."""
        entry = self.sessions.setdefault(sid, [NodeAcceptance(self.max_nodes), 0])
        entry[0].record(verified, accepted_rows[1:], SESSION_DECAY)
        entry[1] += 1
        self.prior.record(verified, accepted_rows[1:])

    def observe_step(self, rows: int, verify_s: float, start: float, end: float) -> None:
        """A step's rows and verify seconds, its start and end (time.perf_counter). The rest of a step's cycle
        (waiting for drafts, accept, the loop in between) is the time from one step's start to the next one's, less
        its verify, when the two ran back to back; the step is counted once the next one starts."""
        if self._last is not None:
            last_start, last_end, last_rows, last_verify = self._last
            if start - last_end < BACK_TO_BACK_S:
                self.costs.observe(last_rows, last_verify, start - last_start - last_verify)
        self._last = (start, end, rows, verify_s)

    def forget(self, sid: str) -> None:
        self.sessions.pop(sid, None)
