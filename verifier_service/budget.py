"""Adaptive tree budget: which of each session's drafted nodes a step verifies, and whether it waits for trees at all
(DESIGN §8, reference/ddtree.md §4.2 CaDDTree, P15 and P16).

On K2.6 a verify row is not free: every row routes to 8 experts, so a 16-row verify reads ~5x the expert bytes of a
one-row step. What a node is worth depends on the drafter, the text and the step. This module weighs the two:

- Node i of a drafted tree lies on the accepted path with probability a_i, whatever other nodes the tree holds:
  greedy or sampled, the walk follows the target's token at each accepted node. So a kept set S (closed under
  parents) yields 1 + Σ_{i in S} a_i tokens in expectation. a_i comes from the drafter's own confidence in this very
  tree: the product, over the path to node i, of each node's calibrated probability of being accepted once its
  parent is (`draft_calibration.Calibration`, learned from every verified node).
- A step of R rows costs C + W + T(R): T, the verify time, measured per row bucket (the forward's CUDA graphs pad R
  to a power of two, so T is a step function of R), W, the wait for the drafter's trees (none in a step that
  drafts nothing), C, the rest of the step's cycle (accept, commit, the loop), all three as exponential moving
  averages of measured steps (`StepCosts`).
- Each step keeps the nodes that maximize Σ_s E_s / (C + W + T(R)), the sessions' expected tokens per second: for any
  node total m the best choice is the m largest a's (closed under parents: a child's a is at most its parent's), so
  `choose` scans m. One session: its own tokens per second, the per-stream latency users see.
- Before sending the next step's Proposes, `draft_pays` weighs the tokens and rows the sessions' recent trees were
  expected to give against root-only steps, which skip W: a drafter that is of no use on the current text (on K2.6
  its Propose takes ~3 ms, a one-row verify ~5) is not waited for, and the step is plain decoding. After 2 such steps
  a session waits for a tree again whatever the estimate, so a drafter that becomes useful again is seen soon; while
  those trees still do not pay, the next wait comes after 4, 8, then 16 root-only steps.

Replayed on recorded trees of the trained tiny pair against K2.6's measured step times (`ddtree bench budget`,
docs/BENCHMARKS.md), this per-tree confidence gives more tokens per second than weighing each node by how often its
rank was accepted (the previous estimator) and than every fixed budget. A row bucket whose verify time
has not been seen yet is interpolated between the measured ones, and outside them taken in proportion to its rows:
optimistic below (so that a smaller bucket gets tried, and measured), pessimistic above.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np

from verifier_service.acceptance import tree_depths
from verifier_service.draft_calibration import Calibration
from verifier_service.graphs import BUCKETS

COST_RATE = 0.2  # EMA step of the measured step costs
VALUE_RATE = 0.2  # EMA step of a session's expected tokens and rows per drafted step
BACK_TO_BACK_S = 0.05  # a step that starts within this of the previous one's end continues its cycle
EXPLORE_FIRST, EXPLORE_EVERY = 2, 16  # root-only steps before a session waits for its tree again whatever the estimate:
# 2 after a drafted step, doubling while the trees it then waits for still do not pay, up to 16
MARGIN = 0.03  # fewer nodes only when that is this much better: the estimates are noisy, a row bucket's time too
SKIP_MARGIN = 0.1  # root-only steps only when they are this much better than drafting (replayed: 0.03 skips useful
# drafts on text where a cut tree is expected just to pay; 0.2 keeps waiting for a useless drafter whose wait is short)


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


def _calibration_inputs(draft) -> tuple[list[int], list[int], np.ndarray]:
    """A Draft as the calibration reads it: parents, depths (1..L) and log-probs (0, i.e. q = 1, when the drafter
    sent none)."""
    n = len(draft.tokens)
    logprobs = np.asarray(draft.logprobs, dtype=np.float64) if draft.logprobs else np.zeros(n)
    return draft.parents, tree_depths(draft.parents)[1:], logprobs


def _ema(old: float | None, new: float, rate: float = COST_RATE) -> float:
    return new if old is None else old + rate * (new - old)


def choose(rates: list[list[float]], fixed_rows: int, base_tokens: float, step_s) -> list[list[int]] | None:
    """Nodes to keep per session: rates[s] = session s's node acceptance estimates in node order (a child's at most
    its parent's), fixed_rows = rows the step has anyway (every decoding session's root, prefill chunks),
    base_tokens = tokens it yields with no node (one per decoding session), step_s(rows) -> expected seconds or None.
    Returns each session's kept nodes (1-based, ascending; closed under parents: equal rates keep node order), the
    choice that maximizes expected tokens per second, preferring more nodes unless fewer are MARGIN better; None when
    a cost is unknown (verify everything then). A node never accepted is never worth a row. Within a row bucket the
    cost is flat and every further node adds tokens, so only each bucket's fullest total is a candidate. Plain Python:
    on the step's critical path, and a few dozen numbers (numpy's per-call cost was most of it)."""
    flat = [(-r, s, i) for s, rs in enumerate(rates) for i, r in enumerate(rs, 1) if r > 0]
    flat.sort()  # largest first; equal ones in session, then node order
    gain = [0.0, *itertools.accumulate(-r for r, _, _ in flat)]  # tokens from the m best nodes
    totals, b = {0, len(flat)}, row_bucket(max(fixed_rows, 1))
    while b - fixed_rows < len(flat):
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
    kept: list[list[int]] = [[] for _ in rates]
    for _, s, i in flat[:best_m]:
        kept[s].append(i)
    return [sorted(k) for k in kept]


def cut(draft, nodes: list[int]):
    """The draft's tree restricted to `nodes` (1-based, ascending, closed under parents), renumbered in order."""
    from verifier_service.drafter_client import Draft

    if len(nodes) == len(draft.tokens):
        return draft
    new = {0: 0, **{old: i for i, old in enumerate(nodes, 1)}}  # old node -> new node
    return Draft([draft.tokens[i - 1] for i in nodes], [new[draft.parents[i - 1]] for i in nodes],
                 [draft.logprobs[i - 1] for i in nodes] if draft.logprobs else [])


@dataclass
class _SessionState:
    idle: int = 0  # root-only steps since its last drafted one
    gap: int = EXPLORE_FIRST  # root-only steps after which it waits for a tree again
    sampled: bool = False  # its acceptance is drawn (temperature > 0): it learns and reads that calibration
    tokens: float | None = None  # expected tokens of its drafted steps (EMA), 1 for the root included
    rows: float = 0.0  # nodes its drafted steps kept (EMA)
    verified: object = None  # the draft its step verifies (after `trim`), until `record`


def _idle(state: _SessionState, ahead: int) -> int:
    """Root-only steps since the session last waited for a tree, at the next step; ahead: 1 when deciding during a
    step's forward, before its record (a step that drafted has `verified` set by `trim`)."""
    if not ahead:
        return state.idle
    return 0 if state.verified is not None else state.idle + 1


class AdaptiveBudget:
    """The engine's side: the calibrations, the step costs, each session's recent value, and the trimming of a step's
    drafts."""

    def __init__(self):
        self.costs = StepCosts()
        self.calibration = {False: Calibration(), True: Calibration()}  # greedy, sampled
        self.sessions: dict[str, _SessionState] = {}
        self._plan: tuple[frozenset, bool] | None = None  # plan_next's (sessions, draft?)
        self._verified: list[tuple] = []  # (sampled, draft, accepted nodes) recorded, learned during the next forward
        # the last step: start, end, rows, verify seconds, draft wait (None: nothing drafted)
        self._last: tuple[float, float, int, float, float | None] | None = None

    def trim(self, drafts: dict, sessions: int, fixed_rows: int) -> dict:
        """drafts: session id -> Draft (tokens, parents, logprobs) -> each cut to the chosen nodes. sessions: decoding
        sessions in the step (one token each at least); fixed_rows: their roots plus the step's prefill rows."""
        ids = list(drafts)
        rates = [self._rates(sid, drafts[sid]) for sid in ids]
        chosen = choose(rates, fixed_rows, float(sessions), self.costs.step)
        out = {}
        for i, sid in enumerate(ids):
            nodes = chosen[i] if chosen is not None else list(range(1, len(rates[i]) + 1))
            out[sid] = cut(drafts[sid], nodes)
            state = self._state(sid)
            state.verified = out[sid]
            state.tokens = _ema(state.tokens, 1.0 + sum(rates[i][k - 1] for k in nodes), VALUE_RATE)
            state.rows = _ema(state.rows, float(len(nodes)), VALUE_RATE)
        return out

    def _rates(self, sid: str, draft) -> list[float]:
        return self.calibration[self._state(sid).sampled].path_rates(*_calibration_inputs(draft))

    def plan_next(self, sessions: list[str]) -> None:
        """During a step's forward (the host is idle): whether the next step waits for these decoding sessions'
        trees, counting the step being recorded as done. Also learns from the
        trees verified until the last step, so that neither `record` nor the next `trim` does it on the critical
        path (the next step's cut is one step stale)."""
        self._plan = (frozenset(sessions), self._decide(sessions, ahead=1))
        self.learn()

    def learn(self) -> None:
        """The recorded trees into the calibrations, and their tables recomputed."""
        verified, self._verified = self._verified, []
        for sampled, draft, accepted in verified:
            self.calibration[sampled].record(*_calibration_inputs(draft), accepted)
        for cal in self.calibration.values():
            cal.table  # noqa: B018 - computed now, while the GPU works

    def draft_pays(self, sessions: list[str]) -> bool:
        """Whether the next step should wait for trees for these decoding sessions: the tokens and rows their recent
        trees were expected to give, at the step's expected cost, against a root-only step, which does not wait for
        the drafter. True while a cost is unknown and when a session is due to explore. The decision `plan_next` made
        during the last forward, when it covers these sessions."""
        plan, self._plan = self._plan, None
        if plan is not None and set(sessions) <= plan[0]:
            return plan[1]
        return self._decide(sessions, ahead=0)

    def _decide(self, sessions: list[str], ahead: int) -> bool:
        states = [self._state(sid) for sid in sessions]
        if not states or any(st.tokens is None or _idle(st, ahead) >= st.gap for st in states):
            return True
        return self._pays(states)

    def _pays(self, states: list[_SessionState]) -> bool:
        fixed = len(states)
        drafting = self.costs.step(fixed + round(sum(st.rows for st in states)))
        root_only = self.costs.step(fixed, drafting=False)
        if drafting is None or root_only is None:
            return True
        return sum(st.tokens for st in states) / drafting * (1 + SKIP_MARGIN) >= fixed / root_only

    def record(self, sid: str, verified: int, accepted_rows: list[int], sampled: bool = False) -> None:
        """After a session's walk: it verified `verified` nodes (those `trim` kept; 0 in a root-only step),
        accepted_rows = [0 (root), its accepted nodes]; sampled: its walk drew the target's tokens."""
        state = self._state(sid)
        state.sampled = sampled
        draft, state.verified = state.verified, None
        if draft is None:  # a root-only step
            state.idle += 1
            return
        # it waited for a tree: if trees like it still do not pay, the next wait comes later
        state.idle, state.gap = 0, EXPLORE_FIRST if self._pays([state]) else min(2 * state.gap, EXPLORE_EVERY)
        if verified and len(draft.tokens) == verified:
            self._verified.append((sampled, draft, accepted_rows[1:]))

    def _state(self, sid: str) -> _SessionState:
        state = self.sessions.get(sid)
        if state is None:
            state = self.sessions[sid] = _SessionState()
        return state

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

    def forget(self, sid: str) -> None:
        self.sessions.pop(sid, None)
