"""CUDA graphs of the target forward, one per row bucket (issue 6): replaces ~1 kernel launch per op
(hundreds per step, host-bound at ~8 ms) by one graph launch.

A step's BatchPlan is padded into the bucket's static buffers:
- sessions: the plan's B sequences, then empty ones up to `max_seqs`, then one pad sequence holding
  the pad rows [T, bucket) (prefix 0, each pad row sees only itself, writes to a reserved pad slot);
- page_table [max_seqs + 1, max_pages], tree_mask [bucket, bucket];
- logits and layer features are computed for every row and sliced afterwards.
Capture happens on the first use of a bucket, after one eager run of the same shapes (loads the
kernels: nothing may compile or allocate inside a capture). All buckets share one memory pool.
Every rank pads and replays identically, so collectives inside the graphs line up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from verifier_service.model import ForwardOutput, K2Model
from verifier_service.plan import BatchPlan

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PAD_SESSION = "__graph_pad__"


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    plan: BatchPlan  # static input buffers
    out: ForwardOutput  # static outputs, all rows


class GraphRunner:
    def __init__(self, model: K2Model, cache, *, max_seqs: int, max_pages: int):
        self.model, self.cache = model, cache
        self.max_seqs, self.max_pages = max_seqs, max_pages
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, tuple[int, ...]], _Graph] = {}
        cache.table.open(PAD_SESSION)  # one page whose first slot takes every pad row's latent
        self.pad_slot = cache.table.extend(PAD_SESSION, 1)[0]

    def fits(self, plan: BatchPlan) -> bool:
        return (not plan.explicit_mla and plan.num_rows <= BUCKETS[-1]
                and plan.prefix_lens.shape[0] <= self.max_seqs and plan.page_table.shape[1] <= self.max_pages)

    def forward(self, plan: BatchPlan, layer_ids: Sequence[int]) -> ForwardOutput:
        rows = plan.num_rows
        bucket = next(b for b in BUCKETS if b >= rows)
        key = (bucket, tuple(layer_ids))
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._capture(bucket, tuple(layer_ids))
        self._fill(g.plan, plan)
        g.graph.replay()
        logit_rows = torch.arange(rows, device=plan.token_ids.device) if plan.logit_rows is None else plan.logit_rows
        hidden_rows = slice(None, rows) if plan.hidden_rows is None else plan.hidden_rows
        return ForwardOutput(logits=g.out.logits[logit_rows].clone(), hidden=g.out.hidden[hidden_rows].clone())

    def _static(self, bucket: int) -> BatchPlan:
        dev = self.cache.kv.device
        z = lambda *shape, dtype=torch.int64: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
        return BatchPlan(token_ids=z(bucket), positions=z(bucket), write_slots=z(bucket),
                         row_starts=z(self.max_seqs + 2), prefix_lens=z(self.max_seqs + 1),
                         page_table=z(self.max_seqs + 1, self.max_pages),
                         tree_mask=z(bucket, bucket, dtype=torch.bool))

    def _fill(self, static: BatchPlan, plan: BatchPlan) -> None:
        """Copy a plan into a bucket's buffers, padding as the module docstring says."""
        T, B, P, R = plan.num_rows, plan.prefix_lens.shape[0], plan.page_table.shape[1], plan.tree_mask.shape[1]
        bucket = static.token_ids.shape[0]
        for name in ("token_ids", "positions"):
            buf = getattr(static, name)
            buf[:T] = getattr(plan, name)
            buf[T:] = 0
        static.write_slots[:T] = plan.write_slots
        static.write_slots[T:] = self.pad_slot
        static.row_starts[: B + 1] = plan.row_starts
        static.row_starts[B + 1:] = T
        static.row_starts[-1] = bucket  # the pad sequence: rows [T, bucket)
        static.prefix_lens.zero_()
        static.prefix_lens[:B] = plan.prefix_lens
        static.page_table.zero_()
        static.page_table[:B, :P] = plan.page_table
        static.tree_mask.zero_()
        static.tree_mask[:T, :R] = plan.tree_mask
        pad = torch.arange(bucket - T, device=static.tree_mask.device)
        static.tree_mask[T + pad, pad] = True  # a pad row sees itself only

    def _capture(self, bucket: int, layer_ids: tuple[int, ...]) -> _Graph:
        static = self._static(bucket)
        self._fill(static, _empty_plan(static, bucket))
        self.model.forward(static, self.cache.kv, layer_ids)  # eager run: loads kernels, warms the allocator
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.model.forward(static, self.cache.kv, layer_ids)
        return _Graph(graph, static, out)


def _empty_plan(static: BatchPlan, bucket: int) -> BatchPlan:
    """A plan of zero real rows (everything is pad) with the static buffers' shapes."""
    dev = static.token_ids.device
    e = torch.zeros(0, dtype=torch.int64, device=dev)
    return replace(static, token_ids=e, positions=e, write_slots=e, row_starts=torch.zeros(1, dtype=torch.int64, device=dev),
                   prefix_lens=e, page_table=torch.zeros(0, static.page_table.shape[1], dtype=torch.int64, device=dev),
                   tree_mask=torch.zeros(0, 0, dtype=torch.bool, device=dev))
