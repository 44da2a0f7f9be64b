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
from kernels.bench import graph_case
from kernels.mla_tree_attention import mla_tree_attention, mla_tree_attention_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SCALE = 0.14467963


@pytest.fixture(autouse=True)
def _sync_every_launch(monkeypatch):
    monkeypatch.setenv("DDTREE_KERNEL_SYNC", "1")  # a device fault fails the launching test


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16 outputs of fp32 math: 1 % relative error, cosine 0.99995 (as tests/test_kernels_gpu.py)."""
    o, r = out.double(), ref.double()
    assert torch.isfinite(o).all(), f"non-finite output at {torch.nonzero(~torch.isfinite(o))[:5].tolist()}"
    err, cos = (o - r).norm() / r.norm(), torch.nn.functional.cosine_similarity(o.flatten(), r.flatten(), dim=0)
    assert err < 1e-2 and cos > 0.99995, f"rel {err:.2e} cos {cos:.8f}"


def poisoned_empty_cache() -> None:
    """NaN in torch's cached blocks: an output row or partial the kernel never writes shows up."""
    junk = torch.full((64 << 20,), float("nan"), device="cuda")
    del junk


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
    args = graph_case(rows, prefixes, 10, 64, bucket, sessions, seed=len(rows), capacity=131072)
    poisoned_empty_cache()
    assert_close(mla_tree_attention(*args, SCALE, pad_last=True), mla_tree_attention_ref(*args, SCALE))


@pytest.mark.parametrize("config", mla_mod.CONFIGS)
def test_device_schedule_every_config(config, monkeypatch):
    """Each compiled kernel deals by its own query tile (16, 32 or 64 rows); (16, 1) runs two blocks an SM."""
    monkeypatch.setattr(mla_mod, "CONFIG", config)
    args = graph_case([5, 17, 2], [3000, 700, 1], 10, 64, 32, 4, seed=3, capacity=8192)
    poisoned_empty_cache()
    assert_close(mla_tree_attention(*args, SCALE, pad_last=True), mla_tree_attention_ref(*args, SCALE))


def test_one_graph_follows_each_live_plan():
    """One capture (16-row bucket, 4-session bucket), then plans of 1-4 live sessions, with and without prefixes,
    copied into its static buffers and replayed: the split count and the deal follow each plan on the device."""
    bucket, sessions, capacity, page = 16, 4, 32768, 64
    plans = [([9], [12000]), ([3, 5, 1, 7], [100, 5000, 32000, 0]), ([1, 1, 1], [32000, 32000, 200]),
             ([16], [0]), ([4, 4, 4, 4], [3000, 3000, 3000, 3000]), ([2, 14], [32000, 64])]
    pages = max(sum(math.ceil(p / page) + math.ceil(r / page) for r, p in zip(rs, ps)) + 4 for rs, ps in plans)
    cases = [graph_case(rs, ps, 10, page, bucket, sessions, seed=i, capacity=capacity, num_pages=pages)
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
        assert_close(out, mla_tree_attention_ref(*case, SCALE))
