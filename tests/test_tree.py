"""DDTree builder against brute force: the tree must be exactly the N most probable prefixes."""

import numpy as np
import pytest
import torch

from drafter_service.tree import build_tree, topk_logprobs

# (vocab, depth) pairs whose full prefix set (Σ V^d) stays enumerable
SHAPES = [(50, 1), (50, 2), (50, 3), (20, 4), (10, 5), (6, 6), (5, 7), (3, 7), (2, 7), (1, 7), (7, 3)]


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _all_prefixes(logq: np.ndarray) -> tuple[list[tuple[int, ...]], np.ndarray]:
    """Every token prefix of length 1..L and its log product of marginals, best first (ties: shallower
    first). Sums run depth by depth in float64, the same association order as the builder."""
    depth, vocab = logq.shape
    paths, scores = [], []
    level = np.zeros(())
    for d in range(depth):
        level = level[..., None] + logq[d]  # [V] * (d + 1)
        flat = level.reshape(-1)
        scores.append(flat)
        paths.extend(np.array(np.unravel_index(np.arange(flat.size), level.shape)).T.tolist())
    scores = np.concatenate(scores)
    depths = np.array([len(p) for p in paths])
    order = np.lexsort((depths, -scores))
    return [tuple(paths[i]) for i in order], scores[order]


def _host_table(logq: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-K (K = min(N, V)) per depth, sorted best first, computed with numpy (not the device helper)."""
    k = min(budget, logq.shape[1])
    order = np.argsort(-logq, axis=1, kind="stable")[:, :k]
    return order.astype(np.int64), np.take_along_axis(logq, order, axis=1).astype(np.float32)


def _paths(tree) -> list[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = [()]  # index 0 = root
    for tok, parent in zip(tree.tokens.tolist(), tree.parents.tolist()):
        paths.append(paths[parent] + (tok,))
    return paths[1:]


def _check_structure(tree, depth: int, budget: int) -> None:
    n = len(tree)
    assert n <= budget
    for i in range(1, n + 1):
        parent = int(tree.parents[i - 1])
        assert 0 <= parent < i, f"node {i} has parent {parent}"
        expected_depth = 1 if parent == 0 else int(tree.depths[parent - 1]) + 1
        assert tree.depths[i - 1] == expected_depth
        assert 1 <= tree.depths[i - 1] <= depth
    siblings = {}
    for i in range(n):
        key = (int(tree.parents[i]), int(tree.tokens[i]))
        assert key not in siblings, f"duplicate child token {key}"
        siblings[key] = i


@pytest.mark.parametrize("vocab,depth", SHAPES)
def test_tree_is_top_n_prefixes(vocab, depth):
    rng = np.random.default_rng(vocab * 100 + depth)
    # float32 log-probs, as the device hands them over
    logq = _log_softmax(rng.normal(0, 2.0, size=(depth, vocab))).astype(np.float32).astype(np.float64)
    ranked, scores = _all_prefixes(logq)
    budgets = {1, 2, 3, 7, 16, 33, 64}
    if len(ranked) <= 20000:  # the complete tree, and a budget beyond it
        budgets |= {len(ranked), len(ranked) + 5}
    for budget in sorted(budgets):
        if vocab > 1 and budget < len(ranked):  # no tie at the cut (V = 1 ties everywhere, on purpose)
            assert scores[budget - 1] - scores[budget] > 1e-12
        tree = build_tree(*_host_table(logq, budget), budget)
        _check_structure(tree, depth, budget)
        assert set(_paths(tree)) == set(ranked[:budget]), f"V={vocab} L={depth} N={budget}"
        assert len(tree) == min(budget, len(ranked))  # N ≥ all prefixes → the complete tree


def test_nodes_come_in_score_order():
    logq = _log_softmax(np.random.default_rng(7).normal(size=(4, 9)))
    ranked, _ = _all_prefixes(logq)
    tree = build_tree(*_host_table(logq, 40), 40)
    assert _paths(tree) == ranked[:40]  # index order = score order, so parents precede children


@pytest.mark.parametrize("seed", range(5))
def test_chain_mode_is_per_position_argmax(seed):
    rng = np.random.default_rng(seed)
    logq = _log_softmax(rng.normal(size=(7, 30)))
    ids, lps = _host_table(logq, 1)
    tree = build_tree(ids, lps, 7)
    assert tree.tokens.tolist() == logq.argmax(-1).tolist()
    assert tree.parents.tolist() == list(range(7))
    assert tree.depths.tolist() == list(range(1, 8))
    assert build_tree(ids, lps, 3).tokens.tolist() == logq.argmax(-1)[:3].tolist()


def test_bad_arguments():
    ids, lps = np.zeros((3, 2), np.int64), np.zeros((3, 2), np.float32)
    with pytest.raises(ValueError, match="budget"):
        build_tree(ids, lps, -1)
    with pytest.raises(ValueError, match="must both be"):
        build_tree(ids, lps[:, :1], 4)
    assert len(build_tree(ids, lps, 0)) == 0


def test_device_topk_matches_log_softmax_and_feeds_the_builder():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 50) * 3  # [sessions, depth, vocab]
    ids, lps = topk_logprobs(logits, 12)
    assert ids.shape == lps.shape == (3, 7, 12) and ids.dtype == np.int64
    ref = torch.log_softmax(logits.double(), -1).numpy()
    for s in range(3):
        order = np.argsort(-ref[s], axis=1)[:, :12]
        np.testing.assert_array_equal(ids[s], order)
        np.testing.assert_allclose(lps[s], np.take_along_axis(ref[s], order, 1), rtol=0, atol=1e-5)
        # a session with a smaller K uses the first columns of the batch's K_max table
        small = build_tree(ids[s, :, :4], lps[s, :, :4], 4)
        assert set(_paths(small)) == set(_paths(build_tree(*_host_table(ref[s], 4), 4)))


def test_device_topk_ids_exact_for_large_vocab():
    logits = torch.full((1, 2, 163840), -5.0)
    logits[0, 0, 163837] = 5.0
    logits[0, 1, 163839] = 5.0
    ids, _ = topk_logprobs(logits, 1)
    assert ids[0, :, 0].tolist() == [163837, 163839]
