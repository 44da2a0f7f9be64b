"""Adaptive tree budget: how many of each session's drafted nodes a step verifies (DESIGN §8, reference/ddtree.md
§4.2 CaDDTree and P16).

On K2.6 a verify row is not free: every row routes to 8 experts, so a 16-row verify reads ~5x the expert bytes of a
one-row step. What a node is worth depends on the drafter and the text. This module weighs the two every step:

- Node i of a drafted tree (1-based, best-first order: drafter_service/tree.py pops nodes by path probability, and
  parents come before children, so any first-n prefix is a tree) lies on the accepted path with probability a_i.
  That does not depend on which other nodes the tree holds: greedy or sampled, the walk follows the target's token
  at each accepted node. So keeping a session's first n nodes yields 1 + Σ_{i<=n} a_i tokens in expectation.
  `NodeAcceptance` estimates a_i per session from how often its i-th node was accepted when verified, with the
  engine-wide rates as a prior (worth PRIOR_STEPS observations), made non-increasing in i by weighted isotonic
  regression (a deep node the drafter ranks late can be accepted more often than a sibling: pooling keeps the
  pair's weighted sum, where a running minimum would lose it).
- A step of R rows costs C + W + T(R): T, the verify time, measured per row bucket (the forward's CUDA graphs pad R
  to a power of two, so T is a step function of R), W, the wait for the drafter's trees (none in a step that
  drafts nothing), C, the rest of the step's cycle (accept, commit, the loop), all three as exponential moving
  averages of measured steps (`StepCosts`).
- Each step keeps the nodes that maximize Σ_s E_s / (C + W + T(R)), the sessions' expected tokens per second: for any
  node total m the best choice is the m largest a's (a prefix of each session's tree, since a_i does not increase
  with i), so `choose` scans m. One session: its own tokens per second, the per-stream latency users see.
- Before sending the next step's Proposes, `draft_pays` weighs the same expected tokens per second against
  root-only steps, which skip W: a drafter that is of no use on the current text (on K2.6 its Propose takes ~3 ms,
  a one-row verify ~5) is not waited for, and the step is plain decoding.

Exploration: every EXPLORE_EVERY-th step of a session drafts and verifies its whole tree, so ranks that the choice
has dropped keep being measured (a drafter that improves as the context grows gets its nodes back). A row bucket whose
verify time has not been seen yet is interpolated between the measured ones, and outside them taken in proportion to
its rows: optimistic below (so that a smaller bucket gets tried, and measured), pessimistic above. Host cost: 70-175
us a session step (2-core CPU, 16-64 nodes), made during the forward.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from verifier_service.graphs import BUCKETS

PRIOR_STEPS = 2.0  # observations the engine-wide rate counts for in a session's estimate
SESSION_DECAY = 0.98  # per verified step: a session's old observations fade (its text changes)
GLOBAL_DECAY = 0.998  # per verified session step: the engine-wide counts fade slowly (the traffic changes)
START_RATE, START_FALL, START_STEPS = 0.9, 0.85, 4.0  # the engine-wide rates before any observation (GlobalAcceptance)
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
        self.fixed: float | None = None  # the rest of the cycle, without the draft wait
        self.wait: float | None = None  # the draft wait of a step that drafts

    def observe(self, rows: int, verify_s: float, fixed_s: float, wait_s: float | None = None) -> None:
        """One step cycle: its rows, verify seconds, the rest without the draft wait, and the wait (None: it drafted
        nothing)."""
        b = row_bucket(rows)
        self.verify[b] = _ema(self.verify.get(b), verify_s)
        self.fixed = _ema(self.fixed, fixed_s)
        if wait_s is not None:
            self.wait = _ema(self.wait, wait_s)

    def step(self, rows: int, drafting: bool = True) -> float | None:
        """Expected seconds of a step of `rows` rows (with or without waiting for drafts), or None before any step
        was measured."""
        if self.fixed is None or not self.verify or (drafting and self.wait is None):
            return None
        base = self.fixed + (self.wait if drafting else 0.0)
        b = row_bucket(rows)
        if b in self.verify:
            return base + self.verify[b]
        lo = max((k for k in self.verify if k < b), default=None)
        hi = min((k for k in self.verify if k > b), default=None)
        if lo is None:  # below every measured bucket: in proportion to rows (optimistic, so it gets tried and measured)
            return base + self.verify[hi] * b / hi
        if hi is None:  # above them: in proportion to rows (pessimistic: a verify grows slower than its rows)
            return base + self.verify[lo] * b / lo
        return base + self.verify[lo] + (self.verify[hi] - self.verify[lo]) * (b - lo) / (hi - lo)


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + COST_RATE * (new - old)


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
        weight = self.shown[:n] + PRIOR_STEPS
        return non_increasing((self.hits[:n] + PRIOR_STEPS * prior[:n]) / weight, weight)


class GlobalAcceptance:
    """The engine-wide rates every session starts from: decayed counts over every verified node of every session,
    on top of a start that is worth START_STEPS observations: START_RATE for node 1, falling by START_FALL per rank
    (Σ over 16 ranks ≈ 5.5 tokens, a good drafter's; a useless one is found out within a few steps)."""

    def __init__(self, size: int):
        self.counts = NodeAcceptance(size)
        self.start = START_RATE * START_FALL ** np.arange(size)

    @property
    def rate(self) -> np.ndarray:
        c = self.counts
        return (c.hits + START_STEPS * self.start) / (c.shown + START_STEPS)

    def record(self, verified: int, accepted_nodes: list[int]) -> None:
        self.counts.record(verified, accepted_nodes, GLOBAL_DECAY)


def non_increasing(x: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
    """The closest non-increasing sequence in w-weighted squared error (isotonic regression; the same as pooling
    adjacent violators, which replaces each run that rises by its weighted mean): y_i = min over j <= i of max over
    k >= i of the weighted mean of x[j..k]. The weights are the estimates' observation counts, so a rarely verified
    rank, still near its prior, barely moves the ranks before it. Vectorized over the n x n (j, k) means: n is at most
    the tree budget, and a Python pool loop cost ~100 us a step."""
    n = len(x)
    if n < 2 or (np.diff(x) <= 0).all():
        return np.asarray(x, dtype=float)
    w = np.ones(n) if w is None else np.asarray(w, dtype=float)
    cx, cw = np.concatenate([[0.0], np.cumsum(w * x)]), np.concatenate([[0.0], np.cumsum(w)])
    j, k = np.arange(n)[:, None], np.arange(n)[None, :]
    span = np.where(k >= j, cw[1:][None, :] - cw[:-1][:, None], 1.0)
    mean = np.where(k >= j, (cx[1:][None, :] - cx[:-1][:, None]) / span, -np.inf)  # [j, k]
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


@dataclass
class _SessionState:
    acceptance: NodeAcceptance
    steps: int = 0  # verify steps recorded
    cached: tuple = (None, None)  # ((estimates version, n), rates) last computed


class AdaptiveBudget:
    """The engine's side: each session's estimates, the step costs, and the trimming of a step's drafts."""

    def __init__(self, max_nodes: int):
        self.max_nodes = max_nodes
        self.costs = StepCosts()
        self.prior = GlobalAcceptance(max_nodes)
        self.sessions: dict[str, _SessionState] = {}
        self._version = 0  # bumped by every record: the estimates it changed
        self._plan: tuple[int, bool, dict] | None = None  # plan_next's (fixed rows, draft?, nodes to keep)
        # the last step: start, end, rows, verify seconds, draft wait (None: nothing drafted)
        self._last: tuple[float, float, int, float, float | None] | None = None

    def trim(self, drafts: dict, sessions: int, fixed_rows: int) -> dict:
        """drafts: session id -> Draft (tokens, parents; best-first) -> the same with each tree cut to the chosen
        first n nodes. sessions: decoding sessions in the step (one token each at least); fixed_rows: their roots
        plus the step's prefill rows. Takes the choice `plan_next` made during the last forward when it covers
        these sessions and rows, else makes it now."""
        from verifier_service.drafter_client import Draft

        plan, self._plan = self._plan, None
        if plan is not None and plan[0] == fixed_rows and drafts.keys() <= plan[2].keys():
            keep = plan[2]
        else:
            keep = self._decide([(sid, len(d.tokens)) for sid, d in drafts.items()], fixed_rows, 0, sessions)[1]
        out = dict(drafts)
        for sid, d in drafts.items():
            n = keep.get(sid)
            if n is not None and n < len(d.tokens):
                out[sid] = Draft(d.tokens[:n], d.parents[:n])
        return out

    def plan_next(self, sessions: list[tuple[str, int]]) -> None:
        """During a step's forward (the host is idle): the next step's choices for these decoding sessions ((id,
        most nodes its tree may have)), from the estimates before this step's records (one step stale), so that
        sending the next Proposes and cutting the next trees cost the critical path nothing."""
        draft, keep = self._decide(sessions, len(sessions), 1, len(sessions))
        self._plan = (len(sessions), draft, keep)

    def _decide(self, sessions: list[tuple[str, int]], fixed_rows: int, ahead: int,
                decoding: int) -> tuple[bool, dict]:
        """(Wait for trees?, session id -> nodes to keep, None = the whole tree) for a step whose drafted sessions
        have these many nodes; decoding: its decoding sessions (a token each); ahead: 1 when deciding before this
        step's records (a session's verified steps then count one more)."""
        keep, ids, rates, base, rows = {}, [], [], float(decoding), fixed_rows
        exploring = False
        for sid, n in sessions:
            n = min(n, self.max_nodes)
            r, steps = self._rates(sid, n)
            if (steps + ahead) % EXPLORE_EVERY == 0:  # the whole tree: its ranks stay measured
                keep[sid], exploring, rows, base = None, True, rows + n, base + float(r.sum())
            else:
                ids.append(sid)
                rates.append(r)
        chosen = choose(rates, rows, base, self.costs.step) if ids else []
        if chosen is None:  # a cost not measured yet
            return True, {sid: None for sid, _ in sessions}
        keep.update(zip(ids, chosen))
        root_only = self.costs.step(fixed_rows, drafting=False)
        if exploring or root_only is None or not sessions:
            return True, keep
        tokens = base + sum(float(r[:k].sum()) for r, k in zip(rates, chosen))
        return tokens / self.costs.step(rows + sum(chosen)) * (1 + MARGIN) >= decoding / root_only, keep

    def record(self, sid: str, verified: int, accepted_rows: list[int]) -> None:
        """After a session's walk: it verified nodes 1..verified, accepted_rows = [0 (root), its accepted nodes]."""
        state = self._state(sid)
        state.acceptance.record(verified, accepted_rows[1:], SESSION_DECAY)
        state.steps += 1
        self.prior.record(verified, accepted_rows[1:])
        self._version += 1

    def _state(self, sid: str) -> _SessionState:
        state = self.sessions.get(sid)
        if state is None:
            state = self.sessions[sid] = _SessionState(NodeAcceptance(self.max_nodes))
        return state

    def _rates(self, sid: str, n: int) -> tuple[np.ndarray, int]:
        """(The session's estimates for nodes 1..n, its verified steps). Estimates change only when a session
        records, so `draft_pays` at a step's end and `trim` at the next one's start compute them once."""
        state = self._state(sid)
        if state.cached[0] != (self._version, n):
            state.cached = ((self._version, n), state.acceptance.rates(n, self.prior.rate))
        return state.cached[1], state.steps

    def observe_step(self, rows: int, verify_s: float, wait_s: float | None, start: float, end: float) -> None:
        """A step's rows, verify seconds and draft wait (None: it drafted nothing), its start and end
        (time.perf_counter). The rest of a step's cycle (accept, commit, the loop in between) is the time from one
        step's start to the next one's, less its verify and wait, when the two ran back to back; the step is
        counted once the next one starts."""
        if self._last is not None:
            last_start, last_end, last_rows, last_verify, last_wait = self._last
            if start - last_end < BACK_TO_BACK_S:
                rest = start - last_start - last_verify - (last_wait or 0.0)
                self.costs.observe(last_rows, last_verify, rest, last_wait)
        self._last = (start, end, rows, verify_s, wait_s)

    def draft_pays(self, sessions: list[tuple[str, int]]) -> bool:
        """Whether the next step should wait for trees for these decoding sessions ((id, most nodes its tree may
        have)): expected tokens per second with their trees, cut as `trim` would, against a root-only step, which
        does not wait for the drafter. True while a cost is unknown and when a session is due to explore. The
        decision `plan_next` made during the last forward, when it covers these sessions."""
        if self._plan is not None and all(sid in self._plan[2] for sid, _ in sessions):
            return self._plan[1]
        return self._decide(sessions, len(sessions), 0, len(sessions))[0]

    def forget(self, sid: str) -> None:
        self.sessions.pop(sid, None)
