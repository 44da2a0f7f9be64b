"""The batch plan: what one target forward computes, for prefill chunks, decode steps and tree verifies.

A batch holds B sequences (sessions); each contributes a contiguous run of rows. A row attends
1. its sequence's committed prefix: `prefix_lens[b]` keys read through `page_table[b]` (paged cache),
2. the rows of its own sequence that `tree_mask` marks: its tree ancestors and itself (a chain for
   prefill, a single row for decode).
Every row's latent is first written to `write_slots[t]` (scratch for tree rows, the session's own next
slots for prefill), so attention reads all keys from the cache. This is the layout a paged
tree-attention kernel takes (DESIGN §2 step 3): page table + prefix length + per-sequence custom mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BatchPlan:
    token_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T] absolute RoPE positions (prefix_len + depth for tree rows)
    write_slots: torch.Tensor  # int64 [T] cache slot (page * page_size + offset) receiving each row's latent
    row_starts: torch.Tensor  # int64 [B+1] rows of sequence b: row_starts[b] .. row_starts[b+1]-1
    prefix_lens: torch.Tensor  # int64 [B] committed keys of sequence b
    page_table: torch.Tensor  # int64 [B, P] page ids of sequence b in position order (unused tail: 0)
    tree_mask: torch.Tensor  # bool [T, R] row t sees row row_starts[b]+j of its sequence iff [t, j]
    logit_rows: torch.Tensor | None = None  # int64 [Rl] rows whose logits are returned; None = all
    hidden_rows: torch.Tensor | None = None  # int64 [Rh] rows whose layer features are returned; None = all
    explicit_mla: bool = False  # decompressed-K/V form (prefill); False = absorbed latent form

    def __post_init__(self) -> None:
        t, b = self.token_ids.shape[0], self.prefix_lens.shape[0]
        for name in ("positions", "write_slots"):
            if getattr(self, name).shape != (t,):
                raise ValueError(f"BatchPlan.{name} must be [T={t}], got {tuple(getattr(self, name).shape)}")
        if self.row_starts.shape != (b + 1,) or self.page_table.shape[0] != b:
            raise ValueError("BatchPlan.row_starts / page_table do not match prefix_lens' batch size")
        if self.tree_mask.dim() != 2 or self.tree_mask.shape[0] != t:
            raise ValueError(f"BatchPlan.tree_mask must be [T={t}, R], got {tuple(self.tree_mask.shape)}")

    @property
    def num_rows(self) -> int:
        return self.token_ids.shape[0]


@dataclass(frozen=True)
class SeqRows:
    """One sequence's rows for `build_plan`. `parents[i]` is the local row that row i hangs under
    (< i), or -1 for a row that follows the prefix directly (the tree root; row 0 of a chain)."""

    token_ids: Sequence[int]
    parents: Sequence[int]
    prefix_len: int
    pages: Sequence[int]  # the session's pages, covering at least its prefix
    write_slots: Sequence[int]
    positions: Sequence[int] | None = None  # default: prefix_len + depth


def chain_parents(n: int) -> list[int]:
    """Parents of a plain causal run of n rows (prefill chunk, or a path)."""
    return list(range(-1, n - 1))


def tree_parents(node_parents: Sequence[int]) -> list[int]:
    """Rows [root b, node 1..N] from DDTree's `parents[i-1]` ∈ [0, i) (0 = root) -> row parents."""
    return [-1, *node_parents]


def build_plan(
    seqs: Sequence[SeqRows],
    *,
    logit_rows: Sequence[int] | None = None,
    hidden_rows: Sequence[int] | None = None,
    explicit_mla: bool = False,
    device: torch.device | str = "cpu",
) -> BatchPlan:
    """Host-side assembly of a BatchPlan (depths, ancestor masks, padding) from per-sequence rows."""
    max_rows = max((len(s.token_ids) for s in seqs), default=0)
    max_pages = max((len(s.pages) for s in seqs), default=0)
    positions: list[int] = []
    starts, tokens, slots, masks = [0], [], [], []
    for s in seqs:
        n = len(s.token_ids)
        if not (len(s.parents) == len(s.write_slots) == n):
            raise ValueError("SeqRows: token_ids, parents and write_slots differ in length")
        depth, mask = _ancestors(s.parents)
        positions += list(s.positions) if s.positions is not None else [s.prefix_len + d for d in depth]
        masks.append(mask)
        tokens += s.token_ids
        slots += s.write_slots
        starts.append(starts[-1] + n)
    tree_mask = torch.zeros(len(tokens), max_rows, dtype=torch.bool)
    for b, mask in enumerate(masks):
        tree_mask[starts[b]:starts[b + 1], : mask.shape[1]] = mask

    def ints(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int64, device=device)

    padded_pages = [p for s in seqs for p in [*s.pages, *[0] * (max_pages - len(s.pages))]]
    return BatchPlan(
        token_ids=ints(tokens),
        positions=ints(positions),
        write_slots=ints(slots),
        row_starts=ints(starts),
        prefix_lens=ints([s.prefix_len for s in seqs]),
        page_table=ints(padded_pages).view(len(seqs), max_pages),
        tree_mask=tree_mask.to(device),
        logit_rows=None if logit_rows is None else ints(logit_rows),
        hidden_rows=None if hidden_rows is None else ints(hidden_rows),
        explicit_mla=explicit_mla,
    )


def _ancestors(parents: Sequence[int]) -> tuple[list[int], torch.Tensor]:
    """-> depth of each row, and bool [n, n]: row i sees row j iff j is i or an ancestor of i."""
    n = len(parents)
    if list(parents) == chain_parents(n):  # prefill chunks: plain causal, no per-row loop
        return list(range(n)), torch.ones(n, n, dtype=torch.bool).tril()
    depth: list[int] = []
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"row {i}: parent {p} must be -1 or an earlier row")
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth, mask


@dataclass(frozen=True)
class KeyGroup:
    """The keys one sequence's rows attend to (reference attention path)."""

    rows: slice  # the sequence's rows in the batch
    key_slots: torch.Tensor  # int64 [S] prefix slots, then the sequence's own rows' write slots
    mask: torch.Tensor  # bool [R, S] row r may attend key s


def key_groups(plan: BatchPlan, page_size: int) -> list[KeyGroup]:
    """Resolve the plan's page table into flat cache slots per sequence (once per forward)."""
    groups = []
    starts, prefix_lens = plan.row_starts.tolist(), plan.prefix_lens.tolist()
    device = plan.token_ids.device
    for b, prefix in enumerate(prefix_lens):
        r0, r1 = starts[b], starts[b + 1]
        pos = torch.arange(prefix, device=device)
        prefix_slots = plan.page_table[b, pos // page_size] * page_size + pos % page_size  # [prefix]
        key_slots = torch.cat([prefix_slots, plan.write_slots[r0:r1]])
        seen = torch.ones(r1 - r0, prefix, dtype=torch.bool, device=device)
        mask = torch.cat([seen, plan.tree_mask[r0:r1, : r1 - r0]], dim=1)  # [R, prefix + R]
        groups.append(KeyGroup(slice(r0, r1), key_slots, mask))
    return groups
