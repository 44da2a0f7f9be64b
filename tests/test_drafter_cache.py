"""Drafter KV cache: page bookkeeping, window, LRU eviction, split injection, resync."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from topk_check import assert_topk_matches

from drafter_service.engine import DrafterEngine, EngineOptions, Proposal, ProposeItem, ResyncRequired
from drafter_service.model_config import DFlashConfig
from drafter_service.reference import forward_ref
from drafter_service.sessions import CacheFullError, InjectPlan, Resync, SessionTable, UnknownSessionError
from drafter_service.tiny_checkpoint import write_tiny_drafter, write_tiny_target_tables

HIDDEN, VOCAB, MASK, WIDTH = 256, 1024, 1000, 512


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafter")
    write_tiny_drafter(root / "drafter", target_hidden_size=HIDDEN, target_num_layers=4, vocab_size=VOCAB,
                       mask_token_id=MASK, seed=5)
    write_tiny_target_tables(root / "target", hidden_size=HIDDEN, vocab_size=VOCAB, seed=6)
    return root / "drafter", root / "target"


def engine(ckpt, **options) -> DrafterEngine:
    opts = EngineOptions(**({"cache_bytes": 1 << 22, "page_size": 4, "window": None} | options))
    return DrafterEngine.load(*ckpt, dtype=torch.float32, options=opts)


def propose(eng, session, start, rows, root, budget=32, **kw) -> Proposal | ResyncRequired:
    [res] = eng.propose([ProposeItem(session, start, rows, root, budget, return_draft_logprobs=True, **kw)])
    return res


def same_tree(a: Proposal, b: Proposal) -> bool:
    return all(np.array_equal(getattr(a.tree, f), getattr(b.tree, f)) for f in ("tokens", "parents", "depths"))


# --- pure bookkeeping -----------------------------------------------------------------------------------

def live_rows(table: SessionTable, plans: dict[str, InjectPlan]) -> dict[int, tuple[str, int]]:
    """slot → (session, position) for every row a block may attend to; asserts no slot is shared."""
    owner = {}
    for sid, plan in plans.items():
        for j in range(len(plan.pages) * table.page_size):
            pos = plan.first_pos + j
            if plan.visible_from <= pos < plan.length:
                slot = plan.pages[j // table.page_size] * table.page_size + j % table.page_size
                assert slot not in owner, f"slot {slot} shared by {owner[slot]} and {(sid, pos)}"
                owner[slot] = (sid, pos)
    return owner


def test_window_frees_whole_pages_and_slots_stay_consistent():
    table = SessionTable(num_pages=64, page_size=4, window=10)
    written: dict[int, tuple[str, int]] = {}  # slot → (session, position) last written there
    plans: dict[str, InjectPlan] = {}
    rng = np.random.default_rng(0)
    lengths = {"a": 0, "b": 0}
    for step in range(60):
        sid = "ab"[step % 2]
        n = int(rng.integers(0, 7))
        plan = table.plan(sid, lengths[sid], n, reset=False, protected={sid})
        assert isinstance(plan, InjectPlan) and plan.length == lengths[sid] + n
        assert list(plan.positions) == list(range(max(lengths[sid], plan.length - 10), plan.length))
        written.update({slot: (sid, pos) for slot, pos in zip(plan.slots, plan.positions)})
        lengths[sid], plans[sid] = plan.length, plan
        assert len(plan.pages) <= -(-10 // 4) + 1  # window W=10 over pages of 4 rows
        for slot, row in live_rows(table, plans).items():
            assert written[slot] == row  # every attended slot holds the row it claims
    assert table.pages_used == sum(len(p.pages) for p in plans.values())


def test_resync_rules():
    table = SessionTable(num_pages=16, page_size=4, window=8)
    assert table.plan("a", 3, 5, reset=False, protected=()) == Resync(0)  # unknown session starts at 0
    assert "a" not in table
    assert isinstance(table.plan("a", 0, 6, reset=False, protected=()), InjectPlan)
    for start in (5, 7):  # behind or ahead of the cache
        assert table.plan("a", start, 2, reset=False, protected=()) == Resync(6)
    assert table.cache_len("a") == 6
    plan = table.plan("a", 20, 8, reset=True, protected=())  # resend of the window
    assert (plan.first_pos, plan.length, plan.skip, plan.visible_from) == (20, 28, 0, 20)
    plan = table.plan("a", 30, 3, reset=True, protected=())  # reset drops the old rows even when short
    assert (plan.first_pos, plan.length, len(plan.pages)) == (30, 33, 1)
    plan = table.plan("b", 100, 30, reset=True, protected=())  # rows before the window are not injected
    assert (plan.skip, list(plan.positions), plan.visible_from) == (22, list(range(122, 130)), 122)
    assert table.pages_used == 1 + 2


def test_lru_eviction_protects_the_batch():
    table = SessionTable(num_pages=6, page_size=4, window=None)
    for sid in "abc":
        table.plan(sid, 0, 8, reset=False, protected=())  # 2 pages each: pool full
    table.plan("a", 8, 0, reset=False, protected=())  # touch a: b is now least recently used
    table.plan("d", 0, 4, reset=False, protected={"d"})
    assert "b" not in table and {"a", "c", "d"} <= set(table._sessions)
    table.plan("e", 0, 8, reset=False, protected={"e", "c"})  # c protected: evicts a (then d if needed)
    assert "c" in table and "a" not in table
    with pytest.raises(CacheFullError, match="cache full"):
        table.plan("f", 0, 20, reset=False, protected={"c", "e", "f", "d"})
    assert "f" not in table  # no half-planned session left behind
    assert table.pages_used == sum(len(s.pages) for s in table._sessions.values())


def test_release_unknown_session():
    table = SessionTable(num_pages=4, page_size=4, window=None)
    with pytest.raises(UnknownSessionError, match="nope") as e:
        table.release("nope")
    assert isinstance(e.value, KeyError)
    table.plan("a", 0, 5, reset=False, protected=())
    table.release("a")
    assert table.pages_used == 0 and table.cache_len("a") == 0


# --- engine ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("window", [None, 10])
def test_split_injection_equals_one_call(ckpt, window):
    eng = engine(ckpt, window=window)
    torch.manual_seed(1)
    rows = torch.randn(23, WIDTH).bfloat16()
    whole = propose(eng, "whole", 0, rows, 17)
    start = 0
    for end in (1, 6, 6, 14, 23):  # includes an empty injection and page-crossing splits
        split = propose(eng, "split", start, rows[start:end], 17)
        start = end
    assert split.cache_len == whole.cache_len == 23
    np.testing.assert_array_equal(split.topk_ids, whole.topk_ids)
    np.testing.assert_allclose(split.topk_logprobs, whole.topk_logprobs, rtol=0, atol=1e-5)
    assert same_tree(split, whole)


def test_window_attends_exactly_the_last_w_rows(ckpt):
    drafter, target = ckpt
    eng = engine(ckpt, window=12)
    torch.manual_seed(2)
    rows = torch.randn(41, WIDTH).bfloat16()
    for start, end in ((0, 15), (15, 16), (16, 30), (30, 41)):
        res = propose(eng, "s", start, rows[start:end], 9, budget=64)
    cfg = DFlashConfig.from_json(drafter)
    state = {k: v.float() for k, v in load_file(drafter / "model.safetensors").items()}
    tables = {k: v.float() for k, v in load_file(target / "model-00001-of-00001.safetensors").items()}
    embed, head = tables["language_model.model.embed_tokens.weight"], tables["language_model.lm_head.weight"]
    inv_freq = eng.model.inv_freq  # checked against transformers in test_drafter_model.py

    def ref(first):
        return torch.log_softmax(forward_ref(state, cfg, embed, head, inv_freq, rows[first:], first, 9), -1)

    assert_topk_matches(res.topk_ids, res.topk_logprobs, ref(41 - 12))
    assert (ref(0) - ref(29)).abs().max() > 1e-3  # the window matters for this context
    assert eng.info().bytes_used <= 4 * eng._page_bytes  # a 12-row window spans at most ceil(12/4) + 1 pages


def test_resync_after_eviction_gives_identical_trees(ckpt):
    window = 12
    steady, flaky = engine(ckpt, window=window), engine(ckpt, window=window)
    rng = np.random.default_rng(3)
    torch.manual_seed(3)  # fixed feature rows: the outcome must not depend on the run
    history = torch.randn(0, WIDTH).bfloat16()
    cache_len = {"steady": 0, "flaky": 0}
    resyncs = 0
    for step in range(12):
        new = torch.randn(int(rng.integers(1, 8)) if step else 9, WIDTH).bfloat16()
        history = torch.cat([history, new])
        root = int(rng.integers(0, VOCAB))
        expected = propose(steady, "s", cache_len["steady"], new, root)
        cache_len["steady"] = expected.cache_len
        if step in (4, 8):
            flaky.release("s")  # replica lost the session (eviction, restart)
        got = propose(flaky, "s", cache_len["flaky"], new, root)
        if isinstance(got, ResyncRequired):
            assert got.cache_len == 0
            resyncs += 1
            first = max(0, len(history) - window)  # the verifier resends its last W rows
            got = propose(flaky, "s", first, history[first:], root, reset=True)
        cache_len["flaky"] = got.cache_len
        assert got.cache_len == expected.cache_len == len(history)
        assert same_tree(got, expected), f"step {step}"
        # The reset injects the window in one batch, the steady engine row groups as they came: CPU GEMMs pick
        # their kernels (and summation order) by the row count, so log-probs of size ~6 differ by a few ulps.
        np.testing.assert_allclose(got.topk_logprobs, expected.topk_logprobs, rtol=1e-5, atol=1e-5)
    assert resyncs == 2


def test_eviction_under_byte_budget_forces_resync(ckpt):
    page = engine(ckpt)._page_bytes
    eng = engine(ckpt, window=8, cache_bytes=5 * page)
    rows = torch.randn(10, WIDTH).bfloat16()
    for sid in ("a", "b", "c"):  # positions 2..9 = 2 pages each: c needs a's pages
        assert isinstance(propose(eng, sid, 0, rows, 1), Proposal)
    info = eng.info()
    assert info.sessions == 2 and info.bytes_used == 4 * page and info.bytes_total == 5 * page
    assert propose(eng, "a", 10, rows[:1], 1) == ResyncRequired("a", 0)  # a was least recently used
    assert isinstance(propose(eng, "c", 10, rows[:1], 1), Proposal)
