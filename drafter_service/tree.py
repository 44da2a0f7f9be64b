"""DDTree construction (reference/ddtree.md §2): the N most probable prefixes under the drafter's
factorized law Q(y_1..y_L) = Π q_d(y_d).

Split in two so that only 2·L·K numbers leave the device per session:
  topk_logprobs  (device, batched over sessions): per-depth log-softmax and top-K, one D2H copy.
  build_tree     (host, per session): best-first heap over top-K rank paths. This is the reference a
                 future CUDA builder must reproduce node for node.

Node order is a total order: score descending, then depth ascending, then rank path lexicographically
ascending. A child never beats its parent in it (score ≤, deeper) and a sibling of rank r + 1 never beats
rank r, so the heap pops nodes in exactly this order; parents get smaller indices than their children.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Tree:
    """Nodes 1..N hang under the root (node 0, the root token, not stored here)."""
    tokens: np.ndarray  # [N] int64 token of node i at tokens[i - 1]
    parents: np.ndarray  # [N] int32; parents[i - 1] ∈ [0, i), 0 = root
    depths: np.ndarray  # [N] int32; 1..L, depth(node) = depth(parent) + 1
    logprobs: np.ndarray  # [N] float32; log q_d(token) of node i at its depth d (its path's score is the sum)

    def __len__(self) -> int:
        return len(self.tokens)


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """logits [S, L, V] (any device) → host (token ids [S, L, k] int64, log-probs [S, L, k] float32),
    ranks sorted best first."""
    if not 0 <= k <= logits.shape[-1]:
        raise ValueError(f"k={k} must be in [0, vocab={logits.shape[-1]}]")
    if logits.shape[-1] > 1 << 24:
        raise ValueError("vocab above 2^24: token ids would not be exact in the packed fp32 copy")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(logprobs, k, dim=-1, sorted=True)
    # One merged D2H copy (dispatch count, not bytes, dominates here); ids < 2^24 are exact in fp32.
    packed = torch.stack([values, ids.to(torch.float32)]).cpu().numpy()
    return packed[1].astype(np.int64), packed[0]


def build_tree(token_ids: np.ndarray, logprobs: np.ndarray, budget: int) -> Tree:
    """token_ids, logprobs [L, K]: per depth the K best tokens and their log-probs, best first.
    Returns the `budget` best prefixes (fewer when the L·K table holds fewer). K = 1 gives the argmax chain."""
    if token_ids.shape != logprobs.shape or token_ids.ndim != 2:
        raise ValueError(f"token_ids {token_ids.shape} and logprobs {logprobs.shape} must both be [L, K]")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    depth_max, k = logprobs.shape
    lp = logprobs.astype(np.float64).tolist()  # Python floats: the heap runs on host scalars
    tok = token_ids.tolist()
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    node_lps: list[float] = []
    # entry: (-score, depth, rank path, parent index, parent score); rank paths are unique, so the
    # comparison never reaches the last two fields.
    heap = [(-lp[0][0], 1, (0,), 0, 0.0)] if budget and depth_max and k else []
    while heap and len(tokens) < budget:
        neg_score, depth, ranks, parent, parent_score = heapq.heappop(heap)
        rank = ranks[-1]
        tokens.append(tok[depth - 1][rank])
        parents.append(parent)
        depths.append(depth)
        node_lps.append(lp[depth - 1][rank])
        if rank + 1 < k:  # next sibling: same parent, next-ranked token at this depth
            score = parent_score + lp[depth - 1][rank + 1]
            heapq.heappush(heap, (-score, depth, ranks[:-1] + (rank + 1,), parent, parent_score))
        if depth < depth_max:  # first child: best token at the next depth
            score = -neg_score + lp[depth][0]
            heapq.heappush(heap, (-score, depth + 1, ranks + (0,), len(tokens), -neg_score))
    return Tree(np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int32),
                np.array(depths, dtype=np.int32), np.array(node_lps, dtype=np.float32))
