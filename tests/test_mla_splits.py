"""CPU: the tree attention's split choices (kernels/mla_tree_attention). Host schedule: the busy-block bound must
hold for every way a plan's rows can sit (brute force over random layouts), and a one-session graph must fill the
SMs. Device schedule (a graph of 2+ sessions):
the blocks the .cu's plan_splits / sched_block deal (restated below from their comments) must fit the grid the
launcher sizes, their split count the partials it allocates, and one wave must fill the SMs."""

from __future__ import annotations

import math
import random

import pytest

from kernels.mla_tree_attention import KT, _busy_blocks, _config, _device_grid, _device_splits, _split


def _live_blocks(rows: list[int], h: int, mt: int) -> int:
    return sum(math.ceil(r * h / mt) for r in rows)


@pytest.mark.parametrize("pad_last", [False, True])
def test_busy_bound_holds_for_every_row_layout(pad_last):
    """No split past the first ever holds more query blocks than the bound says (else the split count's one-wave
    plan spills into a second wave). pad_last: a graph's plan, R = T = bucket, the live sequences then the pad one."""
    rng = random.Random(0)
    for _ in range(5000):
        B, R = rng.randint(2 if pad_last else 1, 9), rng.randint(1, 64)
        h, mt = rng.choice([1, 9, 10, 64]), rng.choice([16, 32, 64])
        if pad_last:
            cuts = sorted(rng.randint(0, R) for _ in range(B - 1))
            live = [b - a for a, b in zip([0] + cuts[:-1], cuts)]  # B - 1 sessions, R rows or fewer in all
            T = R  # + the pad sequence's R - sum(live) rows
        else:
            live = [rng.randint(0, R) for _ in range(B)]
            T = sum(live)
        assert _live_blocks(live, h, mt) <= _busy_blocks(B, T, R, h, mt, pad_last), (B, R, h, mt, live)


@pytest.mark.parametrize("bucket", [1, 2, 4, 8, 16, 32, 64])
def test_one_session_graph_fills_the_sms(bucket):
    """K2.6 rank 0 of 7 (10 heads) on an H200 (132 SMs), a 131072-key page table: one session's tree of `bucket` rows
    runs in one wave of at least 90 % of the SMs. Counting the pad sequence as busy gave 78 blocks at 16 rows."""
    h, sms = 10, 132
    config = _config(bucket * h, 232448, True)
    mt = 64 if isinstance(config, str) else config[0]
    busy = _busy_blocks(2, bucket, bucket, h, mt, pad_last=True)
    splits = _split(busy, min(mt, bucket * h), bucket * h, 131072 + bucket, sms, exact=False)
    assert 0.9 * sms <= splits * math.ceil(bucket * h / mt) <= sms


def device_deal(rows: list[int], prefixes: list[int], h: int, mt: int, slots: int, zsplits: int) -> tuple[int, int]:
    """-> (split count s before the zsplits cap, blocks dealt) of the device schedule: query tiles of sequences with a
    prefix take up to s splits, the others one per key tile; s = (slots - P) // Q, at least 1; a sequence's keys in
    chunks of ceil(tiles / s) tiles, one block per chunk and query tile."""
    tiles = [math.ceil(r * h / mt) for r in rows]
    Q = sum(t for t, p in zip(tiles, prefixes) if p > 0)
    P = sum(t * math.ceil(r / KT) for t, r, p in zip(tiles, rows, prefixes) if p == 0)
    s = max(1, (slots - P) // Q) if Q else 1
    capped = min(s, zsplits)
    blocks = 0
    for t, r, p in zip(tiles, rows, prefixes):
        keys = math.ceil((p + r) / KT)
        blocks += t * (math.ceil(keys / math.ceil(keys / capped)) if keys else 0)
    return s, blocks


def graph_plan(rng: random.Random, max_seqs: int) -> tuple[int, list[int], list[int]]:
    """A step padded as verifier_service/graphs.py pads it: live sessions (some may lack a prefix), empty ones up to
    the session bucket, the pad sequence's rows up to the row bucket. -> (row bucket, rows, prefixes)."""
    live = rng.randint(1, max_seqs)
    rows = [rng.randint(1, 64) for _ in range(live)]
    while sum(rows) > 256:
        rows.pop()
    bucket = 1 << (sum(rows) - 1).bit_length()
    seqs = 1 << (len(rows) - 1).bit_length()
    prefixes = [rng.choice([0, 1, 63, 64, 4096, 70000]) for _ in rows]
    rows += [0] * (seqs - len(rows)) + [bucket - sum(rows)]
    return bucket, rows, prefixes + [0] * (seqs - len(prefixes) + 1)


def test_device_deal_fits_the_grid_and_the_partials():
    rng = random.Random(1)
    for _ in range(5000):
        bucket, rows, prefixes = graph_plan(rng, rng.choice([1, 4, 64]))
        h, mt, slots = rng.choice([1, 9, 10, 64]), rng.choice([16, 32, 64]), rng.choice([132, 264, 188])
        zsplits = _device_splits(bucket, h, mt, slots)
        s, blocks = device_deal(rows, prefixes, h, mt, slots, zsplits)
        assert blocks <= _device_grid(bucket, len(rows), h, mt, slots), (bucket, rows, prefixes, h, mt, slots)
        if all(p > 0 for p, r in zip(prefixes, rows[:-1]) if r):  # live sessions with prefixes: the cap never binds
            assert s <= zsplits, (bucket, rows, prefixes, h, mt, slots)


@pytest.mark.parametrize("sessions,rows", [(2, 1), (2, 16), (3, 16), (4, 1), (4, 4), (4, 16), (8, 1), (8, 4), (8, 16),
                                           (2, 64), (16, 8)])
def test_device_deal_fills_the_sms(sessions, rows):
    """K2.6 rank 0 of 7 (10 heads) on an H200 (132 SMs), 16K-key prefixes: the live sessions of a graph of 2+
    sessions fill at least 90 % of one wave. The host's split count for 4 sessions x 16 rows had filled 3 waves, for 8 x 4 ten (44 and 47 splits)."""
    h, slots = 10, 132
    bucket = 1 << (sessions * rows - 1).bit_length()
    config = _config(bucket * h, 232448, True)  # a graph's config follows its row bucket
    mt = 64 if config == "wgmma" else config[0]
    live = [rows] * sessions + [0] * ((1 << (sessions - 1).bit_length()) - sessions) + [bucket - sessions * rows]
    prefixes = [16384] * sessions + [0] * (len(live) - sessions)
    s, blocks = device_deal(live, prefixes, h, mt, slots, _device_splits(bucket, h, mt, slots))
    assert 0.9 * slots <= blocks <= slots, (s, blocks)
