"""Tree acceptance: which drafted nodes the target agrees with, and the bonus token.

A tree of N nodes is verified as N+1 rows: row 0 is the root (the pending token b), row i is node i,
`parents[i-1]` ∈ [0, i). For each row the target provides one token: its argmax (greedy) or one
sample of its filtered distribution (T > 0). The walk starts at the root and moves to the child
whose token equals the target's token for the current row; the first row with no such child gives
the bonus token. Exactness for sampling: the walk consumes exactly one target draw per committed
position, each from p(· | committed prefix), so the emitted sequence is distributed as sequential
target sampling (never `min(1, p/q)`; ddtree.md §3.4).

The per-position uniforms come from the session's torch.Generator stream indexed by absolute output
position (see `SessionRng`), so a seeded request gives the same tokens whatever the tree, the batch
or the drafter's timing — and the same as seeded plain autoregressive decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Walk:
    accepted_rows: list[int]  # rows whose tokens are committed to the KV cache: [0, n1, n2, ...] (root first)
    tokens: list[int]  # emitted tokens: accepted node tokens, then the bonus token
    bonus_row: int  # row whose target token is the bonus (the last accepted row)


def children_by_token(tokens: list[int], parents: list[int]) -> list[dict[int, int]]:
    kids: list[dict[int, int]] = [{} for _ in range(len(tokens) + 1)]
    for i, (tok, par) in enumerate(zip(tokens, parents), start=1):
        kids[par].setdefault(tok, i)
    return kids


def walk_tree(tokens: list[int], parents: list[int], target_tokens: list[int]) -> Walk:
    """target_tokens[r] = the target's token for row r (len N+1). Pure, reference of `tree_accept`."""
    kids = children_by_token(tokens, parents)
    row, accepted, emitted = 0, [0], []
    while True:
        t = target_tokens[row]
        child = kids[row].get(t)
        if child is None:
            emitted.append(t)
            return Walk(accepted_rows=accepted, tokens=emitted, bonus_row=row)
        accepted.append(child)
        emitted.append(t)
        row = child


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of every row [root, nodes…] (root 0)."""
    depths = [0]
    for par in parents:
        depths.append(depths[par] + 1)
    return depths


def forced_walk(tokens: list[int], parents: list[int], target_tokens: list[int], depth: int) -> Walk:
    """TEST ONLY (--force-accept-depth; not lossless): accept the path to the first node at `depth` (or
    at the tree's deepest level if shallower) whatever the target says, then the target's token at its
    end as the bonus. Trees come best-first, so that path is the drafter's most probable prefix of that
    length: with random weights this times steps at a chosen acceptance length."""
    depths = tree_depths(parents)
    row = depths.index(min(depth, max(depths)))
    path = []
    while row:
        path.append(row)
        row = parents[row - 1]
    accepted = [0, *reversed(path)]
    emitted = [tokens[r - 1] for r in accepted[1:]] + [target_tokens[accepted[-1]]]
    return Walk(accepted_rows=accepted, tokens=emitted, bonus_row=accepted[-1])


def filter_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                 min_p: float = 0.0) -> torch.Tensor:
    """[R, V] logits → [R, V] fp32 probabilities: temperature, then min-p (tokens below min_p × the most likely
    one's probability dropped; vLLM's order), then top-k, then top-p (nucleus)."""
    x = logits.float() / temperature
    if min_p > 0.0:
        p = torch.softmax(x, dim=-1)
        x = x.masked_fill(p < min_p * p.max(dim=-1, keepdim=True).values, float("-inf"))  # keeps the top token
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly before each token
        drop = before >= top_p  # keeps the smallest prefix whose mass reaches top_p (always >= 1 token)
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_with_uniforms(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: [R, V] probs, [R] uniforms in [0, 1) → [R] token ids (never a 0-prob token)."""
    cdf = torch.cumsum(probs.double(), dim=-1)
    cdf = cdf / cdf[:, -1:]
    idx = torch.searchsorted(cdf, u.double().unsqueeze(-1), right=True).squeeze(-1)
    idx = idx.clamp_(max=probs.shape[-1] - 1)
    # searchsorted(right=True) can land on a zero-probability id only through float round-off at the
    # end of the cdf; step back to the last id with mass.
    bad = probs.gather(-1, idx.unsqueeze(-1)).squeeze(-1) <= 0
    if bool(bad.any()):
        last_nonzero = (probs > 0).int().cumsum(-1).argmax(-1)
        idx = torch.where(bad, last_nonzero, idx)
    return idx


class SessionRng:
    """One torch.Generator per session; uniform k of its stream belongs to output position k.

    Each step peeks enough uniforms for the tree's depth, and afterwards advances the stream by
    exactly the number of tokens committed, so position k always sees the same uniform.
    """

    def __init__(self, seed: int | None):
        self.generator = torch.Generator(device="cpu")
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)

    def peek(self, n: int) -> torch.Tensor:
        state = self.generator.get_state()
        u = torch.rand(n, generator=self.generator, dtype=torch.float64)
        self.generator.set_state(state)
        return u

    def advance(self, n: int) -> None:
        if n > 0:
            torch.rand(n, generator=self.generator, dtype=torch.float64)
