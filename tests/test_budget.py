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


def pool_adjacent_violators(x: list[float]) -> list[float]:
    """Reference: pools each rising run into its mean until the sequence does not increase."""
    pools: list[list[float]] = []  # [sum, count]
    for v in x:
        pools.append([v, 1])
        while len(pools) > 1 and pools[-2][0] / pools[-2][1] < pools[-1][0] / pools[-1][1]:
            total, count = pools.pop()
            pools[-1][0] += total
            pools[-1][1] += count
    return [total / count for total, count in pools for _ in range(count)]


@pytest.mark.parametrize("seed", range(20))
def test_non_increasing_is_pool_adjacent_violators(seed):
    rng = np.random.default_rng(seed)
    x = rng.random(int(rng.integers(0, 65))) * rng.choice([1.0, 0.01])
    y = non_increasing(x)
    assert y.tolist() == pytest.approx(pool_adjacent_violators(x.tolist()), rel=1e-9, abs=1e-12)
    assert (np.diff(y) <= 1e-12).all() and y.sum() == pytest.approx(x.sum())
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
    # node 3: (0 + 2 * 0.5) / (200 + 2); node 4 (never verified, the prior 0.5) rises above it: pooled, same sum
    assert r[2] == r[3] == pytest.approx((1.0 / 202 + 0.5) / 2)
    acc.record(2, [3], decay=1.0)  # a node outside the verified ones is ignored
    assert acc.hits[2] == 0


def test_global_acceptance_moves_towards_outcomes():
    g = GlobalAcceptance(3, start=0.9)
    for _ in range(500):
        g.record(2, [1])
    assert g.rate[0] == pytest.approx(1.0, abs=1e-3) and g.rate[1] == pytest.approx(0.0, abs=1e-3)
    assert g.rate[2] == 0.9  # never verified


def test_step_costs():
    c = StepCosts()
    assert c.step(4) is None
    c.observe(rows=3, verify_s=2.0, fixed_s=1.0)  # bucket 4
    assert c.step(4) == 3.0 and c.step(2) == 3.0  # a larger bucket bounds a smaller one
    assert c.step(16) == 1.0 + 2.0 * 16 / 4  # above every measured bucket: linear in rows
    c.observe(rows=4, verify_s=4.0, fixed_s=1.0)
    assert c.verify[4] == pytest.approx(2.0 + 0.2 * 2.0)


def _draft(n: int) -> Draft:
    return Draft(list(range(100, 100 + n)), list(range(n)))  # a chain: node i's parent is i - 1


def test_adaptive_budget_trims_useless_nodes_and_explores():
    """A drafter whose nodes are never accepted, rows that cost: the trees are cut to nothing, except on the
    exploration steps, which verify every node."""
    b = AdaptiveBudget(max_nodes=8)
    b.costs.observe(rows=1, verify_s=1.0, fixed_s=0.5)
    for rows in (2, 4, 8, 16):
        b.costs.observe(rows=rows, verify_s=1.0 + rows * 0.2, fixed_s=0.5)
    kept = []
    for step in range(3 * EXPLORE_EVERY):
        n = len(b.trim({"s": _draft(8)}, sessions=1, fixed_rows=1)["s"].tokens)
        kept.append(n)
        b.record("s", n, [0])  # only the root: nothing accepted
    assert [kept[i] for i in range(0, len(kept), EXPLORE_EVERY)] == [8, 8, 8]
    # after the first exploration period (the optimistic prior fades), nearly every other step verifies nothing;
    # a few re-include nodes as the session's old misses decay
    rest = [n for i, n in enumerate(kept) if i % EXPLORE_EVERY and i > EXPLORE_EVERY]
    assert rest.count(0) >= 0.8 * len(rest), kept


def test_adaptive_budget_keeps_accepted_nodes():
    """Every node accepted and rows nearly free: the whole tree is verified every step."""
    b = AdaptiveBudget(max_nodes=8)
    for rows in (1, 2, 4, 8, 16):
        b.costs.observe(rows=rows, verify_s=1.0 + rows * 1e-3, fixed_s=0.5)
    for step in range(40):
        trimmed = b.trim({"s": _draft(8)}, sessions=1, fixed_rows=1)["s"]
        assert len(trimmed.tokens) == 8 and trimmed.parents == list(range(8))
        b.record("s", 8, list(range(9)))
    b.forget("s")
    assert "s" not in b.sessions


def test_fixed_cost_is_measured_between_back_to_back_steps():
    b = AdaptiveBudget(max_nodes=4)
    b.observe_step(rows=5, verify_s=2.0, start=0.0, end=3.0)
    assert b.costs.step(5) is None  # counted once the next step starts
    b.observe_step(rows=1, verify_s=1.0, start=3.01, end=4.5)  # 3.01 s cycle, 2.0 of it verify
    assert b.costs.verify == {8: 2.0} and b.costs.fixed == pytest.approx(1.01)
    b.observe_step(rows=1, verify_s=1.0, start=100.0, end=101.0)  # after an idle gap: not a cycle
    assert b.costs.verify == {8: 2.0}
