"""GPU: mla_tree_attention on a CUDA graph's padded plan (pad_last). With 2+ session slots the kernel deals its
blocks and picks its split count on the device from the live sequences; one session takes the host's count. Checked
against the fp32 torch reference: every query tile and split must be dealt exactly once, for up to 64 sessions, pad
sequences longer than a key tile, sessions without a prefix, every kernel config, and plans that change between
replays of one graph."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import mla_tree_attention as mla_mod
from kernels.bench import mla_case
from kernels.mla_tree_attention import mla_tree_attention, mla_tree_attention_ref
from test_kernels_gpu import assert_close, poison_allocator
from verifier_service.graphs import fill_plan, static_plan
from verifier_service.plan import BatchPlan

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SCALE, HEADS, PAGE = 0.14467963, 10, 64


@pytest.fixture(autouse=True)
def _sync_every_launch(monkeypatch):
    monkeypatch.setenv("DDTREE_KERNEL_SYNC", "1")  # a device fault fails the launching test


def graph_case(rows: list[int], prefixes: list[int], bucket: int, sessions: int, seed: int, capacity: int,
               num_pages: int = 0, device="cuda"):
    """mla_case's batch padded by verifier_service/graphs (static_plan + fill_plan) into a graph's static plan of
    `bucket` rows and `sessions` + 1 sequences, its pad slot on a zeroed extra page. `num_pages`: the cache's pages at
    least (NaN past mla_case's own), so that several plans can share one graph's shapes. -> mla_tree_attention's
    arguments."""
    q, kv, table, prefix, starts, mask, slots = mla_case(rows, prefixes, HEADS, PAGE, "cpu", seed, capacity)
    T = sum(rows)
    pages = max(num_pages, kv.shape[0] + 1)
    cache = torch.full((pages, PAGE, 576), float("nan"), dtype=torch.bfloat16)
    cache[: kv.shape[0]] = kv
    cache[-1] = 0
    zeros = torch.zeros(T, dtype=torch.int64)
    live = BatchPlan(token_ids=zeros, positions=zeros, write_slots=slots, row_starts=starts, prefix_lens=prefix,
                     page_table=table, tree_mask=mask)
    static = static_plan(bucket, sessions, table.shape[1], "cpu")
    fill_plan(static, live, pad_slot=(pages - 1) * PAGE)
    q_pad = torch.randn(bucket, HEADS, 576, generator=torch.Generator().manual_seed(seed)).bfloat16()
    q_pad[:T] = q
    args = (q_pad, cache, static.page_table, static.prefix_lens, static.row_starts, static.tree_mask,
            static.write_slots)
    return tuple(a.contiguous().to(device) for a in args)


def check(args) -> None:
    """bf16 outputs of fp32 math: tests/test_kernels_gpu.py's tolerances (1 % relative error, cosine 0.99995)."""
    poison_allocator()
    assert_close(mla_tree_attention(*args, SCALE, pad_last=True), mla_tree_attention_ref(*args, SCALE),
                 rel=1e-2, cos=0.99995)


CASES = [  # (live rows, live prefixes, row bucket, session bucket)
    ([16], [40000], 16, 1),  # one session filling its bucket: no pad rows
    ([9], [5000], 16, 1),  # 7 pad rows
    ([1], [65536], 1, 1),  # one decode row over a long prefix: the most splits
    ([3, 5, 1], [100, 5000, 16000], 16, 4),  # uneven sessions, 7 pad rows, one empty session
    ([16, 16, 16], [3000, 0, 9000], 64, 4),  # a session without a prefix (its tiles count as the pad's)
    ([65], [2000], 256, 1),  # 191 pad rows: the pad sequence spans three key tiles
    ([1] * 40, [(37 * i) % 3000 + 1 for i in range(40)], 64, 64),  # 65 sequences
    ([2] * 33, [1000] * 33, 128, 64),
]


@pytest.mark.parametrize("rows,prefixes,bucket,sessions", CASES)
def test_device_schedule(rows, prefixes, bucket, sessions):
    check(graph_case(rows, prefixes, bucket, sessions, seed=len(rows), capacity=131072))


@pytest.mark.parametrize("config", mla_mod.CONFIGS)
def test_device_schedule_every_config(config, monkeypatch):
    """Each compiled kernel deals by its own query tile (16, 32 or 64 rows); (16, 1) runs two blocks an SM."""
    monkeypatch.setattr(mla_mod, "CONFIG", config)
    check(graph_case([5, 17, 2], [3000, 700, 1], 32, 4, seed=3, capacity=8192))


def test_one_graph_follows_each_live_plan():
    """One capture (16-row bucket, 4-session bucket), then plans of 1-4 live sessions, with and without prefixes,
    copied into its static buffers and replayed: the split count and the deal follow each plan on the device."""
    bucket, sessions, capacity = 16, 4, 32768
    plans = [([9], [12000]), ([3, 5, 1, 7], [100, 5000, 32000, 0]), ([1, 1, 1], [32000, 32000, 200]),
             ([16], [0]), ([4, 4, 4, 4], [3000, 3000, 3000, 3000]), ([2, 14], [32000, 64])]
    pages = max(sum(math.ceil(p / PAGE) + math.ceil(r / PAGE) for r, p in zip(rs, ps)) + 4 for rs, ps in plans)
    cases = [graph_case(rs, ps, bucket, sessions, seed=i, capacity=capacity, num_pages=pages)
             for i, (rs, ps) in enumerate(plans)]
    static = [a.clone() for a in cases[0]]
    mla_tree_attention(*static, SCALE, pad_last=True)  # eager first: loads the kernels, makes the tensor map
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla_tree_attention(*static, SCALE, pad_last=True)
    for case in cases:
        for buf, a in zip(static, case):
            buf.copy_(a)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, mla_tree_attention_ref(*case, SCALE), rel=1e-2, cos=0.99995)
