"""DrafterEngine API: per-item errors never fail the batch, batching equals one-by-one, chain mode, info."""

import numpy as np
import pytest
import torch

from drafter_service.engine import (DraftMode, DrafterEngine, EngineOptions, ItemError, Proposal, ProposeItem,
                                    ResyncRequired, UnknownSessionError)
from drafter_service.tiny_checkpoint import write_tiny_drafter, write_tiny_target_tables

HIDDEN, VOCAB, MASK, WIDTH = 256, 1024, 1000, 512
OPTIONS = EngineOptions(cache_bytes=1 << 22, page_size=4, window=16, max_tree_budget=64)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafter")
    write_tiny_drafter(root / "drafter", target_hidden_size=HIDDEN, target_num_layers=4, vocab_size=VOCAB,
                       mask_token_id=MASK, seed=7)
    write_tiny_target_tables(root / "target", hidden_size=HIDDEN, vocab_size=VOCAB, seed=8)
    return root / "drafter", root / "target"


@pytest.fixture
def eng(ckpt):
    return DrafterEngine.load(*ckpt, dtype=torch.float32, options=OPTIONS)


def rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, WIDTH, generator=torch.Generator().manual_seed(seed)).bfloat16()


def item(session="s", start=0, features=None, root=5, budget=16, **kw) -> ProposeItem:
    return ProposeItem(session, start, rows(6) if features is None else features, root, budget, **kw)


def same(a: Proposal, b: Proposal) -> bool:
    return a.cache_len == b.cache_len and all(
        np.array_equal(getattr(a.tree, f), getattr(b.tree, f)) for f in ("tokens", "parents", "depths"))


BAD_ITEMS = [
    (item(features=rows(6)[:, :-1]), "features"),  # wrong width
    (item(features=rows(6).reshape(-1)), "features"),  # 1-D: the bytes are right, the shape is not
    (item(features=rows(12).reshape(6, 2, WIDTH)), "features"),
    (item(features=torch.zeros(6, WIDTH, dtype=torch.int32)), "features"),
    (item(budget=-1), "tree_budget"),
    (item(budget=0), "tree_budget"),
    (item(budget=65), "tree_budget"),
    (item(root=VOCAB), "root_token"),
    (item(root=-1), "root_token"),
    (item(start=-2), "start_position"),
    (item(mode="beam"), "mode"),
    (item(session=""), "session_id"),
]


def test_bad_items_fail_alone(ckpt, eng):
    goods = [item(f"good{i}", features=rows(3 + i, i), root=3 + i) for i in range(len(BAD_ITEMS) + 1)]
    alone = DrafterEngine.load(*ckpt, dtype=torch.float32, options=OPTIONS)
    expected = alone.propose(goods)
    batch = [goods[0]]
    for i, (bad, _) in enumerate(BAD_ITEMS):  # bad and good items interleaved in one batch
        batch += [ProposeItem(**{**bad.__dict__, "session_id": bad.session_id and f"bad{i}"}), goods[i + 1]]
    results = eng.propose(batch)
    for (_, field), error in zip(BAD_ITEMS, results[1::2]):
        assert isinstance(error, ItemError) and error.field == field and error.message.startswith(field), error
    for got, want in zip(results[0::2], expected):
        assert same(got, want)
    assert eng.info().sessions == len(goods)  # a rejected item creates no cache


def test_duplicate_session_in_one_batch(eng):
    first, second = eng.propose([item("a"), item("a", start=6)])
    assert isinstance(first, Proposal) and isinstance(second, ItemError) and second.field == "session_id"


def test_batch_equals_one_by_one(ckpt, eng):
    # different context lengths (incl. empty and beyond the window), budgets and modes in one forward
    specs = [("a", rows(3, 1), 7, 16, "ddtree"), ("b", rows(0), 9, 64, "ddtree"), ("c", rows(40, 2), 11, 5, "chain"),
             ("d", rows(17, 3), 13, 1, "ddtree")]
    for step in range(2):
        batch = eng.propose([ProposeItem(s, step * len(f), f, r, n, m) for s, f, r, n, m in specs])
        for (s, f, r, n, m), got in zip(specs, batch):
            alone = DrafterEngine.load(*ckpt, dtype=torch.float32, options=OPTIONS)
            for k in range(step + 1):
                [expected] = alone.propose([ProposeItem(s, k * len(f), f, r, n, m)])
            assert same(got, expected), (s, step)
            assert len(got.tree) == (7 if m == "chain" else min(n, 7 * VOCAB))


def test_chain_mode_is_the_argmax_of_the_draft(eng):
    [tree] = eng.propose([item("t", budget=64, return_draft_logprobs=True)])
    [chain] = eng.propose([item("c", budget=-3, mode=DraftMode.CHAIN, return_draft_logprobs=True)])  # budget ignored
    assert chain.tree.tokens.tolist() == tree.topk_ids[:, 0].tolist()
    assert chain.tree.parents.tolist() == list(range(7)) and chain.tree.depths.tolist() == list(range(1, 8))
    assert chain.topk_ids.shape == (7, 1) and tree.topk_ids.shape == (7, 64)
    np.testing.assert_allclose(chain.topk_logprobs[:, 0], tree.topk_logprobs[:, 0], atol=1e-6)
    assert tree.tree.tokens[0] == tree.topk_ids[0, 0]  # the best first node is the depth-1 argmax


def test_resync_answer_and_release(eng):
    assert isinstance(eng.propose([item("s")])[0], Proposal)
    assert eng.propose([item("s", start=3)]) == [ResyncRequired("s", 6)]
    assert eng.cache_len("s") == 6
    eng.release("s")
    with pytest.raises(UnknownSessionError) as e:
        eng.release("s")
    assert isinstance(e.value, KeyError) and "'s'" in str(e.value)
    assert eng.propose([item("s", start=6, features=rows(1))]) == [ResyncRequired("s", 0)]


def test_info(eng):
    eng.propose([item("a"), item("b", features=rows(30))])
    info = eng.info()
    assert (info.block_size, info.mask_token_id, info.target_layer_ids) == (8, MASK, (0, 3))
    assert (info.hidden_size, info.target_hidden_size, info.feature_width, info.vocab_size) == (256, 256, 512, VOCAB)
    assert (info.max_tree_budget, info.max_chain_budget, info.window, info.page_size) == (64, 7, 16, 4)
    assert info.sessions == 2 and info.model_name == "drafter"
    assert info.bytes_used == (2 + 4) * eng._page_bytes  # 6 rows → 2 pages; the last 16 of 30 rows → 4 pages
    assert info.bytes_total == eng.pool.nbytes <= OPTIONS.cache_bytes


def test_pool_must_hold_one_window(ckpt):
    with pytest.raises(ValueError, match="cache_bytes"):
        DrafterEngine.load(*ckpt, dtype=torch.float32, options=EngineOptions(cache_bytes=1 << 16, window=64))
