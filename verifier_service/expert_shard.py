"""Expert parallelism's placement of the routed experts: which experts, or slices of experts, each rank holds
(`ExpertShard`), cutting a rank's share out of whole experts (`cut_experts`), and the local expert of each routed
(token, expert, slice) pair (`local_pairs`, what kernels/moe_w4a16's `local_expert` computes on the device)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from verifier_service.int4 import Int4Weight, untile_int4

if TYPE_CHECKING:
    from verifier_service.moe import ExpertMatrix, ExpertStack


@dataclass(frozen=True)
class ExpertShard:
    """Which routed experts a rank holds. slices = 1: the contiguous range `expert_range` gives (384 over 7 ranks:
    55×6 + 54). slices = S > 1: every expert is cut into S slices of I/S intermediate rows (rows of gate/up, columns
    of down: SwiGLU is per row, so the slices' down outputs sum to the expert's), and global slice g = e·S + s is
    local expert g // world of rank g % world. Slicing evens out the slowest rank's load: a verify step waits for
    the rank with the most touched experts, 2.7 of a token's 8 at one row on 7 ranks against a mean of 1.14
    (1.6 with S = 4)."""

    rank: int = 0
    world: int = 1
    slices: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world or self.slices < 1:
            raise ValueError(f"expert shard: rank {self.rank} of {self.world}, {self.slices} slices")

    def pieces(self, n_experts: int) -> list[tuple[int, int]]:
        """This rank's local experts in order, as (global expert, slice) pairs."""
        if self.slices == 1:
            start, stop = _contiguous(n_experts, self.rank, self.world)
            return [(e, 0) for e in range(start, stop)]
        return [divmod(g, self.slices) for g in range(self.rank, n_experts * self.slices, self.world)]

    def first(self, n_experts: int) -> int:
        """ExpertStack.first: the global id of local expert 0 (whole experts), else 0."""
        return _contiguous(n_experts, self.rank, self.world)[0] if self.slices == 1 else 0


def _contiguous(n: int, rank: int, world: int) -> tuple[int, int]:
    if world > n:
        raise ValueError(f"{world} ranks exceed the {n} routed experts")
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def cut_experts(full: ExpertStack, shard: ExpertShard) -> ExpertStack:
    """The stack `shard` holds, cut from one holding every expert whole (first = 0): each piece's gate/up rows and
    down columns (tests and random weights; the loader reads the pieces from the checkpoint). I/S must be a whole
    number of INT4 scale groups (and of 128-input chunks for the tiled order)."""
    from verifier_service.moe import ExpertStack  # moe imports this module

    n, S = full.count, shard.slices
    pieces = shard.pieces(n)

    def stack(t: torch.Tensor, rows: bool) -> torch.Tensor:  # [E_local, out', in'] of this shard's pieces
        return torch.stack([_piece(t, e, s, S, rows) for e, s in pieces]).contiguous()

    def cut(w: ExpertMatrix, rows: bool) -> ExpertMatrix:
        if not isinstance(w, Int4Weight):
            return stack(w, rows)
        packed, scale = untile_int4(w.packed, w.scale) if w.tiled else (w.packed, w.scale)
        out, inp = w.shape
        piece = Int4Weight(stack(packed, rows), stack(scale, rows), (out // S, inp) if rows else (out, inp // S))
        return piece.tile() if w.tiled else piece

    return ExpertStack(cut(full.gate_proj, True), cut(full.up_proj, True), cut(full.down_proj, False),
                       shard.first(n), S, shard.rank, shard.world)


def _piece(t: torch.Tensor, e: int, s: int, S: int, rows: bool) -> torch.Tensor:
    """Slice s of S of expert e's matrix t[e] ([out, in] or its packed words / scales): rows or columns."""
    m = t[e]
    if rows:
        step = m.shape[0] // S
        return m[s * step:(s + 1) * step]
    step = m.shape[1] // S
    return m[:, s * step:(s + 1) * step]


def local_pairs(topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                experts: ExpertStack) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing [T, k] -> (local expert of each (token, expert, slice) pair, int64 [T, k·S], -1 where another rank
    holds it; its router weight, fp32 [T, k·S]). Pair j·S + s of a token is slice s of its j-th expert."""
    S = experts.slices
    if S == 1:
        local = topk_ids - experts.first
        return torch.where((local >= 0) & (local < experts.count), local, -1), topk_weights
    g = topk_ids[..., None] * S + torch.arange(S, device=topk_ids.device)  # [T, k, S] global slices
    mine = (topk_ids[..., None] >= 0) & (g % experts.world == experts.rank) & (g // experts.world < experts.count)
    return torch.where(mine, g // experts.world, -1).flatten(1), topk_weights.repeat_interleave(S, dim=1)
