"""Tree verify: every node's logits equal a plain causal run of prefix + its ancestor path, recomputed
from scratch; after `commit` the session's cache rows equal a fresh prefill of the same tokens."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from model_fixtures import new_cache, prefill, single_thread, tiny_dir, tiny_model  # noqa: F401

from verifier_service.kv_cache import PagedKVCache
from verifier_service.plan import SeqRows, build_plan, chain_parents

PAGE = 4
# (tree rows incl. the root, committed prefix length): prefixes on and off page boundaries.
CASES = [(1, 4), (2, 5), (7, 8), (31, 13), (64, 16)]
TOL = 1e-5


@dataclass(frozen=True)
class Tree:
    sid: str
    prefix: list[int]
    tokens: list[int]  # row 0 = root (the pending bonus token)
    parents: list[int]  # row parents, -1 for the root


def random_tree(n: int, g: torch.Generator) -> list[int]:
    """Random shape: per tree a random chance of extending the newest row (deep) vs any row (bushy)."""
    chainy = torch.rand(1, generator=g).item()
    parents = [-1]
    for i in range(1, n):
        deep = torch.rand(1, generator=g).item() < chainy
        parents.append(i - 1 if deep else int(torch.randint(0, i, (1,), generator=g)))
    return parents


def path_to(parents: list[int], row: int) -> list[int]:
    path = []
    while row >= 0:
        path.append(row)
        row = parents[row]
    return path[::-1]


def tokens(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(4, 500, (n,), generator=g).tolist()


def verify_batch(model, seed: int):
    """Prefill every session's prefix, then verify all trees (plus one plain prefill chunk) in ONE forward."""
    g = torch.Generator().manual_seed(seed)
    cache = new_cache(model, num_pages=256, page_size=PAGE)
    trees, seqs = [], []
    for n, p in CASES:
        tree = Tree(f"s{n}", tokens(g, p), tokens(g, n), random_tree(n, g))
        prefill(model, cache, tree.sid, tree.prefix)
        slots = cache.table.scratch(tree.sid, n)
        seqs.append(SeqRows(tree.tokens, tree.parents, p, cache.table.pages(tree.sid), slots))
        trees.append(tree)
    chunk = tokens(g, 9)  # a new session's prefill rides in the same batch
    cache.table.open("new")
    seqs.append(SeqRows(chunk, chain_parents(9), 0, [], cache.table.extend("new", 9)))
    seqs[-1] = SeqRows(chunk, chain_parents(9), 0, cache.table.pages("new"), seqs[-1].write_slots)
    logits = model.forward(build_plan(seqs), cache.kv).logits
    return cache, trees, chunk, logits


def fresh_logits(model, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Each sequence as its own causal run from position 0, in a fresh cache (explicit MLA)."""
    cache = new_cache(model, num_pages=1024, page_size=PAGE)
    seqs = []
    for i, s in enumerate(sequences):
        cache.table.open(i)
        slots = cache.table.extend(i, len(s))
        seqs.append(SeqRows(s, chain_parents(len(s)), 0, cache.table.pages(i), slots))
    out = model.forward(build_plan(seqs, explicit_mla=True), cache.kv).logits
    return list(out.split([len(s) for s in sequences]))


def test_tree_rows_equal_their_ancestor_paths(tiny_model):
    _, trees, chunk, logits = verify_batch(tiny_model, seed=11)
    starts = torch.tensor([0] + [len(t.tokens) for t in trees]).cumsum(0).tolist()
    for tree, start in zip(trees, starts):
        paths = [path_to(tree.parents, r) for r in range(len(tree.tokens))]
        assert max(len(p) for p in paths) > 1 or len(tree.tokens) == 1
        refs = fresh_logits(tiny_model, [tree.prefix + [tree.tokens[r] for r in p] for p in paths])
        expect = torch.stack([ref[-1] for ref in refs])  # [n, V]: the node's own row
        got = logits[start:start + len(tree.tokens)]
        err = ((got - expect).norm(dim=-1) / expect.norm(dim=-1)).max().item()
        assert err < TOL, (tree.sid, err)
        assert got.argmax(-1).tolist() == expect.argmax(-1).tolist()
    (ref_chunk,) = fresh_logits(tiny_model, [chunk])
    assert ((logits[starts[-1]:] - ref_chunk).norm() / ref_chunk.norm()).item() < TOL


@pytest.mark.parametrize("seed", [21, 22])
def test_commit_equals_fresh_prefill(tiny_model, seed):
    cache, trees, _, _ = verify_batch(tiny_model, seed=seed)
    g = torch.Generator().manual_seed(seed)
    free_before = cache.table.num_free
    fresh = new_cache(tiny_model, num_pages=256, page_size=PAGE)
    scratch_pages = 0
    for tree in trees:
        scratch_pages += len(cache.table._session(tree.sid).scratch_pages)
        leaf = int(torch.randint(0, len(tree.tokens), (1,), generator=g))
        accepted = path_to(tree.parents, leaf)
        cache.commit(tree.sid, accepted)
        committed = tree.prefix + [tree.tokens[r] for r in accepted]
        assert cache.table.length(tree.sid) == len(committed)
        prefill(tiny_model, fresh, tree.sid, committed)
        got = cache.rows(cache.table.slots(tree.sid, 0, len(committed)))  # [L, n, 576]
        want = fresh.rows(fresh.table.slots(tree.sid, 0, len(committed)))
        # Layer 0 depends on the tokens only (GEMM batch shapes differ, so not bit-exact).
        assert torch.allclose(got[0], want[0], atol=1e-5, rtol=0), (tree.sid, (got[0] - want[0]).abs().max())
        assert torch.allclose(got, want, atol=1e-5, rtol=0), tree.sid
        # The committed cache serves the next step: decode the bonus token against it.
        bonus = tokens(g, 1)
        step = prefill(tiny_model, cache, tree.sid, bonus, explicit=False).logits
        (ref,) = fresh_logits(tiny_model, [committed + bonus])
        assert ((step[0] - ref[-1]).norm() / ref[-1].norm()).item() < TOL
    assert scratch_pages > 0
    assert all(cache.table._session(t.sid).scratch_pages == [] for t in trees)
    grown = sum(len(cache.table.pages(t.sid)) for t in trees)
    assert cache.table.num_free + grown - scratch_pages >= free_before - 1  # scratch returned to the pool


def test_cache_written_rows_match_plan_slots(tiny_model):
    """The forward writes exactly the plan's slots, nothing else."""
    cache = PagedKVCache(num_layers=tiny_model.cfg.num_hidden_layers, width=tiny_model.cfg.kv_cache_width,
                         num_pages=8, page_size=PAGE, dtype=torch.float32)
    cache.kv.fill_(7.0)
    prefill(tiny_model, cache, "a", [5, 6, 7, 8, 9])
    written = (cache.kv != 7.0).any(-1).any(0).flatten()  # [slots]
    assert written.nonzero().flatten().tolist() == cache.table.slots("a", 0, 5)
