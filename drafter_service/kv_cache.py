"""Drafter KV pool: the injected context K/V of every session, allocated once from a byte budget.

Layout (contract for the future CUDA attention kernel):
  k, v: [num_layers, num_pages * page_size, num_kv_heads, head_dim] in the model dtype.
  A flat slot = page * page_size + offset holds one context row: K after k_norm and RoPE at the row's absolute
  position, V as projected. Which slots belong to which session and position is sessions.SessionTable's job.
Block K/V never enters the pool (reference/ddtree.md P12): the block's own keys are concatenated per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .sessions import InjectPlan


def page_bytes(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one page: K and V rows for every layer."""
    return 2 * num_layers * page_size * num_kv_heads * head_dim * dtype.itemsize


class KVPool:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        # Zero-filled so that padded (masked) slots are finite: masked attention weights are exactly 0, and
        # 0 · finite = 0 keeps them out of the output.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots [n] int64; k, v [layers, n, nkv, hd]."""
        self.k[:, slots] = k.to(self.k.dtype)
        self.v[:, slots] = v.to(self.v.dtype)

    def gather(self, layer: int, slot_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slot_table [B, Lc] int64 → K, V [B, Lc, nkv, hd] of one layer."""
        return self.k[layer][slot_table], self.v[layer][slot_table]


@dataclass(frozen=True)
class ContextBatch:
    """The context keys a batch of blocks attends to, padded to the longest page table."""
    slots: torch.Tensor  # [B, Lc] int64 pool slots (padding points at slot 0..P-1 and is masked)
    positions: torch.Tensor  # [B, Lc] int64 absolute position of each slot
    valid: torch.Tensor  # [B, Lc] bool: inside the session's window and already injected


def context_tables(plans: Sequence[InjectPlan]) -> tuple[np.ndarray, np.ndarray]:
    """Host half of a ContextBatch: page_table [B, P] int64 (each session's pages, padded with page 0) and
    meta [B, 3] int64 (first_pos, visible_from, length) per session."""
    max_pages = max(len(p.pages) for p in plans)
    page_table = np.zeros((len(plans), max_pages), dtype=np.int64)
    for b, plan in enumerate(plans):
        page_table[b, : len(plan.pages)] = plan.pages
    meta = np.array([[p.first_pos, p.visible_from, p.length] for p in plans], dtype=np.int64).reshape(-1, 3)
    return page_table, meta


def context_from_tables(page_table: torch.Tensor, meta: torch.Tensor, page_size: int) -> ContextBatch:
    """Device half: slots, positions and visibility from the tables (no host sync: CUDA-graph safe). A row
    of zeros in meta (a graph's pad session) sees no context key."""
    offsets = torch.arange(page_size, device=page_table.device)
    slots = (page_table[:, :, None] * page_size + offsets).flatten(1)  # [B, P * page_size]
    positions = meta[:, :1] + torch.arange(slots.shape[1], device=page_table.device)  # pages are contiguous
    valid = (positions >= meta[:, 1:2]) & (positions < meta[:, 2:3])  # padding pages lie past `length`
    return ContextBatch(slots, positions, valid)

