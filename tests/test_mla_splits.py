"""CPU: the tree attention's host-side split choice (kernels/mla_tree_attention). The busy-block bound must hold for
every way a plan's rows can sit (brute force over random layouts), and a one-session graph must fill the SMs."""

from __future__ import annotations

import math
import random

import pytest

from kernels.mla_tree_attention import _busy_blocks, _config, _split


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
