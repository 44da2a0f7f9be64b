"""Page bookkeeping of the paged latent KV cache (pure Python) and the commit copy."""

from __future__ import annotations

import pytest
import torch

from verifier_service.kv_cache import OutOfPages, PagedKVCache, PageTable


def test_extend_allocates_pages_on_demand():
    t = PageTable(num_pages=8, page_size=4)
    t.open("a")
    assert t.extend("a", 3) == [0, 1, 2]
    assert t.pages("a") == [0] and t.num_free == 7
    assert t.extend("a", 2) == [3, 4]  # crosses into a second page
    assert t.pages("a") == [0, 1] and t.length("a") == 5
    t.open("b")
    assert t.extend("b", 4) == [8, 9, 10, 11]  # exactly one page
    assert t.extend("a", 3) == [5, 6, 7]  # fills a's second page, no new page
    assert t.pages("a") == [0, 1] and t.num_free == 5


def test_slots_follow_the_page_table():
    t = PageTable(num_pages=8, page_size=2)
    t.open("a")
    t.open("b")
    t.extend("a", 1)
    t.extend("b", 3)  # pages 1, 2
    t.extend("a", 3)  # a: pages 0, 3
    assert t.pages("a") == [0, 3]
    assert t.slots("a", 0, 4) == [0, 1, 6, 7]
    with pytest.raises(IndexError):
        t.slots("a", 0, 5)


def test_close_frees_everything_and_pages_are_reused():
    t = PageTable(num_pages=4, page_size=2)
    t.open("a")
    t.extend("a", 5)
    t.scratch("a", 1)
    assert t.num_free == 0
    t.close("a")
    assert t.num_free == 4 and t.sessions() == []
    t.open("b")
    t.extend("b", 8)
    assert sorted(t.pages("b")) == [0, 1, 2, 3]
    with pytest.raises(KeyError):
        t.length("a")
    with pytest.raises(KeyError):
        t.open("b")


def test_exhaustion_raises_and_leaves_state_unchanged():
    t = PageTable(num_pages=3, page_size=4)
    t.open("a")
    t.extend("a", 6)
    with pytest.raises(OutOfPages, match="need 2 pages, 1 of 3 free"):
        t.extend("a", 7)
    assert t.length("a") == 6 and t.pages("a") == [0, 1] and t.num_free == 1
    t.open("b")
    with pytest.raises(OutOfPages):
        t.scratch("b", 5)
    assert t.scratch_slots("b") == [] and t.num_free == 1
    assert len(t.scratch("b", 4)) == 4 and t.num_free == 0


def test_scratch_is_separate_and_replaced():
    t = PageTable(num_pages=8, page_size=4)
    t.open("a")
    t.extend("a", 2)
    first = t.scratch("a", 6)  # two fresh pages, never the session's own page
    assert len(first) == 6 and not set(p // 4 for p in first) & set(t.pages("a"))
    assert t.num_free == 5
    t.scratch("a", 3)  # a new tree replaces the old scratch
    assert t.num_free == 6
    t.release_scratch("a")
    assert t.num_free == 7 and t.scratch_slots("a") == []


def test_plan_commit_maps_accepted_rows_to_next_positions():
    t = PageTable(num_pages=8, page_size=4)
    t.open("a")
    t.extend("a", 3)
    scratch = t.scratch("a", 7)
    src, dst = t.plan_commit("a", [0, 2, 5])
    assert src == [scratch[0], scratch[2], scratch[5]]
    assert dst == t.slots("a", 3, 6) and t.length("a") == 6
    with pytest.raises(IndexError):
        t.plan_commit("a", [7])


def test_commit_copies_rows_and_frees_scratch():
    cache = PagedKVCache(num_layers=2, width=5, num_pages=6, page_size=2, dtype=torch.float32)
    cache.table.open("a")
    prefix = cache.table.extend("a", 3)
    cache.kv.view(2, -1, 5)[:, prefix] = 1.0
    scratch = cache.table.scratch("a", 4)
    flat = cache.kv.view(2, -1, 5)
    for r, slot in enumerate(scratch):
        flat[:, slot] = torch.arange(5.0) + 10 * r + torch.tensor([[100.0], [200.0]])  # per layer, per row
    free_before = cache.table.num_free
    dst = cache.commit("a", [0, 1, 3])
    assert cache.table.length("a") == 6 and dst == cache.table.slots("a", 3, 6)
    rows = cache.rows(cache.table.slots("a", 0, 6))  # [2, 6, 5]
    assert torch.equal(rows[:, :3], torch.ones(2, 3, 5))
    for k, r in enumerate([0, 1, 3]):
        assert torch.equal(rows[0, 3 + k], torch.arange(5.0) + 10 * r + 100)
        assert torch.equal(rows[1, 3 + k], torch.arange(5.0) + 10 * r + 200)
    assert cache.table.scratch_slots("a") == []
    assert cache.table.num_free == free_before + 2 - 1  # two scratch pages back, one new session page


def test_from_budget_and_layout():
    width, layers, page = 576, 61, 16
    per_page = layers * page * width * 2  # bf16
    cache = PagedKVCache.from_budget(3 * per_page + 100, num_layers=2, width=width, page_size=page)
    assert cache.kv.shape == (2, 3 * layers // 2, page, width)
    assert cache.kv.dtype == torch.bfloat16 and cache.kv.is_contiguous()
    with pytest.raises(ValueError):
        PagedKVCache.from_budget(100, num_layers=2, width=width, page_size=page)
    # Byte layout: (layer l, slot s, value i) at ((l * pages * page_size + s) * width + i) * itemsize.
    small = PagedKVCache(num_layers=2, width=3, num_pages=2, page_size=2, dtype=torch.float32)
    small.kv.view(2, -1, 3)[1, 3, 2] = 5.0
    assert small.kv.flatten()[(1 * 2 * 2 + 3) * 3 + 2] == 5.0


def test_withheld_pages_are_nobodys_and_not_counted():
    t = PageTable(5, 4)
    [pad] = t.withhold(1)
    assert (t.num_pages, t.num_free) == (4, 4) and pad not in t._free
    t.open("a")
    t.extend("a", 16)
    assert pad not in t.pages("a") and t.num_free == 0
    t.close("a")
    assert t.num_free == t.num_pages == 4
