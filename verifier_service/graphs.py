"""CUDA graphs of the target forward, one per row bucket (issue 6): replaces ~1 kernel launch per op
(hundreds per step, host-bound at ~8 ms) by one graph launch.

A step's BatchPlan is padded into the bucket's static buffers (`static_plan`, `fill_plan`):
- sessions: the plan's B sequences, then empty ones up to `max_seqs`, then one pad sequence holding
  the pad rows [T, bucket) (prefix 0, each pad row sees only itself, writes to a reserved pad slot);
- page_table [max_seqs + 1, pages], tree_mask [bucket, bucket];
- logits and layer features are computed for every row and sliced afterwards.
`pages` is `max_pages` on the kernel path (the kernel reads only prefix_lens keys). The sync-free torch
path (model.SYNC_FREE) gathers all pages·page_size prefix slots of every row, so there the page table
is also bucketed: the smallest power of two >= the plan's page-table width (capped at max_pages).
Capture happens on the first use of a (row bucket, pages) pair, after one eager run of the same shapes
(loads the kernels: nothing may compile or allocate inside a capture). All graphs share one memory pool.
Every rank pads and replays identically, so collectives inside the graphs line up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from verifier_service.model import GRAPH_MAX_ROWS, SYNC_FREE, ForwardOutput, K2Model
from verifier_service.plan import BatchPlan

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PAD_SESSION = "__graph_pad__"
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
        self.graphs: dict[tuple[int, int, tuple[int, ...]], _Graph] = {}
        cache.table.open(PAD_SESSION)  # one page whose first slot takes every pad row's latent
        self.pad_slot = cache.table.extend(PAD_SESSION, 1)[0]

    def fits(self, plan: BatchPlan) -> bool:
        if plan.explicit_mla or plan.num_rows > BUCKETS[-1] or plan.prefix_lens.shape[0] > self.max_seqs \
                or plan.page_table.shape[1] > self.max_pages:
            return False
        if self.page_buckets:  # sync-free attention gathers every padded row's prefix keys
            bucket, pages, _ = self.key(plan, ())
            return bucket * pages * self.cache.page_size <= SYNC_FREE_MAX_ROW_KEYS
        return True

    def key(self, plan: BatchPlan, layer_ids: Sequence[int]) -> tuple[int, int, tuple[int, ...]]:
        """(row bucket, static page-table width, layer ids) of the graph that replays `plan`."""
        bucket = next(b for b in BUCKETS if b >= plan.num_rows)
        return bucket, page_bucket(plan.page_table.shape[1], self.max_pages, self.page_buckets), tuple(layer_ids)

    def forward(self, plan: BatchPlan, layer_ids: Sequence[int]) -> ForwardOutput:
        rows = plan.num_rows
        key = self.key(plan, layer_ids)
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._capture(*key)
        fill_plan(g.plan, plan, self.pad_slot)
        g.graph.replay()
        logit_rows = torch.arange(rows, device=plan.token_ids.device) if plan.logit_rows is None else plan.logit_rows
        hidden_rows = slice(None, rows) if plan.hidden_rows is None else plan.hidden_rows
        return ForwardOutput(logits=g.out.logits[logit_rows].clone(), hidden=g.out.hidden[hidden_rows].clone())

    def _capture(self, bucket: int, pages: int, layer_ids: tuple[int, ...]) -> _Graph:
        static = static_plan(bucket, self.max_seqs, pages, self.cache.kv.device)
        fill_plan(static, empty_plan(static), self.pad_slot)
        self.model.forward(static, self.cache.kv, layer_ids)  # eager run: loads kernels, warms the allocator
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.model.forward(static, self.cache.kv, layer_ids)
        return _Graph(graph, static, out)


def page_bucket(pages: int, max_pages: int, bucketed: bool) -> int:
    """Static page-table width for a plan of `pages` columns: max_pages, or (bucketed) the smallest
    power of two >= pages, capped at max_pages."""
    return min(max_pages, 1 << max(pages - 1, 0).bit_length()) if bucketed else max_pages


def static_plan(bucket: int, max_seqs: int, pages: int, device: torch.device | str) -> BatchPlan:
    """Zeroed static buffers of one graph: `bucket` rows, max_seqs + 1 sequences (the last: pad rows)."""
    z = lambda *shape, dtype=torch.int64: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
    return BatchPlan(token_ids=z(bucket), positions=z(bucket), write_slots=z(bucket),
                     row_starts=z(max_seqs + 2), prefix_lens=z(max_seqs + 1), page_table=z(max_seqs + 1, pages),
                     tree_mask=z(bucket, bucket, dtype=torch.bool))


def fill_plan(static: BatchPlan, plan: BatchPlan, pad_slot: int) -> None:
    """Copy a plan into a graph's buffers in place, padding as the module docstring says (device-side
    copies only: no host sync, so consecutive steps queue without waiting)."""
    T, B, P, R = plan.num_rows, plan.prefix_lens.shape[0], plan.page_table.shape[1], plan.tree_mask.shape[1]
    bucket = static.token_ids.shape[0]
    for name in ("token_ids", "positions"):
        buf = getattr(static, name)
        buf[:T] = getattr(plan, name)
        buf[T:] = 0
    static.write_slots[:T] = plan.write_slots
    static.write_slots[T:] = pad_slot
    static.row_starts[: B + 1] = plan.row_starts
    static.row_starts[B + 1:] = T  # empty sequences B .. max_seqs-1
    static.row_starts[-1] = bucket  # the pad sequence: rows [T, bucket)
    static.prefix_lens.zero_()
    static.prefix_lens[:B] = plan.prefix_lens
    static.page_table.zero_()
    static.page_table[:B, :P] = plan.page_table
    static.tree_mask.zero_()
    static.tree_mask[:T, :R] = plan.tree_mask
    pad = torch.arange(bucket - T, device=static.tree_mask.device)
    static.tree_mask[T + pad, pad] = True  # a pad row sees itself only


def empty_plan(static: BatchPlan) -> BatchPlan:
    """A plan of zero real rows (everything is pad) with the static buffers' shapes."""
    dev = static.token_ids.device
    e = torch.zeros(0, dtype=torch.int64, device=dev)
    return replace(static, token_ids=e, positions=e, write_slots=e, row_starts=torch.zeros(1, dtype=torch.int64, device=dev),
                   prefix_lens=e, page_table=torch.zeros(0, static.page_table.shape[1], dtype=torch.int64, device=dev),
                   tree_mask=torch.zeros(0, 0, dtype=torch.bool, device=dev))
