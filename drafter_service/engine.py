"""DrafterEngine: the one object the Drafter gRPC servicer talks to (Propose / Release / GetInfo).

propose(items) for a batch of sessions, in one pass:
  1. validate each item (a bad item becomes an ItemError naming the field; the others go on);
  2. plan each session's cache (sessions.SessionTable): resync_required or reset, pages, LRU eviction;
  3. inject all new context rows of the batch together (fc → hidden_norm → per-layer k/v, k_norm, RoPE);
  4. one batched block forward [root, mask × (B-1)] over the planned sessions;
  5. per-depth log-softmax + top-K on the device, one D2H copy, then the host heap builds each tree.
The engine is thread-safe (one lock): the servicer may call it from any gRPC worker thread.
"""

from __future__ import annotations

import contextlib
import enum
import numbers
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Hashable, Sequence

import numpy as np
import torch

from .graphs import DrafterGraphs, block_logits, inject_rows, packed_trees, unpack_trees
from .kv_cache import KVPool, context_tables, page_bytes
from .model import DFlashDrafter
from .sessions import CacheFullError, InjectPlan, Resync, SessionTable, UnknownSessionError
from .tree import Tree, build_tree, topk_logprobs
from .weights import load_drafter

__all__ = ["DraftMode", "DrafterEngine", "DrafterInfo", "EngineOptions", "ItemError", "Proposal",
           "ProposeItem", "ResyncRequired", "UnknownSessionError"]


class DraftMode(str, enum.Enum):
    CHAIN = "chain"  # the block's argmax chain: B-1 nodes (tree_budget ignored)
    DDTREE = "ddtree"  # the tree_budget most probable prefixes (top-K ranks, K = min(budget, vocab))


@dataclass(frozen=True)
class EngineOptions:
    # Drafter KV pool, allocated (zero-filled) once; LRU sessions are evicted beyond it. Kimi: 24 KiB per row
    # (6 layers · K,V · 8 heads · 128 · bf16), so a 4096-row window is 96 MiB per session — size it per GPU.
    cache_bytes: int = 1 << 30
    window: int | None = 4096  # context rows attended per session (None = all)
    page_size: int = 64  # context rows per pool page
    max_tree_budget: int = 1024  # largest tree_budget accepted
    max_inject_rows: int = 8192  # rows per fc/k/v pass, bounds activation memory on long prefills
    use_kernels: bool = True  # on CUDA: kernels/rms_norm (norms + RoPE) and kernels/ddtree_build (k <= 64)
    cuda_graphs: bool = True  # on CUDA: replay inject and block forward from CUDA graphs (graphs.py)

    def __post_init__(self):
        if self.window is not None and self.window <= 0:
            raise ValueError(f"window must be > 0 or None, got {self.window}")
        if self.page_size <= 0 or self.max_tree_budget <= 0 or self.max_inject_rows <= 0:
            raise ValueError(f"page_size, max_tree_budget and max_inject_rows must be > 0: {self}")


@dataclass(frozen=True)
class ProposeItem:
    session_id: Hashable
    start_position: int  # absolute position of features[0]; must equal the cache length unless reset
    features: torch.Tensor  # [n, len(target_layer_ids)·H] target feature rows, any float dtype/device
    root_token: int  # the pending bonus token b at position start_position + n
    tree_budget: int  # non-root nodes N in [1, max_tree_budget] (ddtree); ignored in chain mode
    mode: DraftMode | str = DraftMode.DDTREE
    return_draft_logprobs: bool = False
    reset: bool = False  # resync: drop the session's cache and restart it at start_position


@dataclass(frozen=True)
class Proposal:
    session_id: Hashable
    tree: Tree
    cache_len: int  # drafter cache length after injection (= root position)
    topk_ids: np.ndarray | None = None  # [B-1, K] int64 per depth, best first (K = 1 for chain)
    topk_logprobs: np.ndarray | None = None  # [B-1, K] float32 log-softmax of the draft logits


@dataclass(frozen=True)
class ResyncRequired:
    session_id: Hashable
    cache_len: int  # the drafter's cache length; resend the last W rows (start = max(0, s - W))


@dataclass(frozen=True)
class ItemError:
    session_id: Hashable
    field: str  # the offending ProposeItem field, for INVALID_ARGUMENT
    message: str


ProposeResult = Proposal | ResyncRequired | ItemError


@dataclass(frozen=True)
class DrafterInfo:
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    hidden_size: int
    target_hidden_size: int  # equals hidden_size for DFlash (the drafter reuses the target's tables)
    feature_width: int  # len(target_layer_ids) · hidden_size
    vocab_size: int
    max_tree_budget: int
    max_chain_budget: int  # block_size - 1
    window: int | None
    page_size: int
    sessions: int
    bytes_used: int
    bytes_total: int
    dtype: str
    device: str
    model_name: str


class DrafterEngine:
    def __init__(self, model: DFlashDrafter, options: EngineOptions = EngineOptions(), *, name: str = "dflash"):
        self.model, self.cfg, self.options, self.name = model, model.cfg, options, name
        self.device, self.dtype = model.device, model.dtype
        model.use_kernels(options.use_kernels)
        cfg = self.cfg
        self._page_bytes = page_bytes(cfg.num_hidden_layers, options.page_size, cfg.num_key_value_heads,
                                      cfg.head_dim, self.dtype)
        num_pages = options.cache_bytes // self._page_bytes
        window_pages = -(-options.window // options.page_size) + 1 if options.window else 1
        if num_pages - 1 < window_pages:  # the pool's last page is the pad page (graph pad rows write there)
            raise ValueError(f"cache_bytes={options.cache_bytes} holds {num_pages} pages of {self._page_bytes} "
                             f"bytes; one session's window of {options.window} rows needs {window_pages} + 1")
        self.pool = KVPool(cfg.num_hidden_layers, num_pages, options.page_size, cfg.num_key_value_heads,
                           cfg.head_dim, self.dtype, self.device)
        self.sessions = SessionTable(num_pages - 1, options.page_size, options.window)
        self.graphs = None
        if options.cuda_graphs and self.device.type == "cuda":
            self.graphs = DrafterGraphs(model, self.pool, pad_slot=(num_pages - 1) * options.page_size,
                                        max_pages=window_pages if options.window else 256)
        self._lock = threading.Lock()

    @classmethod
    def load(cls, drafter_dir: str | Path, target_dir: str | Path, *, device: torch.device | str = "cpu",
             dtype: torch.dtype = torch.bfloat16, options: EngineOptions = EngineOptions(),
             yarn_amplitude: float | None = None) -> "DrafterEngine":
        model = load_drafter(drafter_dir, target_dir, device=device, dtype=dtype, yarn_amplitude=yarn_amplitude)
        return cls(model, options, name=Path(drafter_dir).name)

    def _on_device(self):
        """This engine's GPU as the calling thread's current device: graph replays and kernel launches
        go to the current device's stream, and callers (gRPC event loop, worker threads) start on GPU 0."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def warm_up(self) -> int:
        """Before serving: compile and load the tree kernel (NVRTC takes ~1 s on a machine without the
        kernel cache; inside the first Propose that blocked the event loop past the verifier's health
        check, which then dropped this replica for a second) and capture the CUDA graphs of the common
        step shapes; returns how many graphs exist."""
        if self.device.type != "cuda":
            return 0
        with self._lock, self._on_device(), torch.inference_mode():
            if self.options.use_kernels:
                from kernels.ddtree_build import ddtree_build

                logits = torch.zeros(1, self.cfg.horizon, self.model.vocab_size, device=self.device)
                ddtree_build(logits, min(8, self.model.vocab_size), 8)
                torch.cuda.synchronize(self.device)
            return 0 if self.graphs is None else self.graphs.capture_all(self.cfg.block_size)

    def info(self) -> DrafterInfo:
        cfg, opt = self.cfg, self.options
        with self._lock:
            sessions, pages = len(self.sessions), self.sessions.pages_used
        return DrafterInfo(
            block_size=cfg.block_size, target_layer_ids=cfg.target_layer_ids, mask_token_id=cfg.mask_token_id,
            hidden_size=cfg.hidden_size, target_hidden_size=cfg.hidden_size, feature_width=cfg.feature_width,
            vocab_size=self.model.vocab_size,
            max_tree_budget=opt.max_tree_budget, max_chain_budget=cfg.horizon, window=opt.window,
            page_size=opt.page_size, sessions=sessions, bytes_used=pages * self._page_bytes,
            bytes_total=self.pool.nbytes, dtype=str(self.dtype).removeprefix("torch."), device=str(self.device),
            model_name=self.name)

    def cache_len(self, session_id: Hashable) -> int:
        with self._lock:
            return self.sessions.cache_len(session_id)

    def release(self, session_id: Hashable) -> None:
        """Drop a session's cache; raises UnknownSessionError (a KeyError) if the session is not held."""
        with self._lock:
            self.sessions.release(session_id)

    @torch.inference_mode()
    def propose(self, items: Sequence[ProposeItem]) -> list[ProposeResult]:
        """One result per item, in order. Only a device fault raises; bad items become ItemError."""
        with self._lock, self._on_device():
            results: list[ProposeResult | None] = [None] * len(items)
            batch = {item.session_id for item in items}  # never evicted while this batch runs
            seen: set[Hashable] = set()
            planned: list[tuple[int, ProposeItem, InjectPlan]] = []
            for i, item in enumerate(items):
                results[i] = self._validate(item, seen)
                seen.add(item.session_id)
                if results[i] is None:
                    results[i], plan = self._plan(item, batch)
                    if plan is not None:
                        planned.append((i, item, plan))
            try:
                self._inject([(item, plan) for _, item, plan in planned])
                proposals = self._draft(planned)
            except BaseException:  # device fault: planned rows were never written, so forget those sessions
                for _, item, _ in planned:
                    if item.session_id in self.sessions:
                        self.sessions.release(item.session_id)
                raise
            for (i, _, _), proposal in zip(planned, proposals):
                results[i] = proposal
            return results  # type: ignore[return-value]

    def _validate(self, item: ProposeItem, seen: set[Hashable]) -> ItemError | None:
        def error(field: str, message: str) -> ItemError:
            return ItemError(item.session_id, field, f"{field}: {message}")

        if item.session_id is None or item.session_id == "":
            return error("session_id", "must be non-empty")
        if item.session_id in seen:
            return error("session_id", "appears more than once in one Propose batch")
        if item.mode not in (DraftMode.CHAIN, DraftMode.DDTREE):
            return error("mode", f"must be 'chain' or 'ddtree', got {item.mode!r}")
        if not _is_int(item.start_position) or item.start_position < 0:
            return error("start_position", f"must be an int >= 0, got {item.start_position!r}")
        f = item.features
        width = self.cfg.feature_width
        if not isinstance(f, torch.Tensor) or f.ndim != 2 or f.shape[1] != width or not f.is_floating_point():
            shape = tuple(f.shape) if isinstance(f, torch.Tensor) else type(f).__name__
            return error("features", f"expected float rows [n, {width}] (len(target_layer_ids)="
                                     f"{len(self.cfg.target_layer_ids)} x hidden {self.cfg.hidden_size}), got {shape}")
        if not _is_int(item.root_token) or not 0 <= item.root_token < self.model.vocab_size:
            return error("root_token", f"must be in [0, vocab={self.model.vocab_size}), got {item.root_token!r}")
        limit = self.options.max_tree_budget
        if item.mode == DraftMode.DDTREE and (not _is_int(item.tree_budget) or not 1 <= item.tree_budget <= limit):
            return error("tree_budget", f"must be in [1, {limit}], got {item.tree_budget!r}")
        return None

    def _plan(self, item: ProposeItem, batch: set[Hashable]) -> tuple[ProposeResult | None, InjectPlan | None]:
        try:
            plan = self.sessions.plan(item.session_id, item.start_position, item.features.shape[0], item.reset,
                                      batch)
        except CacheFullError as e:
            return ItemError(item.session_id, "features", f"features: {e}"), None
        if isinstance(plan, Resync):
            return ResyncRequired(item.session_id, plan.cache_len), None
        return None, plan

    def _inject(self, work: list[tuple[ProposeItem, InjectPlan]]) -> None:
        """Write the context K/V of every planned item's new rows (only those inside the window)."""
        rows = [(item.features[plan.skip:], plan) for item, plan in work if plan.slots]
        if not rows:
            return
        features = torch.cat([f for f, _ in rows]) if len(rows) > 1 else rows[0][0]  # [n_total, F]
        positions = np.fromiter((p for _, plan in rows for p in plan.positions), dtype=np.int64)
        slots = np.fromiter((s for _, plan in rows for s in plan.slots), dtype=np.int64)
        if self.graphs is not None and self.graphs.inject(features, positions, slots):
            return
        features = features.to(self.device, self.dtype, non_blocking=True)
        positions, slots = torch.from_numpy(positions).to(self.device), torch.from_numpy(slots).to(self.device)
        step = self.options.max_inject_rows
        for lo in range(0, features.shape[0], step):
            inject_rows(self.model, self.pool, features[lo:lo + step], positions[lo:lo + step], slots[lo:lo + step])

    def _draft(self, work: list[tuple[int, ProposeItem, InjectPlan]]) -> list[Proposal]:
        """One batched block forward over the sessions in `work`, then one tree per session."""
        if not work:
            return []
        cfg, horizon = self.cfg, self.cfg.horizon
        plans = [plan for _, _, plan in work]
        block_ids = np.full((len(work), cfg.block_size), cfg.mask_token_id, dtype=np.int64)
        block_ids[:, 0] = [item.root_token for _, item, _ in work]
        block_pos = np.array([plan.length for plan in plans], dtype=np.int64)[:, None] + np.arange(cfg.block_size)
        page_table, meta = context_tables(plans)  # block root at the cache length
        logits = None if self.graphs is None else self.graphs.block(block_ids, block_pos, page_table, meta)
        replayed = logits is not None  # the logits sit in a graph's static buffer (graphs.tree reads them)
        if logits is None:
            dev = [torch.from_numpy(a).to(self.device) for a in (block_ids, block_pos, page_table, meta)]
            logits = block_logits(self.model, self.pool, *dev)  # [B, B-1, V]
        ks = [1 if item.mode == DraftMode.CHAIN else min(item.tree_budget, self.model.vocab_size)
              for _, item, _ in work]
        if self._device_trees(work, ks):
            return self._draft_on_device(work, logits, replayed)
        ids, logprobs = topk_logprobs(logits, max(ks))  # [B, B-1, K_max] on the host
        proposals = []
        for b, ((_, item, plan), k) in enumerate(zip(work, ks)):
            budget = horizon if item.mode == DraftMode.CHAIN else item.tree_budget
            tree = build_tree(ids[b, :, :k], logprobs[b, :, :k], budget)
            extra = (ids[b, :, :k].copy(), logprobs[b, :, :k].copy()) if item.return_draft_logprobs else (None, None)
            proposals.append(Proposal(item.session_id, tree, plan.length, *extra))
        return proposals

    def _device_trees(self, work, ks: list[int]) -> bool:
        """The CUDA builder takes one (k, budget) for the batch, k <= 64, and returns no top-K tables."""
        budgets = {self.cfg.horizon if item.mode == DraftMode.CHAIN else item.tree_budget for _, item, _ in work}
        return (self.options.use_kernels and self.device.type == "cuda" and len(set(ks)) == 1 and ks[0] <= 64
                and len(budgets) == 1 and not any(item.return_draft_logprobs for _, item, _ in work))

    def _draft_on_device(self, work, logits: torch.Tensor, replayed: bool) -> list[Proposal]:
        """kernels/ddtree_build: per-depth log-softmax + top-K and the best-first tree on the GPU;
        only the trees cross to the host (same trees as tree.build_tree, ties included). `replayed`: the
        logits came from a block graph, so the tree replays from a graph too (graphs.tree)."""
        item0 = work[0][1]
        chain = item0.mode == DraftMode.CHAIN
        k = 1 if chain else min(item0.tree_budget, self.model.vocab_size)
        budget = self.cfg.horizon if chain else item0.tree_budget
        if replayed:
            flat = self.graphs.tree(len(work), k, budget)
        else:  # one device→host copy, the step's only sync
            flat = packed_trees(logits.contiguous(), k, budget).cpu().numpy()
        return [Proposal(item.session_id, tree, plan.length)
                for (_, item, plan), tree in zip(work, unpack_trees(flat, budget))]


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)
