"""Adaptive tree budget (verifier_service/budget.py): the node choice against brute force over every per-session
prefix, the premise that a best-first tree's first n nodes are the n-node tree, and the estimators."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from drafter_service.tree import build_tree
from verifier_service import budget
from verifier_service.budget import (EXPLORE_EVERY, AdaptiveBudget, GlobalAcceptance, NodeAcceptance, StepCosts,
                                     choose, non_increasing, row_bucket)
from verifier_service.drafter_client import Draft


def bucket_costs(rng: random.Random, fixed: float):
    """A random verify time per row bucket, non-decreasing, and the step cost it implies."""
    per, t = {}, rng.uniform(0.5, 2.0)
    for b in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        t += rng.uniform(0.0, 3.0)
        per[b] = t
    return lambda rows: fixed + per[row_bucket(rows)]


def objective(rates, keep, fixed_rows, base, step_s) -> float:
    return (base + sum(float(r[:n].sum()) for r, n in zip(rates, keep))) / step_s(fixed_rows + sum(keep))


@pytest.mark.parametrize("margin", [0.0, budget.MARGIN])
@pytest.mark.parametrize("seed", range(40))
def test_choose_matches_brute_force(seed, margin, monkeypatch):
    """Without a margin: the best value over every per-session prefix. With it: within the margin of the best,
    and never fewer nodes than a best choice."""
    monkeypatch.setattr(budget, "MARGIN", margin)
    rng = random.Random(seed)
    sessions = rng.randint(1, 3)
    rates = [np.minimum.accumulate(np.array([rng.choice([0.0, 0.005, rng.random()]) for _ in range(rng.randint(0, 6))]))
             for _ in range(sessions)]
    fixed_rows, base = sessions + rng.choice([0, 0, 5, 40]), float(sessions)
    step_s = bucket_costs(rng, rng.uniform(0.0, 5.0))
    keep = choose(rates, fixed_rows, base, step_s)
    usable = [int((r > 0).sum()) for r in rates]  # a node never accepted is never kept
    combos = list(itertools.product(*(range(u + 1) for u in usable)))
    values = [objective(rates, c, fixed_rows, base, step_s) for c in combos]
    best = max(values)
    assert all(0 <= n <= u for n, u in zip(keep, usable))
    got = objective(rates, keep, fixed_rows, base, step_s)
    if margin == 0:
        assert got == pytest.approx(best, rel=1e-12)
    else:
        assert got * (1 + margin) >= best * (1 - 1e-12)
        assert sum(keep) >= min(sum(c) for c, v in zip(combos, values) if v == best)


def test_choose_unknown_cost_keeps_everything():
    assert choose([np.array([0.9, 0.5])], 1, 1.0, lambda rows: None) is None


def pool_adjacent_violators(x: list[float], w: list[float]) -> list[float]:
    """Reference: pools each rising run into its weighted mean until the sequence does not increase."""
    pools: list[list[float]] = []  # [weighted sum, weight, count]
    for v, wt in zip(x, w):
        pools.append([v * wt, wt, 1])
        while len(pools) > 1 and pools[-2][0] / pools[-2][1] < pools[-1][0] / pools[-1][1]:
            total, weight, count = pools.pop()
            pools[-1][0] += total
            pools[-1][1] += weight
            pools[-1][2] += count
    return [total / weight for total, weight, count in pools for _ in range(count)]


@pytest.mark.parametrize("seed", range(20))
def test_non_increasing_is_pool_adjacent_violators(seed):
    rng = np.random.default_rng(seed)
    x = rng.random(int(rng.integers(0, 65))) * rng.choice([1.0, 0.01])
    w = rng.random(len(x)) * 20 + 0.1
    for weights in (None, w):
        y = non_increasing(x, weights)
        wt = np.ones(len(x)) if weights is None else weights
        assert y.tolist() == pytest.approx(pool_adjacent_violators(x.tolist(), wt.tolist()), rel=1e-9, abs=1e-12)
        assert (np.diff(y) <= 1e-12).all() and (wt * y).sum() == pytest.approx((wt * x).sum())
    assert non_increasing(np.array([0.5, 0.2, 0.4, 0.1])).tolist() == pytest.approx([0.5, 0.3, 0.3, 0.1])


def test_choose_extremes():
    flat = lambda rows: 1.0  # noqa: E731 - rows cost nothing: every useful node is verified
    assert choose([np.array([0.9, 0.4, 0.2, 0.0])], 1, 1.0, flat) == [3]
    steep = lambda rows: float(rows)  # noqa: E731 - a row costs as much as the step: none is worth it
    assert choose([np.array([0.3, 0.2])], 1, 1.0, steep) == [0]


@pytest.mark.parametrize("seed", range(10))
def test_best_first_prefix_is_the_smaller_tree(seed):
    """The premise of trimming: the first n nodes of a budget-N tree are exactly the budget-n tree."""
    rng = np.random.default_rng(seed)
    L, K, N = 7, 5, 40
    logits = rng.normal(size=(L, 50)) * rng.uniform(0.5, 4)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ids = np.argsort(-logp, axis=-1)[:, :K]
    lps = np.take_along_axis(logp, ids, -1).astype(np.float32)
    full = build_tree(ids, lps, N)
    for n in range(N + 1):
        small = build_tree(ids, lps, n)
        assert small.tokens.tolist() == full.tokens[:n].tolist()
        assert small.parents.tolist() == full.parents[:n].tolist()


def test_node_acceptance_counts_and_prior():
    acc, prior = NodeAcceptance(4), np.full(4, 0.5)
    assert acc.rates(4, prior).tolist() == [0.5] * 4  # no observation: the prior
    for _ in range(200):
        acc.record(3, [1, 2], decay=1.0)  # nodes 1, 2 accepted, 3 not; node 4 never verified
    r = acc.rates(4, prior)
    assert r[0] == pytest.approx(1.0, abs=0.01) and r[1] == pytest.approx(1.0, abs=0.01)
    # node 3: (0 + 2 * 0.5) / (200 + 2) with weight 202; node 4 (never verified: the prior 0.5, weight 2) rises
    # above it: pooled into their weighted mean, which node 3's 200 observations dominate
    assert r[2] == r[3] == pytest.approx((1.0 + 2 * 0.5) / 204)
    acc.record(2, [3], decay=1.0)  # a node outside the verified ones is ignored
    assert acc.hits[2] == 0


def test_global_acceptance_starts_falling_and_follows_outcomes():
    g = GlobalAcceptance(3)
    assert g.rate.tolist() == pytest.approx([budget.START_RATE * budget.START_FALL ** i for i in range(3)])
    for _ in range(3000):
        g.record(2, [1])
    assert g.rate[0] == pytest.approx(1.0, abs=0.01) and g.rate[1] == pytest.approx(0.0, abs=0.01)
    assert g.rate[2] == pytest.approx(budget.START_RATE * budget.START_FALL ** 2)  # never verified


def test_step_costs():
    c = StepCosts()
    assert c.step(4) is None
    c.observe(rows=3, verify_s=2.0, fixed_s=1.0)  # bucket 4, nothing drafted
    assert c.step(4) is None and c.step(4, drafting=False) == 3.0  # no draft wait seen yet
    c.observe(rows=3, verify_s=2.0, fixed_s=1.0, wait_s=0.5)
    assert c.step(4) == 3.5 and c.step(2) == 1.5 + 2.0 * 2 / 4  # below every measured bucket: in proportion to rows
    assert c.step(16) == 1.5 + 2.0 * 16 / 4  # above them: the same
    c.observe(rows=20, verify_s=8.0, fixed_s=1.0, wait_s=0.5)  # bucket 32
    assert c.step(16) == pytest.approx(1.5 + 2.0 + (8.0 - 2.0) * (16 - 4) / (32 - 4))  # between two: interpolated
    c.observe(rows=4, verify_s=4.0, fixed_s=1.0)
    assert c.verify[4] == pytest.approx(2.0 + 0.2 * 2.0) and c.wait == 0.5
    assert c.fixed == pytest.approx(1.0)


def _draft(n: int) -> Draft:
    return Draft(list(range(100, 100 + n)), list(range(n)))  # a chain: node i's parent is i - 1


def test_adaptive_budget_trims_useless_nodes_and_explores():
    """A drafter whose nodes are never accepted, rows that cost: the trees are cut to nothing, except on the
    exploration steps, which verify every node."""
    b = AdaptiveBudget(max_nodes=8)
    for rows in (1, 2, 4, 8, 16):  # a second row costs a quarter of a one-row step
        b.costs.observe(rows=rows, verify_s=1.0 + rows * 0.5, fixed_s=0.4, wait_s=0.1)
    kept = []
    for step in range(3 * EXPLORE_EVERY):
        n = len(b.trim({"s": _draft(8)}, sessions=1, fixed_rows=1)["s"].tokens)
        kept.append(n)
        b.record("s", n, [0])  # only the root: nothing accepted
    assert [kept[i] for i in range(0, len(kept), EXPLORE_EVERY)] == [8, 8, 8]
    # after the first exploration period (the optimistic prior fades), most other steps verify nothing; some
    # re-include a node as the session's old misses decay (SESSION_DECAY), and lose it again
    rest = [n for i, n in enumerate(kept) if i % EXPLORE_EVERY and i > EXPLORE_EVERY]
    assert rest.count(0) >= 0.6 * len(rest) and sum(rest) <= 0.2 * 8 * len(rest), kept


def test_adaptive_budget_keeps_accepted_nodes():
    """Every node accepted and rows nearly free: the whole tree is verified every step."""
    b = AdaptiveBudget(max_nodes=8)
    for rows in (1, 2, 4, 8, 16):
        b.costs.observe(rows=rows, verify_s=1.0 + rows * 1e-3, fixed_s=0.4, wait_s=0.1)
    for step in range(40):
        trimmed = b.trim({"s": _draft(8)}, sessions=1, fixed_rows=1)["s"]
        assert len(trimmed.tokens) == 8 and trimmed.parents == list(range(8))
        b.record("s", 8, list(range(9)))
    b.forget("s")
    assert "s" not in b.sessions


def test_fixed_cost_is_measured_between_back_to_back_steps():
    b = AdaptiveBudget(max_nodes=4)
    b.observe_step(rows=5, verify_s=2.0, wait_s=0.25, start=0.0, end=3.0)
    assert b.costs.step(5) is None  # counted once the next step starts
    b.observe_step(rows=1, verify_s=1.0, wait_s=None, start=3.01, end=4.5)  # a 3.01 s cycle: 2.0 verify, 0.25 wait
    assert b.costs.verify == {8: 2.0} and b.costs.fixed == pytest.approx(0.76) and b.costs.wait == 0.25
    b.observe_step(rows=1, verify_s=1.0, wait_s=None, start=100.0, end=101.0)  # after an idle gap: not a cycle
    assert b.costs.verify == {8: 2.0}


def test_draft_pays_only_when_the_trees_return_their_wait():
    """Root-only steps save the draft wait. A drafter whose nodes are never accepted is not waited for (except on
    exploration steps); one whose nodes mostly are, is."""
    b = AdaptiveBudget(max_nodes=8)
    for rows in (1, 2, 4, 8):
        b.costs.observe(rows=rows, verify_s=1.0 + 0.1 * rows, fixed_s=0.5, wait_s=1.0)
    assert b.draft_pays([("s", 8)])  # step 0 of a session explores
    for _ in range(30):
        b.record("s", 8, [0])  # nothing accepted
    b.sessions["s"].steps = 1  # not an exploration step
    assert not b.draft_pays([("s", 8)])
    b.sessions["s"].steps = EXPLORE_EVERY
    assert b.draft_pays([("s", 8)])
    for _ in range(30):
        b.record("t", 8, [0, 1, 2, 3, 4])  # four of eight accepted every step
    b.sessions["t"].steps = 1
    assert b.draft_pays([("t", 8)])
    assert AdaptiveBudget(max_nodes=8).draft_pays([("u", 8)])  # no cost measured yet


def test_plan_made_during_the_forward_is_what_the_next_step_uses():
    """plan_next runs before the step's records (one step stale) and counts the step being recorded: an
    exploration step planned this way is the one the direct decision would explore."""
    b = AdaptiveBudget(max_nodes=8)
    for rows in (1, 2, 4, 8, 16):  # a second row costs a quarter of a one-row step
        b.costs.observe(rows=rows, verify_s=1.0 + rows * 0.5, fixed_s=0.4, wait_s=1.0)
    for _ in range(EXPLORE_EVERY - 1):
        b.record("s", 8, [0])  # nothing ever accepted
    b.plan_next([("s", 8)])  # during the forward of the session's 16th verify step
    b.record("s", 8, [0])
    assert b.draft_pays([("s", 8)])  # the 17th step (verified steps 16) explores...
    assert len(b.trim({"s": _draft(8)}, sessions=1, fixed_rows=1)["s"].tokens) == 8  # ...with its whole tree
    b.plan_next([("s", 8)])
    b.record("s", 8, [0])
    assert not b.draft_pays([("s", 8)])  # the next one skips the drafter
    assert b.trim({"s": _draft(8)}, sessions=1, fixed_rows=1)["s"].tokens == []
    assert b._plan is None  # a plan serves one step
    b.sessions["s"].steps = 3
    assert b.trim({"s": _draft(8)}, sessions=1, fixed_rows=1)["s"].tokens == []  # decided now, the same way


def test_with_only_the_whole_tree_measured_root_only_steps_get_tried():
    """Pure DDTree traffic measures the whole tree's bucket first (the exploration step): smaller buckets are then
    taken as cheap as their rows make them, so that a root-only step is tried (and measured) when nodes do not land."""
    b = AdaptiveBudget(max_nodes=16)
    b.costs.observe(rows=17, verify_s=4.0, fixed_s=0.5, wait_s=1.0)  # bucket 32 only
    for _ in range(10):
        b.record("s", 16, [0])  # nothing accepted
    b.sessions["s"].steps = 3
    assert not b.draft_pays([("s", 16)])
    b.costs.observe(rows=1, verify_s=3.0, fixed_s=0.5)  # measured: a root-only step costs most of the whole tree
    assert b.costs.step(1, drafting=False) == pytest.approx(0.5 + 3.0)
