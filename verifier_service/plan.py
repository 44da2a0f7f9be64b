"""The batch plan: what one target forward computes, for prefill chunks, decode steps and tree verifies.

A batch holds B sequences (sessions); each contributes a contiguous run of rows. A row attends
1. its sequence's committed prefix: `prefix_lens[b]` keys read through `page_table[b]` (paged cache),
2. the rows of its own sequence that `tree_mask` marks: its tree ancestors and itself (a chain for
   prefill, a single row for decode).
Every row's latent is first written to `write_slots[t]` (scratch for tree rows, the session's own next
slots for prefill), so attention reads all keys from the cache. This is the layout a paged
tree-attention kernel takes (DESIGN §2 step 3): page table + prefix length + per-sequence custom mask.

Host cost per step matters (a 17-row tree verify replays in ~1.3 ms on an H200): `build_plan` computes
every field with Python lists and numpy and writes them into one host buffer (`PackedPlan`), so moving a
plan to the GPU is one copy, and the runner broadcasts and pads (graphs.fill_plan) from that buffer.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import numpy as np
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
    pad_last: bool = False  # the last sequence holds only pad rows over no prefix (graphs.static_plan): live
    # shapes are device-side (kernels/mla_tree_attention: split count of one session, device schedule of more)

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
    pin: bool = False,
) -> BatchPlan:
    """Host-side assembly of a BatchPlan (depths, ancestor masks, padding) from per-sequence rows.

    Built in numpy into ONE host buffer (`PackedPlan`), which one copy moves to `device` (pinned and
    non-blocking when that is a GPU). A CPU plan (`device="cpu"`) keeps its packed buffer, so
    `plan_to`, the runner's broadcast and the CUDA-graph padding read it without further copies;
    `pin=True` pins it (a CPU plan that is headed for a GPU)."""
    dev = torch.device(device)
    return pack_plan(seqs, logit_rows=logit_rows, hidden_rows=hidden_rows, explicit_mla=explicit_mla,
                     pin=pin or dev.type == "cuda").unpack(dev)


# int64 fields of a PackedPlan, in buffer order (the bool tree_mask follows them)
PACKED_INT_FIELDS = ("token_ids", "positions", "write_slots", "row_starts", "prefix_lens", "page_table",
                     "logit_rows", "hidden_rows")
_ALIGN = 64  # byte alignment of the mask (and of every buffer torch allocates)


def _align(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class PackedPlan:
    """A BatchPlan's fields in one host byte buffer: the int64 fields of PACKED_INT_FIELDS back to back
    (`counts` elements each; -1: the optional field is None), then the bool tree_mask's T*R bytes at
    `mask_offset`. One copy moves a whole plan to a device; it is also what rank 0 broadcasts."""

    buffer: torch.Tensor  # uint8 [nbytes] on the CPU (pinned when built for a GPU)
    counts: tuple[int, ...]
    pages: int  # P: page_table is [B, P], B = counts of prefix_lens
    mask_shape: tuple[int, int]  # (T, R)
    explicit_mla: bool = False

    @property
    def mask_offset(self) -> int:
        return _align(8 * sum(max(c, 0) for c in self.counts))

    def unpack(self, device: torch.device | str = "cpu") -> BatchPlan:
        """The plan on `device`: views into the buffer (CPU) or into ONE non-blocking copy of it."""
        dev = torch.device(device)
        buf = self.buffer if dev.type == "cpu" else self.buffer.to(dev, non_blocking=True)
        sizes = [max(c, 0) for c in self.counts]
        parts = dict(zip(PACKED_INT_FIELDS, buf[: 8 * sum(sizes)].view(torch.int64).split_with_sizes(sizes)))
        for name, c in zip(PACKED_INT_FIELDS, self.counts):
            if c < 0:
                parts[name] = None
        parts["page_table"] = parts["page_table"].view(self.counts[4], self.pages)
        t, r = self.mask_shape
        mo = self.mask_offset
        plan = BatchPlan(**parts, tree_mask=buf[mo: mo + t * r].view(torch.bool).view(t, r),
                         explicit_mla=self.explicit_mla)
        object.__setattr__(plan, "_packed", self)  # not a field: dataclasses.replace drops it
        return plan


def packed_of(plan: BatchPlan) -> PackedPlan | None:
    """The host buffer a CPU plan from `build_plan` views (None for any other plan)."""
    packed = plan.__dict__.get("_packed")
    return packed if packed is not None and plan.token_ids.device.type == "cpu" else None


def plan_to(plan: BatchPlan, device: torch.device | str) -> BatchPlan:
    """The plan on `device`: itself if it is there, ONE copy if it is a packed host plan, else per field."""
    dev = torch.device(device)
    here = plan.token_ids.device
    if here.type == dev.type and (dev.index is None or here.index is None or here.index == dev.index):
        return plan
    packed = packed_of(plan)
    if packed is not None:
        return packed.unpack(dev)
    moved = {f.name: getattr(plan, f.name).to(dev) for f in fields(plan)
             if isinstance(getattr(plan, f.name), torch.Tensor)}
    return replace(plan, **moved)


def pack_plan(
    seqs: Sequence[SeqRows],
    *,
    logit_rows: Sequence[int] | None = None,
    hidden_rows: Sequence[int] | None = None,
    explicit_mla: bool = False,
    pin: bool = False,
) -> PackedPlan:
    """`build_plan`'s host half: every field computed with Python lists and numpy, written into one buffer."""
    num_rows = max((len(s.token_ids) for s in seqs), default=0)
    max_pages = max((len(s.pages) for s in seqs), default=0)
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    pages: list[int] = []
    bits: list[int] = []  # per row: bit j set iff the row sees row j of its sequence
    blocks: list[tuple[int, int]] = []  # (first row, n) of long causal chains: mask block filled by numpy
    for s in seqs:
        n = len(s.token_ids)
        if not (len(s.parents) == len(s.write_slots) == n):
            raise ValueError("SeqRows: token_ids, parents and write_slots differ in length")
        if n > _BITS_MAX and list(s.parents) == chain_parents(n):  # prefill chunks: plain causal
            depth = range(n)
            blocks.append((starts[-1], n))
            bits += [0] * n
        else:
            depth = _ancestor_bits(s.parents, bits)
        positions += s.positions if s.positions is not None else [s.prefix_len + d for d in depth]
        tokens += s.token_ids
        slots += s.write_slots
        pages += s.pages
        if len(s.pages) < max_pages:
            pages += [0] * (max_pages - len(s.pages))
        starts.append(starts[-1] + n)
    t = len(tokens)
    values = (tokens, positions, slots, starts, [s.prefix_len for s in seqs], pages, logit_rows, hidden_rows)
    counts = tuple(-1 if v is None else len(v) for v in values)
    packed_ints = 8 * sum(max(c, 0) for c in counts)
    mask_offset = _align(packed_ints)
    buf = torch.empty(mask_offset + t * num_rows, dtype=torch.uint8, pin_memory=pin)
    raw = buf.numpy()
    ints = raw[:packed_ints].view(np.int64)
    at = 0
    for v, c in zip(values, counts):
        if c > 0:
            ints[at: at + c] = v
            at += c
    raw[packed_ints:mask_offset] = 0
    mask = raw[mask_offset:].reshape(t, num_rows)
    if t and num_rows:
        mask[:] = _unpack_bits(bits, num_rows)
        for row, n in blocks:
            mask[row: row + n, :n] = _causal(n)
    return PackedPlan(buf, counts, max_pages, (t, num_rows), explicit_mla)


_BITS_MAX = 64  # rows per sequence whose visibility masks go through one uint64 each


def _ancestor_bits(parents: Sequence[int], bits: list[int]) -> list[int]:
    """Appends each row's visibility bits (itself and its ancestors) to `bits` -> depth of each row."""
    base = len(bits)
    depth: list[int] = []
    for i, p in enumerate(parents):
        if p == -1:
            depth.append(0)
            bits.append(1 << i)
        elif 0 <= p < i:
            depth.append(depth[p] + 1)
            bits.append(bits[base + p] | (1 << i))
        else:
            raise ValueError(f"row {i}: parent {p} must be -1 or an earlier row")
    return depth


def _unpack_bits(bits: list[int], width: int) -> np.ndarray:
    """Row bit masks -> uint8 [len(bits), width] of 0/1 (bit j -> column j)."""
    if width <= _BITS_MAX:
        raw = np.array(bits, dtype="<u8").view(np.uint8).reshape(len(bits), 8)
    else:
        nb = -(-width // 8)
        raw = np.frombuffer(b"".join(x.to_bytes(nb, "little") for x in bits), dtype=np.uint8).reshape(len(bits), nb)
    return np.unpackbits(raw, axis=1, count=width, bitorder="little")


@functools.lru_cache(maxsize=8)
def _causal(n: int) -> np.ndarray:
    return np.tri(n, dtype=np.uint8)


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
