"""CUDA graphs of the target forward, one per (row bucket, session bucket) (issue 6): replaces ~1 kernel
launch per op (hundreds per step, host-bound at ~8 ms) by one graph launch.

A step's BatchPlan is padded into the bucket's static buffers (`static_plan`, `fill_plan`):
- sessions: the plan's B sequences, then empty ones up to the session bucket `seqs` (the smallest power of
  two >= B, capped at max_seqs), then one pad sequence holding the pad rows [T, bucket) (prefix 0, each pad
  row sees only itself, writes to a reserved pad slot);
- page_table [seqs + 1, pages], tree_mask [bucket, bucket];
- logits and layer features are computed for every row and sliced afterwards.
The static buffers are views into ONE flat device buffer (`static_plan`). A host plan (the engine's:
plan.build_plan keeps it on the CPU) is padded on the host in numpy and written with ONE non-blocking
host->device copy of the buffer's prefix that can have changed (the page table comes last; rows past
the last fill's sequences are still zero); a device plan is padded with device ops. Either way no host
sync, so consecutive steps queue without waiting, and the padded contents are the same.
`pages` is `max_pages` on the kernel path (the kernel reads only prefix_lens keys). The sync-free torch
path (model.SYNC_FREE) gathers all pages·page_size prefix slots of every row, so there the page table
is also bucketed: the smallest power of two >= the plan's page-table width (capped at max_pages).
Why session buckets: the tree attention picked its split-K count on the host from shapes (graph-safe), so in
a graph of max_seqs + 1 sequences it split one live session's prefix as if every sequence were busy (H200,
K2.6 rank shapes, max_seqs 64: one 4K decode row 95.7 us in 1-2 splits, against 8.1 us at the count an
exact plan gets; docs/kernel-notes/mla_tree_attention.md, session 22). The one-session bucket still takes the
host's count; graphs of 2+ sessions (pad_last, B > 2) now deal the attention's blocks on the device.
Capture happens on the first use of a (row bucket, session bucket, pages) key, after one eager run of the same shapes
(loads the kernels: nothing may compile or allocate inside a capture). All graphs share one memory pool.
Every rank pads and replays identically, so collectives inside the graphs line up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from verifier_service.model import GRAPH_MAX_ROWS, SYNC_FREE, ForwardOutput, K2Model
from verifier_service.plan import BatchPlan

# Row buckets. fp32 once skipped 8 and 16 (cuBLAS's split-K fp32 GEMMs at 8-16 rows cost more than padding
# to 32); its projections now run kernels/skinny_linear, and the kimi-tiny forward at 5-16 rows takes
# 7-13 % less GPU time in the 8/16 buckets than padded to 32 (H200, 2026-11-30).
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
assert BUCKETS[-1] == GRAPH_MAX_ROWS  # K2Model.graph_safe checks its paths for plans of this size


# Above this many (padded row × key) pairs the sync-free attention's gathers cost more than the launch
# overhead a graph saves (H200, kimi-tiny: 8×17 rows × 1000 keys 4.9 ms graphed vs 9.7 eager; 4×33 rows
# × 3000 keys 13.9 ms graphed vs 9.5 eager): those steps run eagerly.
SYNC_FREE_MAX_ROW_KEYS = 600_000


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    plan: BatchPlan  # static input buffers
    out: ForwardOutput  # static outputs, all rows


class GraphRunner:
    def __init__(self, model: K2Model, cache, *, max_seqs: int, max_pages: int):
        self.model, self.cache = model, cache
        self.max_seqs, self.max_pages = max_seqs, max_pages
        self.page_buckets = model.attention_path(cache.kv) == SYNC_FREE
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int, int, tuple[int, ...]], _Graph] = {}
        # one page whose first slot takes every pad row's latent, outside every session's
        self.pad_slot = cache.table.withhold(1)[0] * cache.page_size

    def fits(self, plan: BatchPlan) -> bool:
        if plan.explicit_mla or plan.num_rows > BUCKETS[-1] or plan.prefix_lens.shape[0] > self.max_seqs \
                or plan.page_table.shape[1] > self.max_pages:
            return False
        if self.page_buckets:  # sync-free attention gathers every padded row's prefix keys
            bucket, _, pages, _ = self.key(plan, ())
            return bucket * pages * self.cache.page_size <= SYNC_FREE_MAX_ROW_KEYS
        return True

    def warm_keys(self, max_rows: int) -> list[tuple[int, int, int]]:
        """(rows, sessions, page-table width) of one plan per graph worth capturing before serving: every row
        bucket up to the one holding `max_rows`, with every session bucket it can hold (a session has >= 1
        row), at every width the path tells apart (powers of two on the sync-free path, else max_pages),
        leaving out the shapes that run eagerly anyway."""
        top = next(b for b in BUCKETS if b >= min(max_rows, BUCKETS[-1]))
        widths = [self.max_pages]
        if self.page_buckets:
            widths = sorted({page_bucket(1 << i, self.max_pages, True) for i in range(self.max_pages.bit_length() + 1)})
        sessions = sorted({session_bucket(1 << i, self.max_seqs) for i in range(self.max_seqs.bit_length() + 1)})
        return [(b, s, w) for b in BUCKETS if b <= top for s in sessions if s <= b for w in widths
                if not self.page_buckets or b * w * self.cache.page_size <= SYNC_FREE_MAX_ROW_KEYS]

    def key(self, plan: BatchPlan, layer_ids: Sequence[int]) -> tuple[int, int, int, tuple[int, ...]]:
        """(row bucket, session bucket, static page-table width, layer ids) of the graph that replays `plan`."""
        bucket = next(b for b in BUCKETS if b >= plan.num_rows)
        return (bucket, session_bucket(plan.prefix_lens.shape[0], self.max_seqs),
                page_bucket(plan.page_table.shape[1], self.max_pages, self.page_buckets), tuple(layer_ids))

    def forward(self, plan: BatchPlan, layer_ids: Sequence[int]) -> ForwardOutput:
        """Replay `plan` (on the host, or on the graphs' device) from its bucket's graph."""
        key = self.key(plan, layer_ids)
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._capture(*key)
        fill_plan(g.plan, plan, self.pad_slot)
        g.graph.replay()
        flat = g.plan.__dict__["_flat"]
        rows, bucket = plan.num_rows, flat.bucket
        return ForwardOutput(logits=_take(g.out.logits, plan.logit_rows, rows, flat.out_rows[:bucket]),
                             hidden=_take(g.out.hidden, plan.hidden_rows, rows, flat.out_rows[bucket:]))

    def drop_all(self) -> None:
        """Forget every captured graph: one captured under tensors that are gone reads freed memory (bench verify's
        drawn routing, whose ids a graph reads where they lay at capture)."""
        self.graphs.clear()
        self.pool = torch.cuda.graph_pool_handle()  # the old pool dies with its last graph: capturing into it fails

    def _capture(self, bucket: int, seqs: int, pages: int, layer_ids: tuple[int, ...]) -> _Graph:
        static = static_plan(bucket, seqs, pages, self.cache.kv.device)
        fill_plan(static, empty_plan(static), self.pad_slot)
        self.model.forward(static, self.cache.kv, layer_ids)  # eager run: loads kernels, warms the allocator
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.model.forward(static, self.cache.kv, layer_ids)
        return _Graph(graph, static, out)


def session_bucket(sessions: int, max_seqs: int) -> int:
    """Sequences (before the pad one) of the graph for a plan of `sessions`: the smallest power of two >=
    sessions, capped at max_seqs."""
    return min(max_seqs, 1 << max(sessions - 1, 0).bit_length())


def page_bucket(pages: int, max_pages: int, bucketed: bool) -> int:
    """Static page-table width for a plan of `pages` columns: max_pages, or (bucketed) the smallest
    power of two >= pages, capped at max_pages."""
    return min(max_pages, 1 << max(pages - 1, 0).bit_length()) if bucketed else max_pages


@dataclass
class _Flat:
    """One graph's static plan buffers in one flat uint8 device buffer (byte layout):
    int64 [token_ids, positions, write_slots (bucket each), row_starts (seqs+1), prefix_lens (seqs),
    out_rows (2·bucket: the logit rows, then the hidden rows, of the last host fill)], then the bool
    tree_mask [bucket, bucket] at `mask_offset`, then the int64 page_table [seqs, pages] at `pt_offset`."""

    flat: torch.Tensor
    bucket: int
    seqs: int  # the session bucket + 1 (the last: the pad sequence)
    pages: int
    ints: int  # int64 values before the mask
    mask_offset: int
    pt_offset: int
    out_rows: torch.Tensor  # int64 [2·bucket] view
    dirty_rows: int = 0  # page-table rows that may hold non-zero page ids


def _align(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


def static_plan(bucket: int, sessions: int, pages: int, device: torch.device | str) -> BatchPlan:
    """Zeroed static buffers of one graph: `bucket` rows, sessions + 1 sequences (the last: pad rows),
    all views into one flat buffer (`_Flat`, kept on the plan as `_flat`)."""
    seqs = sessions + 1
    ints = 3 * bucket + (seqs + 1) + seqs + 2 * bucket
    mask_offset = _align(8 * ints)
    pt_offset = _align(mask_offset + bucket * bucket)
    flat = torch.zeros(pt_offset + 8 * seqs * pages, dtype=torch.uint8, device=device)
    tok, pos, slots, starts, prefix, out_rows = flat[: 8 * ints].view(torch.int64).split_with_sizes(
        [bucket, bucket, bucket, seqs + 1, seqs, 2 * bucket])
    plan = BatchPlan(token_ids=tok, positions=pos, write_slots=slots, row_starts=starts, prefix_lens=prefix,
                     page_table=flat[pt_offset:].view(torch.int64).view(seqs, pages),
                     tree_mask=flat[mask_offset: mask_offset + bucket * bucket].view(torch.bool).view(bucket, bucket),
                     pad_last=True)
    object.__setattr__(plan, "_flat", _Flat(flat, bucket, seqs, pages, ints, mask_offset, pt_offset, out_rows))
    return plan


def fill_plan(static: BatchPlan, plan: BatchPlan, pad_slot: int) -> None:
    """Copy a plan into a graph's buffers in place, padding as the module docstring says (no host sync:
    a host plan goes in one non-blocking copy, a device plan by device-side copies)."""
    flat = static.__dict__.get("_flat")
    if flat is not None and plan.token_ids.device.type == "cpu":
        _fill_from_host(flat, plan, pad_slot)
        return
    _fill_on_device(static, plan, pad_slot)
    if flat is not None:
        flat.dirty_rows = plan.prefix_lens.shape[0]


def _fill_from_host(f: _Flat, plan: BatchPlan, pad_slot: int) -> None:
    T, B, P, R = plan.num_rows, plan.prefix_lens.shape[0], plan.page_table.shape[1], plan.tree_mask.shape[1]
    bucket = f.bucket
    rows = max(B, f.dirty_rows)  # page-table rows to (re)write; later ones are zero already
    nbytes = f.pt_offset + 8 * rows * f.pages
    on_host = f.flat.device.type == "cpu"
    stage = f.flat[:nbytes] if on_host else torch.empty(nbytes, dtype=torch.uint8, pin_memory=f.flat.is_cuda)
    raw = stage.numpy()
    ints = raw[: 8 * f.ints].view(np.int64)
    s0, s1 = 3 * bucket, 3 * bucket + f.seqs + 1
    tok, pos, slots = ints[:bucket], ints[bucket: 2 * bucket], ints[2 * bucket: s0]
    starts, prefix, out_rows = ints[s0:s1], ints[s1: s1 + f.seqs], ints[s1 + f.seqs:]
    tok[:T] = plan.token_ids.numpy()
    tok[T:] = 0
    pos[:T] = plan.positions.numpy()
    pos[T:] = 0
    slots[:T] = plan.write_slots.numpy()
    slots[T:] = pad_slot
    starts[: B + 1] = plan.row_starts.numpy()
    starts[B + 1:] = T  # empty sequences B .. seqs - 2
    starts[-1] = bucket  # the pad sequence: rows [T, bucket)
    prefix[:B] = plan.prefix_lens.numpy()
    prefix[B:] = 0
    out_rows[:] = 0
    for at, sel in ((0, plan.logit_rows), (bucket, plan.hidden_rows)):
        if sel is not None and sel.shape[0] <= bucket:
            out_rows[at: at + sel.shape[0]] = sel.numpy()
    raw[8 * f.ints: f.mask_offset] = 0
    mask = raw[f.mask_offset: f.mask_offset + bucket * bucket].reshape(bucket, bucket)
    mask[:] = 0
    mask[:T, :R] = plan.tree_mask.numpy()
    pad = np.arange(bucket - T)
    mask[T + pad, pad] = 1  # a pad row sees itself only
    raw[f.mask_offset + bucket * bucket: f.pt_offset] = 0
    table = raw[f.pt_offset:].view(np.int64).reshape(rows, f.pages)
    table[:] = 0
    table[:B, :P] = plan.page_table.numpy()
    if not on_host:
        f.flat[:nbytes].copy_(stage, non_blocking=True)
    f.dirty_rows = B


def _fill_on_device(static: BatchPlan, plan: BatchPlan, pad_slot: int) -> None:
    """The same padding with device ops (a plan already on the graphs' device)."""
    T, B, P, R = plan.num_rows, plan.prefix_lens.shape[0], plan.page_table.shape[1], plan.tree_mask.shape[1]
    bucket = static.token_ids.shape[0]
    for name in ("token_ids", "positions"):
        buf = getattr(static, name)
        buf[:T] = getattr(plan, name)
        buf[T:] = 0
    static.write_slots[:T] = plan.write_slots
    static.write_slots[T:] = pad_slot
    static.row_starts[: B + 1] = plan.row_starts
    static.row_starts[B + 1:] = T  # empty sequences B .. seqs - 2
    static.row_starts[-1] = bucket  # the pad sequence: rows [T, bucket)
    static.prefix_lens.zero_()
    static.prefix_lens[:B] = plan.prefix_lens
    static.page_table.zero_()
    static.page_table[:B, :P] = plan.page_table
    static.tree_mask.zero_()
    static.tree_mask[:T, :R] = plan.tree_mask
    pad = torch.arange(bucket - T, device=static.tree_mask.device)
    static.tree_mask[T + pad, pad] = True  # a pad row sees itself only


def _take(out: torch.Tensor, sel: torch.Tensor | None, rows: int, staged: torch.Tensor) -> torch.Tensor:
    """Rows `sel` (None: the first `rows`) of a static output, as a new tensor. A host `sel` that is a
    run of rows is a slice; otherwise its copy `staged` on the device (written by the host fill)."""
    if sel is None:
        return out[:rows].clone()
    if sel.device.type != "cpu":
        return out[sel]
    idx = sel.numpy()
    n = idx.shape[0]
    if n == 0:
        return out[:0].clone()
    first = int(idx[0])
    if first >= 0 and np.array_equal(idx, np.arange(first, first + n)):
        return out[first: first + n].clone()
    if n <= staged.shape[0] and idx.min() >= 0:
        return out.index_select(0, staged[:n])
    return out[sel.to(out.device)]


def empty_plan(static: BatchPlan) -> BatchPlan:
    """A plan of zero real rows (everything is pad) with the static buffers' shapes."""
    dev = static.token_ids.device
    e = torch.zeros(0, dtype=torch.int64, device=dev)
    return replace(static, token_ids=e, positions=e, write_slots=e, row_starts=torch.zeros(1, dtype=torch.int64, device=dev),
                   prefix_lens=e, page_table=torch.zeros(0, static.page_table.shape[1], dtype=torch.int64, device=dev),
                   tree_mask=torch.zeros(0, 0, dtype=torch.bool, device=dev))
