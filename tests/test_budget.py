"""Adaptive tree budget (verifier_service/budget.py) and the drafter's calibration
(verifier_service/draft_calibration.py): the node choice against brute force over every parent-closed subset, the isotonic fit against pool-adjacent-violators,
the calibration against the acceptance law that generated its observations, and the engine-facing decisions."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from verifier_service import budget, draft_calibration
from verifier_service.acceptance import tree_depths
from verifier_service.budget import EXPLORE_EVERY, AdaptiveBudget, StepCosts, choose, cut, row_bucket
from verifier_service.draft_calibration import Q_BINS, Calibration, non_increasing_rows
from verifier_service.drafter_client import Draft


def bucket_costs(rng: random.Random, fixed: float):
    """A random verify time per row bucket, non-decreasing, and the step cost it implies."""
    per, t = {}, rng.uniform(0.5, 2.0)
    for b in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        t += rng.uniform(0.0, 3.0)
        per[b] = t
    return lambda rows: fixed + per[row_bucket(rows)]


def random_tree(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(i + 1) for i in range(n)]  # node i + 1's parent, in [0, i + 1)


def closed_subsets(parents: list[int]) -> list[tuple[int, ...]]:
    """Every set of nodes (1-based) that holds each member's parent."""
    out = []
    for mask in itertools.product((False, True), repeat=len(parents)):
        nodes = tuple(i + 1 for i, m in enumerate(mask) if m)
        if all(parents[i - 1] == 0 or mask[parents[i - 1] - 1] for i in nodes):
            out.append(nodes)
    return out


def path_products(parents: list[int], c: list[float]) -> np.ndarray:
    a = [1.0]
    for i, p in enumerate(parents):
        a.append(a[p] * c[i])
    return np.array(a[1:])


@pytest.mark.parametrize("margin", [0.0, budget.MARGIN])
@pytest.mark.parametrize("seed", range(40))
def test_choose_matches_brute_force(seed, margin, monkeypatch):
    """Rates that are products over each path (a child's at most its parent's). Without a margin: the best value over
    every combination of parent-closed subsets. With it: within the margin of the best, and never fewer nodes than a
    best choice. The kept nodes are always parent-closed."""
    monkeypatch.setattr(budget, "MARGIN", margin)
    rng = random.Random(seed)
    trees = [random_tree(rng, rng.randint(0, 5)) for _ in range(rng.randint(1, 3))]
    rates = [path_products(t, [rng.choice([0.0, 1.0, 0.02, rng.random()]) for _ in t]) for t in trees]
    fixed_rows, base = len(trees) + rng.choice([0, 0, 5, 40]), float(len(trees))
    step_s = bucket_costs(rng, rng.uniform(0.0, 5.0))

    def value(sets) -> float:
        return (base + sum(float(r[np.array(s, dtype=int) - 1].sum()) for r, s in zip(rates, sets))) / \
            step_s(fixed_rows + sum(len(s) for s in sets))

    kept = choose([r.tolist() for r in rates], fixed_rows, base, step_s)
    got_sets = [tuple(k) for k in kept]
    for t, s, r in zip(trees, got_sets, rates):
        assert s in closed_subsets(t) and all(r[i - 1] > 0 for i in s)  # parent-closed, no node never accepted
    combos = list(itertools.product(*(closed_subsets(t) for t in trees)))
    values = [value(c) for c in combos]
    best = max(values)
    if margin == 0:
        assert value(got_sets) == pytest.approx(best, rel=1e-12)
    else:
        assert value(got_sets) * (1 + margin) >= best * (1 - 1e-12)
        fewest = min(sum(len(s) for s in c) for c, v in zip(combos, values) if v == best)
        assert sum(len(s) for s in got_sets) >= fewest


def test_choose_unknown_cost_and_extremes():
    assert choose([[0.9, 0.5]], 1, 1.0, lambda rows: None) is None
    flat = lambda rows: 1.0  # noqa: E731 - rows cost nothing: every useful node is verified
    assert choose([[0.9, 0.4, 0.0, 0.2]], 1, 1.0, flat) == [[1, 2, 4]]
    steep = lambda rows: float(rows)  # noqa: E731 - a row costs as much as the step: none is worth it
    assert choose([[0.3, 0.2]], 1, 1.0, steep) == [[]]


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
def test_non_increasing_rows_is_pool_adjacent_violators(seed):
    rng = np.random.default_rng(seed)
    rows, n = int(rng.integers(1, 5)), int(rng.integers(0, 30))
    x = rng.random((rows, n)) * rng.choice([1.0, 0.01])
    w = rng.random((rows, n)) * 20 + 0.1
    y = non_increasing_rows(x, w)
    for r in range(rows):
        assert y[r].tolist() == pytest.approx(pool_adjacent_violators(x[r].tolist(), w[r].tolist()), rel=1e-9,
                                              abs=1e-12)
        assert (np.diff(y[r]) <= 1e-12).all() and (w[r] * y[r]).sum() == pytest.approx((w[r] * x[r]).sum())
    got = non_increasing_rows(np.array([[0.5, 0.2, 0.4, 0.1]]), np.ones((1, 4)))
    assert got[0].tolist() == pytest.approx([0.5, 0.3, 0.3, 0.1])


def test_calibration_starts_from_the_drafters_own_probability():
    cal = Calibration()
    parents, q = [0, 1, 1, 2], [0.93, 0.51, 0.2, 0.02]
    center = [(math.floor(v * Q_BINS) + 0.5) / Q_BINS for v in q]  # each q's bin, at its middle
    got = cal.path_rates(parents, tree_depths(parents)[1:], np.log(q))
    assert got == pytest.approx(path_products(parents, center).tolist())


def test_calibration_counts_only_nodes_whose_parent_was_accepted():
    cal = Calibration()
    parents, depths = [0, 1, 0, 2, 3], [1, 2, 1, 3, 2]
    q = np.log([0.9, 0.9, 0.3, 0.9, 0.9])
    cal.record(parents, depths, q, [1, 2])  # path root -> 1 -> 2; node 4 (child of 2) tried and missed
    trials = {(d, b): cal.trials[d, b] for d, b in zip(*np.nonzero(cal.trials))}
    hits = {(d, b): cal.hits[d, b] for d, b in zip(*np.nonzero(cal.hits))}
    # tried: node 1 (depth 1, bin 18), node 3 (depth 1, bin 6), node 2 (depth 2, bin 18), node 4 (depth 3, bin 18);
    # node 5's parent (node 3) was not accepted: no trial
    assert trials == {(0, 18): 1.0, (0, 6): 1.0, (1, 18): 1.0, (2, 18): 1.0}
    assert hits == {(0, 18): 1.0, (1, 18): 1.0}


def test_calibration_learns_an_overconfident_drafter(monkeypatch):
    """Trees drawn from a known law: a node whose parent is accepted is accepted with probability q² at depth 1 and
    q / 2 deeper (siblings exclusive). After many trees the table follows that law, not the drafter's q."""
    monkeypatch.setattr(draft_calibration, "DECAY", 1.0)  # every tree counts: the law does not change here
    rng = np.random.default_rng(0)
    law = lambda d, q: q * q if d == 1 else q / 2  # noqa: E731
    cal = Calibration()
    for _ in range(6000):
        parents = [0, 0, 1, 1, 2, 3]
        depths = tree_depths(parents)[1:]
        q = rng.uniform(0.05, 0.95, len(parents)) / np.array([1, 2, 1, 2, 1, 1])  # siblings' q sum below 1
        accepted, frontier = [], {0}
        for parent in (0, 1, 2, 3):  # at most one child of an accepted node is accepted
            if parent not in frontier:
                continue
            kids = [i + 1 for i, p in enumerate(parents) if p == parent]
            u = rng.random()
            for k in kids:
                p = law(depths[k - 1], q[k - 1])
                if u < p:
                    accepted.append(k)
                    frontier.add(k)
                    break
                u -= p
        cal.record(parents, depths, np.log(q), accepted)
    centers = (np.arange(Q_BINS) + 0.5) / Q_BINS
    seen = cal.trials > 200  # cells with enough trials that the law shows within the bound below
    want = np.array([[law(d + 1, c) for c in centers] for d in range(cal.trials.shape[0])])
    assert seen[0].sum() >= 15 and seen[1].sum() >= 8
    assert np.abs(cal.table[seen] - want[seen]).max() < 0.08
    assert (np.diff(cal.table, axis=1) >= -1e-12).all()  # non-decreasing in q at every depth


@pytest.mark.parametrize("seed", range(10))
def test_cut_renumbers_a_parent_closed_subset(seed):
    rng = random.Random(seed)
    parents = random_tree(rng, rng.randint(1, 8))
    draft = Draft([100 + i for i in range(len(parents))], parents, [-0.1 * i for i in range(len(parents))])
    keep = rng.choice(closed_subsets(parents))
    small = cut(draft, list(keep))
    assert small.tokens == [100 + i - 1 for i in keep] and small.logprobs == [-0.1 * (i - 1) for i in keep]
    new_of = {0: 0, **{old: new + 1 for new, old in enumerate(keep)}}
    assert small.parents == [new_of[parents[i - 1]] for i in keep]


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


def chain(n: int, q: float = 0.9) -> Draft:
    """A chain of n nodes (node i's parent is i - 1), each with the drafter's q."""
    return Draft(list(range(100, 100 + n)), list(range(n)), [math.log(q)] * n)


def costly_rows(b: AdaptiveBudget, per_row: float, wait: float = 0.1) -> None:
    for rows in (1, 2, 4, 8, 16):
        b.costs.observe(rows=rows, verify_s=1.0 + rows * per_row, fixed_s=0.4, wait_s=wait)


def test_a_confident_drafter_that_misses_is_cut_and_not_waited_for():
    """Nodes the drafter is sure of that never land: soon they are not verified, and the drafter is waited for ever
    less often, then after every 16 root-only steps."""
    b = AdaptiveBudget()
    costly_rows(b, per_row=0.5, wait=1.0)
    kept, waited = [], []
    for step in range(6 * EXPLORE_EVERY):
        waited.append(b.draft_pays(["s"]))
        n = len(b.trim({"s": chain(8, q=0.97)}, sessions=1, fixed_rows=1)["s"].tokens) if waited[-1] else 0
        kept.append(n)
        b.plan_next(["s"])  # during the forward: learns from the trees recorded so far
        b.record("s", n, [0])  # only the root: nothing accepted
    assert kept[0] == 7 and all(n == 0 for n in kept[2 * EXPLORE_EVERY:])  # the first tree fills the 8-row bucket
    first_skip = waited.index(False)
    assert first_skip <= EXPLORE_EVERY
    gaps = np.diff([i for i, w in enumerate(waited) if w and i > first_skip]).tolist()
    # the waits come further apart (2, 4, 8, 16 root-only steps between them), then every 16
    assert gaps == sorted(gaps) and gaps[-3:] == [EXPLORE_EVERY + 1] * 3, waited


def test_accepted_nodes_are_kept_when_rows_are_cheap():
    b = AdaptiveBudget()
    costly_rows(b, per_row=1e-3)
    for step in range(40):
        trimmed = b.trim({"s": chain(8, q=0.6)}, sessions=1, fixed_rows=1)["s"]
        assert len(trimmed.tokens) == 8 and trimmed.parents == list(range(8))
        b.record("s", 8, list(range(9)))
    assert b.draft_pays(["s"])
    b.forget("s")
    assert "s" not in b.sessions


def test_each_tree_is_cut_by_its_own_confidence():
    """Same session, same calibration, one step apart: a tree the drafter is sure of keeps more nodes than one it
    doubts."""
    b = AdaptiveBudget()
    costly_rows(b, per_row=0.05)
    sure = b.trim({"s": chain(8, q=0.98)}, sessions=1, fixed_rows=1)["s"]
    doubt = b.trim({"s": chain(8, q=0.3)}, sessions=1, fixed_rows=1)["s"]
    # doubt: a = 0.325, 0.106, 0.034 (q = 0.3 is bin [0.3, 0.35)); 3 nodes in the 4-row bucket give 1.465 tokens in
    # 0.5 + 1.2 s = 0.862/s, against 1 node 1.325 / 1.6 = 0.828/s and 7 nodes 1.49 / 1.9 = 0.78/s
    assert len(sure.tokens) == 7 and len(doubt.tokens) == 3


def test_sampled_sessions_learn_their_own_calibration():
    b = AdaptiveBudget()
    costly_rows(b, per_row=0.5)
    for _ in range(50):
        n = len(b.trim({"t": chain(4, q=0.9)}, sessions=1, fixed_rows=1)["t"].tokens)
        b.record("t", n, [0], sampled=True)  # a sampled session's nodes never land
        b.learn()
    assert b.calibration[True].trials.sum() > 0 and b.calibration[False].trials.sum() == 0
    assert len(b.trim({"t": chain(4, q=0.9)}, sessions=1, fixed_rows=1)["t"].tokens) == 0
    assert len(b.trim({"g": chain(4, q=0.9)}, sessions=1, fixed_rows=1)["g"].tokens) == 3  # greedy: still the prior


def test_fixed_cost_is_measured_between_back_to_back_steps():
    b = AdaptiveBudget()
    b.observe_step(rows=5, verify_s=2.0, wait_s=0.25, start=0.0, end=3.0)
    assert b.costs.step(5) is None  # counted once the next step starts
    b.observe_step(rows=1, verify_s=1.0, wait_s=None, start=3.01, end=4.5)  # a 3.01 s cycle: 2.0 verify, 0.25 wait
    assert b.costs.verify == {8: 2.0} and b.costs.fixed == pytest.approx(0.76) and b.costs.wait == 0.25
    b.observe_step(rows=1, verify_s=1.0, wait_s=None, start=100.0, end=101.0)  # after an idle gap: not a cycle
    assert b.costs.verify == {8: 2.0}


def test_draft_pays_weighs_expected_tokens_against_the_wait():
    b = AdaptiveBudget()
    costly_rows(b, per_row=0.1, wait=1.0)
    assert AdaptiveBudget().draft_pays(["u"])  # nothing known yet
    assert b.draft_pays(["s"])  # a session's first step
    st = b._state("s")
    st.tokens, st.rows = 1.2, 1.0  # 1.2 tokens a drafted step of 2 rows
    # drafting: 1.2 / (0.4 + 1.0 + 1.2) = 0.46 tokens/s; root-only 1 / (0.4 + 1.1) = 0.67
    assert not b.draft_pays(["s"])
    st.idle = st.gap
    assert b.draft_pays(["s"])  # exploration
    st.idle, st.tokens = 0, 3.0  # 3 / 2.6 = 1.15 tokens/s
    assert b.draft_pays(["s"])


def test_the_plan_made_during_the_forward_serves_the_next_step_once():
    """plan_next runs before the step's record and counts it: after a root-only step one more idle step, after a
    drafted one none."""
    b = AdaptiveBudget()
    costly_rows(b, per_row=0.1, wait=1.0)
    st = b._state("s")
    st.tokens, st.rows, st.idle, st.gap = 1.0, 1.0, 3, 4  # drafting does not pay; due to explore after 4 idle
    b.plan_next(["s"])  # during the forward of a root-only step (the session's 4th idle one)
    b.record("s", 0, [0])
    assert b._plan is not None and b.draft_pays(["s"])  # explores
    assert b._plan is None  # a plan serves one step
    b.trim({"s": chain(8, q=0.01)}, sessions=1, fixed_rows=1)  # the exploring step drafts a tree of little use
    b.plan_next(["s"])
    b.record("s", 0, [0])
    assert st.idle == 0 and st.gap == 8  # it did not pay: the next wait comes after 8 root-only steps
    assert not b.draft_pays(["s"])
    assert not b.draft_pays(["s"])  # without a plan the decision is made now, the same way
    assert b.draft_pays(["s", "new"])  # a session the plan did not cover: decided now (new: drafts)
