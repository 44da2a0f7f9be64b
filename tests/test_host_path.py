"""The verifier's per-step host path against straightforward references: build_plan's numpy assembly
(one packed buffer) vs per-row torch masks, the host-side CUDA-graph padding vs the device-op padding,
the circular FeatureRing vs a concatenating one, batched KV commits vs one session at a time, and the
one-sync output fetch vs per-session argmax / log-softmax."""

from __future__ import annotations

import pickle
import random

import pytest
import torch

from verifier_service.graphs import _fill_on_device, _take, empty_plan, fill_plan, static_plan
from verifier_service.kv_cache import PagedKVCache
from verifier_service.plan import PackedPlan, SeqRows, build_plan, chain_parents, packed_of, plan_to
from verifier_service.session import FeatureRing, GenParams, Session
from verifier_service.stepping import accept_session, fetch_outputs, first_token

INT_FIELDS = ("token_ids", "positions", "write_slots", "row_starts", "prefix_lens", "page_table")


def reference_plan(seqs, logit_rows=None, hidden_rows=None):
    """The plan's fields computed row by row with torch (the former build_plan)."""
    max_rows = max((len(s.token_ids) for s in seqs), default=0)
    max_pages = max((len(s.pages) for s in seqs), default=0)
    positions, starts, tokens, slots, masks = [], [0], [], [], []
    for s in seqs:
        n = len(s.token_ids)
        depth, mask = [], torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(s.parents):
            if not -1 <= p < i:
                raise ValueError(f"row {i}: parent {p} must be -1 or an earlier row")
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
            depth.append(0 if p < 0 else depth[p] + 1)
        positions += list(s.positions) if s.positions is not None else [s.prefix_len + d for d in depth]
        masks.append(mask)
        tokens += s.token_ids
        slots += s.write_slots
        starts.append(starts[-1] + n)
    tree_mask = torch.zeros(len(tokens), max_rows, dtype=torch.bool)
    for b, mask in enumerate(masks):
        tree_mask[starts[b]:starts[b + 1], : mask.shape[1]] = mask
    ints = lambda v: torch.tensor(list(v), dtype=torch.int64)  # noqa: E731
    pages = [p for s in seqs for p in [*s.pages, *[0] * (max_pages - len(s.pages))]]
    return dict(token_ids=ints(tokens), positions=ints(positions), write_slots=ints(slots), row_starts=ints(starts),
                prefix_lens=ints([s.prefix_len for s in seqs]), page_table=ints(pages).view(len(seqs), max_pages),
                tree_mask=tree_mask, logit_rows=None if logit_rows is None else ints(logit_rows),
                hidden_rows=None if hidden_rows is None else ints(hidden_rows))


def random_seqs(rng: random.Random, max_seqs: int = 6, max_rows: int | None = None, max_pages: int = 9):
    seqs, total = [], 0
    for _ in range(rng.randrange(0, max_seqs + 1)):
        kind = rng.choice(["ar", "tree", "chain", "big tree", "long chain"])
        n = {"ar": 1, "tree": rng.randrange(1, 30), "chain": rng.randrange(1, 60), "big tree": rng.randrange(60, 140),
             "long chain": rng.randrange(60, 600)}[kind]
        if max_rows is not None:
            n = min(n, max_rows - total)
            if n <= 0:
                break
        total += n
        tree = kind in ("tree", "big tree")
        parents = [-1] + [rng.randrange(i) if not tree or rng.random() < 0.95 else -1 for i in range(1, n)]
        if not tree:
            parents = chain_parents(n)
        positions = None if rng.random() < 0.8 else [rng.randrange(10**6) for _ in range(n)]
        seqs.append(SeqRows([rng.randrange(5000) for _ in range(n)], parents, rng.randrange(500),
                            [rng.randrange(1, 1000) for _ in range(rng.randrange(0, max_pages))],
                            [rng.randrange(10**5) for _ in range(n)], positions))
    return seqs


def test_build_plan_equals_row_by_row_reference():
    rng = random.Random(0)
    for _ in range(300):
        seqs = random_seqs(rng)
        t = sum(len(s.token_ids) for s in seqs)
        logit_rows = None if rng.random() < 0.3 else sorted(rng.sample(range(t), rng.randrange(0, t + 1)))
        hidden_rows = None if rng.random() < 0.5 else [rng.randrange(t) for _ in range(rng.randrange(5) if t else 0)]
        plan = build_plan(seqs, logit_rows=logit_rows, hidden_rows=hidden_rows)
        for name, want in reference_plan(seqs, logit_rows, hidden_rows).items():
            got = getattr(plan, name)
            if want is None:
                assert got is None, name
                continue
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name
            assert got.is_contiguous()
        # the packed buffer survives pickling (rank 0's broadcast) and unpacks to the same plan
        again = pickle.loads(pickle.dumps(packed_of(plan))).unpack("cpu")
        for name in (*INT_FIELDS, "tree_mask"):
            assert torch.equal(getattr(again, name), getattr(plan, name)), name


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, 0, 3], [-2]])
def test_build_plan_rejects_bad_parents(parents):
    with pytest.raises(ValueError, match=f"parent {max(parents) if max(parents) >= 0 else -2} must be"):
        build_plan([SeqRows([1] * len(parents), parents, 0, [0], [0] * len(parents))])


def test_plan_to_moves_one_buffer_and_keeps_foreign_plans():
    seqs = [SeqRows([5, 6, 7], [-1, 0, 0], 4, [2], [10, 11, 12]), SeqRows([9], [-1], 1, [3, 4], [20])]
    plan = build_plan(seqs, logit_rows=[0, 3])
    packed = packed_of(plan)
    assert isinstance(packed, PackedPlan)
    assert plan_to(plan, "cpu") is plan
    # every field is a view of the one buffer
    base = packed.buffer.data_ptr()
    assert all(base <= getattr(plan, f).data_ptr() < base + packed.buffer.numel() for f in (*INT_FIELDS, "tree_mask"))
    moved = plan_to(plan, "meta")  # a foreign device: one copy of the buffer, then views
    assert moved.token_ids.device.type == "meta" and moved.page_table.shape == (2, 2)
    assert moved.tree_mask.dtype == torch.bool and moved.tree_mask.shape == (4, 3)
    assert packed_of(moved) is None  # only host plans broadcast their buffer


def test_host_padding_equals_device_padding():
    """Host fills (numpy + one copy of the changed prefix) leave the same static buffers as the device
    fills, over sequences of plans whose batch and page-table width grow and shrink."""
    rng = random.Random(1)
    fields = (*INT_FIELDS, "tree_mask")
    for bucket, max_seqs, pages in ((1, 4, 1), (8, 4, 4), (32, 8, 8), (64, 3, 16)):
        host, dev = static_plan(bucket, max_seqs, pages, "cpu"), static_plan(bucket, max_seqs, pages, "cpu")
        fill_plan(host, empty_plan(host), 77)
        _fill_on_device(dev, empty_plan(dev), 77)
        for _ in range(150):
            seqs = random_seqs(rng, max_seqs=max_seqs, max_rows=bucket, max_pages=pages + 1)
            t = sum(len(s.token_ids) for s in seqs)
            logit_rows = sorted(rng.sample(range(t), rng.randrange(0, t + 1))) if t else []
            plan = build_plan(seqs, logit_rows=logit_rows)
            fill_plan(host, plan, 77)
            _fill_on_device(dev, plan, 77)
            for name in fields:
                assert torch.equal(getattr(host, name), getattr(dev, name)), (bucket, name)
            out = torch.randn(bucket, 3)
            staged = host.__dict__["_flat"].out_rows[:bucket]
            for sel in (None, plan.logit_rows, torch.arange(t)):
                want = out[:t] if sel is None else out[sel]
                assert torch.equal(_take(out, sel, t, staged), want)


def test_feature_ring_equals_concatenating_ring():
    rng = random.Random(2)
    for _ in range(200):
        window = rng.choice([0, 1, 3, 16, 17, 50])
        ring, ref, start, pos = FeatureRing(window), None, 0, 0
        for _ in range(rng.randrange(1, 50)):
            k = rng.choice([0, 1, 2, 3, 5, 17, 40]) if rng.random() < 0.9 else rng.randrange(0, 200)
            rows = torch.arange(pos * 2, (pos + k) * 2, dtype=torch.float32).view(k, 2)
            ring.append(pos, rows)
            ref = rows if ref is None else torch.cat([ref, rows])
            pos += k
            if window and ref.shape[0] > window:
                start, ref = start + ref.shape[0] - window, ref[ref.shape[0] - window:]
            assert (ring.start, ring.end) == (start, pos) and torch.equal(ring.rows, ref)
            q = rng.randrange(0, pos + 2)
            first, got = ring.since(q)
            assert first == max(q, start) and torch.equal(got, ref[first - start:])
        with pytest.raises(ValueError, match="do not follow"):
            ring.append(pos + 1, rows)


def test_commit_many_equals_one_session_at_a_time():
    def setup():
        cache = PagedKVCache(num_layers=2, width=3, num_pages=40, page_size=4, dtype=torch.float32)
        cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(0)))
        for sid, n in (("a", 5), ("b", 0), ("c", 9)):
            cache.table.open(sid)
            cache.table.extend(sid, n)
            cache.table.scratch(sid, 7)
        return cache

    accepted = {"a": [0, 2, 3], "b": [0], "c": [0, 1, 4, 6]}
    one, many = setup(), setup()
    for sid, rows in accepted.items():
        one.commit(sid, rows)
    calls = []
    many.on_copy = lambda src, dst: calls.append((src, dst))
    dsts = many.commit_many(list(accepted.items()))
    assert len(calls) == 1 and len(calls[0][0]) == 8 and [len(d) for d in dsts] == [3, 1, 4]
    for sid in accepted:
        t1, t2 = one.table, many.table
        assert t1.length(sid) == t2.length(sid)
        assert torch.equal(one.rows(t1.slots(sid, 0, t1.length(sid))), many.rows(t2.slots(sid, 0, t2.length(sid))))
        assert t2.scratch_slots(sid) == []


@pytest.mark.parametrize("params", [GenParams(), GenParams(return_logprobs=True),
                                    GenParams(temperature=0.9, top_k=7, seed=3, return_logprobs=True)])
def test_host_argmax_accept_equals_device_accept(params):
    """The engine's batched fetch (argmax and its log-softmax for every logit row, one sync) gives the
    walk and logprobs that accept_session computes from the session's own logits."""
    rng, g = random.Random(3), torch.Generator().manual_seed(3)
    tokens = [rng.randrange(50) for _ in range(12)]
    parents = [rng.randrange(i) for i in range(1, 13)]
    logits = torch.randn(3 + 13, 50, generator=g)  # another job's 3 rows first
    for r in range(13):  # make the target agree with some children
        kids = [i for i, p in enumerate(parents, start=1) if p == r]
        if kids and rng.random() < 0.7:
            logits[3 + r, tokens[kids[0] - 1]] += 10
    host = fetch_outputs(logits, None, argmax=True, logprobs=True)
    rows = slice(3, 16)

    def session():
        return Session("s", [1, 2], params, emit=lambda e: None, window=0)

    want = accept_session(session(), tokens, parents, logits[rows].clone())
    got = accept_session(session(), tokens, parents, logits[rows],
                         argmax=host.argmax[rows] if params.greedy else None,
                         argmax_logprobs=host.logprobs[rows] if params.greedy else None)
    assert got == want and len(want[0].accepted_rows) > 1
    token, logprob = first_token(session(), logits[5].clone())
    if params.greedy:
        assert token == host.argmax[5]
        assert (params.return_logprobs and logprob == host.logprobs[5]) or not params.return_logprobs


def test_kept_features_gathered_equal_indexed():
    """Engine._kept_features without a host copy of every row (large K2.6 rows: one gather, one read, split
    per session) gives each session the same rows as indexing a full host copy (the reference)."""
    from verifier_service.engine import Engine

    hidden = torch.randn(12, 6)
    keep = [("a", 3, [0, 2, 3]), ("b", 7, range(5, 8)), ("c", 1, [11]), ("d", 0, [4])]
    got = Engine._kept_features(keep, hidden, None)
    assert [(s, p) for s, p, _ in got] == [(s, p) for s, p, _ in keep]
    for (_, _, rows), (_, _, want) in zip(got, keep):
        assert torch.equal(rows, hidden[list(want)])
