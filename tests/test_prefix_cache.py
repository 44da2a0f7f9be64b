"""The prefix cache's page bookkeeping (verifier_service/prefix_cache.py through kv_cache.PageTable): matches,
holders, idle pages counted free, eviction order, and a random workload checked against a model of what every
page holds (a matched page must hold the KV of exactly the prompt's prefix at its positions)."""

from __future__ import annotations

import random

import pytest

from verifier_service.kv_cache import OutOfPages, PageTable

PS = 4


def prefill(t: PageTable, sid: str, prompt: list[int]) -> int:
    """Opens the session on its prompt, 'prefills' the rest, publishes."""
    cached = t.open(sid, prompt)
    t.extend(sid, len(prompt) - cached)
    t.publish(sid, prompt)
    return cached


def test_match_publish_and_release():
    t = PageTable(16, PS, prefix_cache=True)
    prompt = list(range(10))  # 2 full pages + 2 tokens
    assert prefill(t, "a", prompt) == 0
    pages = t.pages("a")
    assert t.open("b", prompt) == 8 and t.pages("b") == pages[:2]  # both full pages, shared
    assert t.open("c", prompt[:8]) == 4  # a page-aligned prompt keeps its last page to prefill
    assert t.open("d", prompt[:5] + [99] * 5) == 4  # differs in page 1
    assert t.open("e", [99] + prompt[1:]) == 0
    for sid in "abcde":
        t.close(sid)
    assert t.num_free == 16 and len(t.prefix.idle) == 2  # the published pages stay, counted free
    assert t.open("f", prompt + [5, 6]) == 8


def test_output_pages_publish_at_close_and_extend_the_match():
    t = PageTable(16, PS, prefix_cache=True)
    prompt, output = list(range(6)), [50, 51, 52, 53, 54, 55, 56]
    prefill(t, "a", prompt)
    t.extend("a", len(output) - 1)  # the last emitted token is never committed
    t.publish("a", prompt + output)
    t.close("a")
    turn2 = prompt + output + [70, 71, 72]
    assert t.open("b", turn2) == 12  # three full pages: (6 + 6 committed) // 4


def test_same_tokens_published_twice_keep_the_first_page():
    t = PageTable(16, PS, prefix_cache=True)
    prompt = list(range(9))
    prefill(t, "a", prompt)
    t.open("b", [])  # opened before a published anything it could match
    t.extend("b", 9)
    t.publish("b", prompt)
    assert t.open("c", prompt) == 8 and t.pages("c") == t.pages("a")[:2]
    t.close("b")
    assert len(t.prefix.idle) == 0 and t.num_free == 16 - 3  # b's copies went back; a and c hold 3 pages


def test_eviction_takes_idle_pages_deepest_first():
    t = PageTable(6, PS, prefix_cache=True)
    prompt = list(range(17))  # 4 full pages published, a 5th page partly filled
    prefill(t, "a", prompt)
    t.close("a")
    assert t.num_free == 6
    t.open("b", [])
    t.extend("b", 4 * PS)  # 2 free pages, then the 2 deepest idle pages
    assert len(t.prefix.idle) == 2
    assert t.open("c", prompt) == 8  # pages 0 and 1 of the prompt are still cached
    with pytest.raises(OutOfPages):
        t.extend("b", PS * 3)
    assert t.pages("b")[:4] == t.pages("b")  # all-or-nothing


def test_off_by_default():
    t = PageTable(8, PS)
    prefill(t, "a", list(range(9)))
    t.close("a")
    assert t.open("b", list(range(9))) == 0 and t.num_free == 8


def test_random_workload_matches_hold_the_prompt_tokens():
    """Sessions over a small vocabulary (prompts share prefixes and pages often) open, grow, publish and close in
    random order under page pressure. Each slot is tracked as written with what its KV depends on, the whole
    prefix up to its token; a match must return pages whose slots hold exactly the prompt's. Pages are never both
    free and held."""
    rng = random.Random(0)
    t = PageTable(40, PS, prefix_cache=True)
    content: dict[int, int] = {}
    live: dict[str, list[int]] = {}
    hits = 0
    for step in range(3000):
        if live and (len(live) > 5 or rng.random() < 0.4):
            sid = rng.choice(sorted(live))
            tokens = live.pop(sid)
            if rng.random() < 0.7:
                t.publish(sid, tokens)
            t.close(sid)
            continue
        base = rng.choice([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [9, 9, 9, 9, 5, 6, 7, 8], [5] * 8, []])
        prompt = base[:rng.randrange(len(base) + 1)] + [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        sid = f"s{step}"
        try:
            cached = t.open(sid, prompt)
        except OutOfPages:
            continue
        for p, token in enumerate(prompt[:cached]):
            assert content[t.slots(sid, p, p + 1)[0]] == tuple(prompt[:p + 1]), f"step {step}: cached position {p}"
        hits += cached > 0
        try:
            for p, slot in enumerate(t.extend(sid, len(prompt) - cached), start=cached):
                content[slot] = tuple(prompt[:p + 1])
        except OutOfPages:
            t.close(sid)
            continue
        t.publish(sid, prompt)
        live[sid] = list(prompt)
        held = {p for s in t.sessions() for p in t.pages(s)}
        assert not held & set(t._free) and not held & set(t.prefix.idle), f"step {step}"
        assert len(held) + t.num_free == t.num_pages, f"step {step}: pages leaked"
    assert hits > 200, hits


def test_feature_store_keeps_a_budget_and_returns_the_trailing_run():
    import torch

    from verifier_service.prefix_cache import FeatureStore, page_keys

    keys = list(page_keys(list(range(40)), PS, 10))
    store = FeatureStore(budget_bytes=6 * PS * 2 * 4)  # six pages of [4, 2] fp32 rows
    for i in (2, 3, 4, 6, 7, 8, 9):
        store.put(keys[i], torch.full((PS, 2), float(i)))
    assert len(store.rows) == 6 and keys[2] not in store.rows  # the least recently stored went
    run = store.trailing(keys[:10], limit_pages=3)
    assert [int(r[0, 0]) for r in run] == [7, 8, 9]
    assert [int(r[0, 0]) for r in store.trailing(keys[:10], limit_pages=9)] == [6, 7, 8, 9]  # 5 is missing
    assert store.trailing(keys[:6], limit_pages=9) == [] and store.trailing(keys[:5], limit_pages=9)[-1][0, 0] == 4
    store.put(keys[0], torch.zeros(PS, 2))  # evicts 9: 8, 7, 6, then 4 and 3 were read after it
    assert keys[9] not in store.rows and all(keys[i] in store.rows for i in (0, 3, 4, 6, 7, 8))
