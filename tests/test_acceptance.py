"""Acceptance against independent references: brute-force path search for the walk, a per-row loop
for the filters, and exact sequence probabilities (chi-square) for sample-and-walk."""

import itertools
import math
import random

import pytest
import torch

from verifier_service.acceptance import SessionRng, filter_probs, forced_walk, sample_with_uniforms, walk_tree


def random_tree(rng: random.Random, n: int, vocab: int):
    """n nodes, parents[i-1] in [0, i), siblings distinct."""
    tokens, parents, used = [], [], {}
    while len(tokens) < n:
        par = rng.randrange(len(tokens) + 1)
        free = [t for t in range(vocab) if t not in used.setdefault(par, set())]
        if not free:
            continue
        t = rng.choice(free)
        used[par].add(t)
        tokens.append(t)
        parents.append(par)
    return tokens, parents


def brute_force_walk(tokens, parents, target):
    """Deepest node whose every edge matches the target token of the edge's parent row."""
    def path(i):
        out = []
        while i:
            out.append(i)
            i = parents[i - 1]
        return out[::-1]
    best = []
    for i in range(1, len(tokens) + 1):
        p, prev, ok = path(i), 0, True
        for node in p:
            ok &= tokens[node - 1] == target[prev]
            prev = node
        if ok and len(p) > len(best):
            best = p
    last = best[-1] if best else 0
    return [0, *best], [tokens[n - 1] for n in best] + [target[last]]


@pytest.mark.parametrize("seed", range(200))
def test_walk_equals_brute_force(seed):
    rng = random.Random(seed)
    n, vocab = rng.choice([0, 1, 2, 7, 31, 64]), rng.choice([2, 3, 5, 50])
    tokens, parents = random_tree(rng, min(n, 200), vocab)
    target = [rng.randrange(vocab) for _ in range(len(tokens) + 1)]
    # bias the targets towards the tree so long paths occur
    for i, (t, p) in enumerate(zip(tokens, parents)):
        if rng.random() < 0.7:
            target[p] = t
    walk = walk_tree(tokens, parents, target)
    rows, emitted = brute_force_walk(tokens, parents, target)
    assert walk.accepted_rows == rows
    assert walk.tokens == emitted


def naive_filter(logits, temperature, top_k, top_p, min_p=0.0):
    out = []
    for row in logits.double().tolist():
        x = [v / temperature for v in row]
        if min_p > 0:  # vLLM's min-p: a token stays if its probability is >= min_p x the top token's
            z = sum(math.exp(v) for v in x)
            top = max(math.exp(v) / z for v in x)
            x = [v if math.exp(v) / z >= min_p * top else -math.inf for v in x]
        order = sorted(range(len(x)), key=lambda i: -x[i])
        keep = set(order[:top_k]) if 0 < top_k < len(x) else set(order)
        kth = min(x[i] for i in keep)
        keep = {i for i in range(len(x)) if x[i] >= kth}
        z = sum(math.exp(x[i]) for i in keep)
        p = [math.exp(x[i]) / z if i in keep else 0.0 for i in range(len(x))]
        if top_p < 1:
            mass, kept = 0.0, set()
            for i in sorted(range(len(x)), key=lambda i: -p[i]):
                if mass >= top_p:
                    break
                kept.add(i)
                mass += p[i]
            p = [p[i] if i in kept else 0.0 for i in range(len(x))]
            z = sum(p)
            p = [v / z for v in p]
        out.append(p)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 3, 0.5, 0.0), (0.5, 1, 1.0, 0.0),
    (2.0, 0, 0.05, 0.0), (1.0, 0, 1.0, 0.1), (0.7, 0, 1.0, 0.3), (1.5, 8, 0.9, 0.05), (1.0, 0, 0.6, 0.2),
    (1.0, 0, 1.0, 1.0)])  # min_p 1: only the top token (and ties)
def test_filter_matches_per_row_reference(temperature, top_k, top_p, min_p):
    logits = torch.randn(6, 23, generator=torch.Generator().manual_seed(1)) * 3
    got = filter_probs(logits, temperature, top_k, top_p, min_p)
    want = naive_filter(logits, temperature, top_k, top_p, min_p)
    assert torch.allclose(got.double(), want, atol=1e-6)
    if min_p > 0:  # the filter really drops tokens here (the case is not vacuous)
        assert (want == 0).sum() > (naive_filter(logits, temperature, top_k, top_p) == 0).sum()


def test_inverse_cdf_never_picks_zero_mass():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 5)
    u = torch.tensor([0.0, 0.25, 0.5, 0.999999, 1 - 1e-17])
    assert sample_with_uniforms(probs, u).tolist() == [1, 1, 3, 3, 3]


V, L = 3, 3


def target_logits(context: tuple) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(context) & 0xFFFF_FFFF)
    return torch.randn(V, generator=g) * 1.5


def decode(seed: int, tree_rng: random.Random | None, params=(1.0, 0, 1.0)) -> tuple:
    """Sample-and-walk over random draft trees (None = plain AR, root-only) until L tokens."""
    sr, prefix, out = SessionRng(seed), (0,), []
    while len(out) < L:
        tokens, parents = random_tree(tree_rng, tree_rng.randrange(0, 9), V) if tree_rng else ([], [])
        ctx = [prefix]
        depth = [0]
        for t, p in zip(tokens, parents):
            ctx.append(ctx[p] + (t,))
            depth.append(depth[p] + 1)
        probs = filter_probs(torch.stack([target_logits(c) for c in ctx]), *params)
        u = sr.peek(max(depth) + 1)[torch.tensor(depth)]
        walk = walk_tree(tokens, parents, sample_with_uniforms(probs, u).tolist())
        sr.advance(len(walk.tokens))
        out += walk.tokens
        prefix += tuple(walk.tokens)
    return tuple(out[:L])


def exact_probs(params=(1.0, 0, 1.0)) -> dict:
    probs = {}
    for seq in itertools.product(range(V), repeat=L):
        p, ctx = 1.0, (0,)
        for t in seq:
            p *= float(filter_probs(target_logits(ctx).unsqueeze(0), *params)[0, t])
            ctx += (t,)
        probs[seq] = p
    return probs


def chi_square_p(counts: dict, probs: dict, n: int) -> float:
    cells = [s for s in probs if probs[s] * n >= 5]
    stat = sum((counts.get(s, 0) - probs[s] * n) ** 2 / (probs[s] * n) for s in cells)
    rest = n - sum(counts.get(s, 0) for s in cells)
    rest_p = 1 - sum(probs[s] for s in cells)
    if rest_p * n >= 5:
        stat += (rest - rest_p * n) ** 2 / (rest_p * n)
        cells.append(None)
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("params", [(1.0, 0, 1.0), (0.8, 2, 0.9), (1.2, 0, 1.0, 0.3)])
def test_sample_and_walk_matches_sequential_sampling(params):
    n = 3000
    counts: dict = {}
    tree_rng = random.Random(7)
    for seed in range(n):
        seq = decode(seed, tree_rng, params)
        counts[seq] = counts.get(seq, 0) + 1
    probs = exact_probs(params)
    assert set(counts) <= {s for s, p in probs.items() if p > 0}, "emitted a sequence of probability 0"
    p_value = chi_square_p(counts, probs, n)
    assert p_value > 0.01, f"chi-square p = {p_value}"


def test_seeded_output_is_independent_of_trees():
    """Same seed: identical tokens with any draft trees and with plain AR (uniform k ↔ position k)."""
    for seed in range(50):
        ar = decode(seed, None)
        assert decode(seed, random.Random(seed)) == ar
        assert decode(seed, random.Random(seed + 1000)) == ar


def test_forced_walk_accepts_the_first_path_to_the_depth():
    """TEST ONLY switch: the path to the first (best-first: most probable) node at the depth, drafted tokens
    whatever the target says, then the target's token there; a shallower tree gives its deepest path."""
    tokens, parents = [10, 11, 12, 13, 14], [0, 0, 2, 1, 3]  # depth 2: rows 3 (under 2) and 4 (under 1)
    targets = [50, 51, 52, 53, 54, 55]
    w = forced_walk(tokens, parents, targets, 2)
    assert (w.accepted_rows, w.tokens, w.bonus_row) == ([0, 2, 3], [11, 12, 53], 3)
    assert forced_walk(tokens, parents, targets, 1).tokens == [10, 51]
    w = forced_walk(tokens, parents, targets, 7)
    assert (w.accepted_rows, w.tokens) == ([0, 2, 3, 5], [11, 12, 14, 55])
    assert forced_walk([], [], [7], 3) == walk_tree([], [], [7])  # no draft: plain AR
