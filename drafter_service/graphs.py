"""The drafter's per-step device work, run eagerly or replayed from CUDA graphs.

A propose step on the GPU is three pieces of device work (engine.py):
  inject_rows  new target feature rows → context K/V written into the pool;
  block_logits the batched block forward over the sessions' context → draft logits [B, Bk-1, V];
  ddtree_build the trees from those logits (kernels/ddtree_build).
Eagerly each is hundreds of small kernel launches (a kimi-tiny step: ~250 launches, 8 ms of host time for
0.5 ms of GPU work, H200 2026-11-29), so on CUDA both replay from graphs captured per shape bucket:

  inject: rows n padded to INJECT_BUCKETS; pad rows write to the pool's pad slot (a page no session owns);
  block:  sessions padded to BATCH_BUCKETS (pad sessions: meta row 0 → no visible context key), page-table
          width padded to the next power of two (pad pages lie past `length`: masked); every block graph of
          a batch bucket leaves its logits in that bucket's one static logits buffer;
  tree:   per (batch bucket, k, budget), the tree kernel over the bucket's logits buffer, its four outputs
          packed into one int64 row per session and read back with one copy into pinned memory (its host
          side eagerly, eight allocations and a cuda-python launch, took 150 us of a 650 us Propose on an
          H200 host, 2026-11-30).

Static inputs of a graph are views into one flat int64 device buffer, filled from a pinned host twin with
one copy per replay. Inputs beyond the largest bucket (a resync of a long window, a very large batch) run
eagerly. The service captures the common buckets while warming up (capture_all); any other bucket is captured
on its first use. A capture follows one eager run of the same shapes (nothing may allocate or compile
inside a capture); all graphs share one memory pool (they never replay concurrently: the engine's lock).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .kv_cache import KVPool, context_from_tables
from .model import DFlashDrafter, PagedContext
from .tree import Tree

INJECT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)


def inject_rows(model: DFlashDrafter, pool: KVPool, features: torch.Tensor, positions: torch.Tensor,
                slots: torch.Tensor) -> None:
    """features [n, F] (model dtype), positions/slots [n] int64 → K/V of every layer written at `slots`."""
    k, v = model.context_kv(features, positions)
    pool.write(slots, k, v)


def block_logits(model: DFlashDrafter, pool: KVPool, block_ids: torch.Tensor, block_pos: torch.Tensor,
                 page_table: torch.Tensor, meta: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """block_ids/block_pos [B, Bk], page_table [B, P], meta [B, 3] (kv_cache.context_tables) → fp32 logits
    [B, Bk-1, V] of the block's slots 1.. (slot 0, the anchor, predicts nothing), in `out` if given."""
    ctx = context_from_tables(page_table, meta, pool.page_size)
    if model.paged_attention:  # kernels/dflash_attention reads the pool's pages itself
        def layer_ctx(layer: int) -> PagedContext:
            return PagedContext(pool.k[layer], pool.v[layer], page_table, pool.page_size)
    else:
        def layer_ctx(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            return pool.gather(layer, ctx.slots)
    hidden = model.forward_block(block_ids, block_pos, ctx.positions, ctx.valid, layer_ctx)
    return model.logits(hidden[:, 1:], out=out)


def packed_trees(logits: torch.Tensor, k: int, budget: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """kernels/ddtree_build's trees of logits [S, L, V] packed as int64 [S, 4 * budget + 1] = tokens | parents |
    depths | logprobs (fp32 bits in the low word) | count per session (into `out` if given), so that one device→host
    copy reads them (`unpack_trees`)."""
    from kernels.ddtree_build import ddtree_build

    tokens, parents, depths, logprobs, count = ddtree_build(logits, k, budget)
    return torch.cat([tokens, parents.long(), depths.long(), logprobs.view(torch.int32).long(), count.long()[:, None]],
                     dim=1, out=out)


def unpack_trees(flat: np.ndarray, budget: int) -> list:
    """`packed_trees`' host copy [S, 4 * budget + 1] -> one tree.Tree per session."""
    tokens, parents, depths, bits = (flat[:, i * budget:(i + 1) * budget] for i in range(4))
    logprobs = bits.astype(np.int32).view(np.float32)  # the low 32 bits: the fp32 the device wrote
    return [Tree(tokens[b, :n].copy(), parents[b, :n].astype(np.int32), depths[b, :n].astype(np.int32),
                 logprobs[b, :n].copy()) for b, n in enumerate(flat[:, -1].tolist())]


class _Buffers:
    """Named int64 arrays that are views into one flat device buffer and its pinned host twin."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], device: torch.device):
        sizes = {k: int(np.prod(s)) for k, s in shapes.items()}
        total = sum(sizes.values())
        self.device_flat = torch.zeros(total, dtype=torch.int64, device=device)
        self.host_flat = torch.zeros(total, dtype=torch.int64, pin_memory=device.type == "cuda")
        host = self.host_flat.numpy()
        self.dev, self.host, off = {}, {}, 0
        for k, shape in shapes.items():
            self.dev[k] = self.device_flat[off: off + sizes[k]].view(shape)
            self.host[k] = host[off: off + sizes[k]].reshape(shape)
            off += sizes[k]

    def upload(self) -> None:
        # Asynchronous from pinned memory: the caller's step ends with a device→host read of the trees,
        # so the host twin is never rewritten while a copy from it is pending.
        self.device_flat.copy_(self.host_flat, non_blocking=True)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    buffers: _Buffers
    features: torch.Tensor | None  # inject graphs: [n_bucket, F] static feature rows
    out: torch.Tensor | None  # tree graphs: int64 [B_bucket, 4 * budget + 1] as packed_trees packs them
    host: torch.Tensor | None = None  # tree graphs: pinned host twin of `out`


class DrafterGraphs:
    def __init__(self, model: DFlashDrafter, pool: KVPool, *, pad_slot: int, max_pages: int):
        self.model, self.pool, self.pad_slot, self.max_pages = model, pool, pad_slot, max_pages
        self.device = model.device
        self.mempool = torch.cuda.graph_pool_handle()
        self.inject_graphs: dict[int, _Graph] = {}
        self.block_graphs: dict[tuple[int, int], _Graph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # batch bucket -> its block graphs' static logits
        self.tree_graphs: dict[tuple[int, int, int], _Graph] = {}  # (batch bucket, k, budget)

    def inject(self, features: torch.Tensor, positions: np.ndarray, slots: np.ndarray) -> bool:
        """Replay the inject graph of len(positions) rows; False (nothing done) when too many rows."""
        n = len(positions)
        bucket = next((b for b in INJECT_BUCKETS if b >= n), None)
        if bucket is None:
            return False
        g = self.inject_graphs.get(bucket) or self._capture_inject(bucket)
        g.buffers.host["positions"][:n], g.buffers.host["positions"][n:] = positions, 0
        g.buffers.host["slots"][:n], g.buffers.host["slots"][n:] = slots, self.pad_slot
        g.buffers.upload()
        g.features[:n].copy_(features, non_blocking=True)
        g.graph.replay()
        return True

    def block(self, block_ids: np.ndarray, block_pos: np.ndarray, page_table: np.ndarray,
              meta: np.ndarray) -> torch.Tensor | None:
        """Replay the block graph of this batch; logits [B, Bk-1, V] (a view of the graph's static output,
        valid until the next replay), or None when the batch or its page table is too large."""
        B, P = page_table.shape
        bucket = next((b for b in BATCH_BUCKETS if b >= B), None)
        if bucket is None or P > self.max_pages:
            return None
        pages = self._width(P)
        g = self.block_graphs.get((bucket, pages)) or self._capture_block(bucket, pages, block_ids.shape[1])
        h = g.buffers.host
        for name, value in (("block_ids", block_ids), ("block_pos", block_pos), ("meta", meta)):
            h[name][:B], h[name][B:] = value, 0
        h["page_table"][:] = 0
        h["page_table"][:B, :P] = page_table
        g.buffers.upload()
        g.graph.replay()
        return self.logits[bucket][:B]

    def tree(self, sessions: int, k: int, budget: int) -> np.ndarray:
        """After `block` of `sessions` sessions: the trees of its logits (kernels/ddtree_build), as `packed_trees`
        packs them (host int64 [sessions, 4 * budget + 1], valid until the next call); waits for the device."""
        bucket = next(b for b in BATCH_BUCKETS if b >= sessions)
        g = self.tree_graphs.get((bucket, k, budget)) or self._capture_tree(bucket, k, budget)
        g.graph.replay()
        g.host[:sessions].copy_(g.out[:sessions], non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return g.host[:sessions].numpy()

    def capture_all(self, block_size: int, max_batch: int = 8) -> int:
        """Capture every inject bucket and the block graphs of batches up to `max_batch` sessions at every
        page-table width, so that no step pays a capture (tens of ms each); returns the graphs held."""
        for n in INJECT_BUCKETS:
            if n not in self.inject_graphs:
                self._capture_inject(n)
        widths = sorted({self._width(1 << i) for i in range(self.max_pages.bit_length() + 1)})
        for b in (b for b in BATCH_BUCKETS if b <= max_batch):
            for pages in widths:
                if (b, pages) not in self.block_graphs:
                    self._capture_block(b, pages, block_size)
        return len(self.inject_graphs) + len(self.block_graphs)

    def _width(self, pages: int) -> int:
        """Static page-table width for `pages` columns: the next power of two, capped at max_pages."""
        return min(1 << max(pages - 1, 0).bit_length(), self.max_pages)

    def _capture(self, fn) -> torch.cuda.CUDAGraph:
        fn()  # eager run of the same shapes: loads kernels, warms the allocator
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool, capture_error_mode="thread_local"):
            fn()
        return graph

    def _capture_inject(self, bucket: int) -> _Graph:
        buffers = _Buffers({"positions": (bucket,), "slots": (bucket,)}, self.device)
        buffers.dev["slots"].fill_(self.pad_slot)
        features = torch.zeros(bucket, self.model.cfg.feature_width, dtype=self.model.dtype,
                               device=self.device)
        graph = self._capture(lambda: inject_rows(self.model, self.pool, features, buffers.dev["positions"],
                                                  buffers.dev["slots"]))
        g = self.inject_graphs[bucket] = _Graph(graph, buffers, features, None)
        return g

    def _capture_block(self, bucket: int, pages: int, block_size: int) -> _Graph:
        buffers = _Buffers({"block_ids": (bucket, block_size), "block_pos": (bucket, block_size),
                            "page_table": (bucket, pages), "meta": (bucket, 3)}, self.device)
        d = buffers.dev
        if bucket not in self.logits:
            self.logits[bucket] = torch.zeros(bucket, block_size - 1, self.model.vocab_size, device=self.device)
        out = self.logits[bucket]

        def run() -> None:
            block_logits(self.model, self.pool, d["block_ids"], d["block_pos"], d["page_table"], d["meta"], out=out)

        graph = self._capture(run)
        g = self.block_graphs[(bucket, pages)] = _Graph(graph, buffers, None, None)
        return g

    def _capture_tree(self, bucket: int, k: int, budget: int) -> _Graph:
        # ddtree_build's counters exist already: the engine's warm-up called it before any capture
        logits = self.logits[bucket]  # a block graph of this bucket ran just before
        out = torch.zeros(bucket, 4 * budget + 1, dtype=torch.int64, device=self.device)
        graph = self._capture(lambda: packed_trees(logits, k, budget, out=out))
        host = torch.zeros(out.shape, dtype=torch.int64, pin_memory=True)
        g = self.tree_graphs[(bucket, k, budget)] = _Graph(graph, None, None, out, host)
        return g
