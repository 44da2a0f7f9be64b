"""DDTree construction on the device: per-depth log-softmax + top-K, then the best-first tree.

    ddtree_build(logits, k, budget) -> (tokens, parents, depths, count)

logits   [S, L, V] bf16 or fp32 contiguous: the drafter's block logits for depths 1..L (L <= 16)
k        ranks kept per depth, 1 <= k <= min(64, V)
budget   nodes per tree, 0 <= budget <= 1024
tokens   int64 [S, budget]  token of node i (1..count) at [:, i-1]; -1 past count
parents  int32 [S, budget]  parent of node i in [0, i), 0 = the root; -1 past count
depths   int32 [S, budget]  1..L; 0 past count
count    int32 [S]          nodes built (< budget only when L·k candidates run out)

Same tree as drafter_service/tree.py (topk_logprobs + build_tree): nodes in the order score
descending, depth ascending, rank path ascending; scores are fp64 sums of fp32 log-probs. Top-k
order is logit descending, then token id ascending, exactly (also on ties). Nothing leaves the device.
"""

from __future__ import annotations

import heapq

import torch

from kernels._compile import cuda_source, get_kernels, launch

CODE = "ddtree_build.cu"
NAMES = ("ddtree_topk<float>", "ddtree_topk<u16>", "ddtree_tree")
ENTRY_BYTES = 40  # sizeof(Entry) in the .cu


def ddtree_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, L, V] -> (ids int64 [S, L, k], log-probs fp32 [S, L, k]), best first."""
    S, L, V = logits.shape
    assert logits.is_cuda and logits.is_contiguous() and logits.dtype in (torch.float32, torch.bfloat16)
    assert 1 <= k <= min(64, V) and V < 2**31, (k, V)
    ids = torch.empty(S, L, k, dtype=torch.int64, device=logits.device)
    lps = torch.empty(S, L, k, dtype=torch.float32, device=logits.device)
    if S * L:
        name = "ddtree_topk<float>" if logits.dtype == torch.float32 else "ddtree_topk<u16>"
        launch(get_kernels(cuda_source(CODE), NAMES)[name], S * L, 1024, logits, V, k, ids, lps)
    return ids, lps


def ddtree_tree(ids: torch.Tensor, lps: torch.Tensor, budget: int):
    """Top-k tables [S, L, k] -> (tokens, parents, depths, count) as in `ddtree_build`."""
    S, L, k = ids.shape
    assert ids.dtype == torch.int64 and lps.dtype == torch.float32 and lps.shape == ids.shape
    assert ids.is_contiguous() and lps.is_contiguous() and L <= 16 and k <= 64 and 0 <= budget <= 1024
    dev = ids.device
    tokens = torch.empty(S, budget, dtype=torch.int64, device=dev)
    parents = torch.empty(S, budget, dtype=torch.int32, device=dev)
    depths = torch.empty(S, budget, dtype=torch.int32, device=dev)
    count = torch.empty(S, dtype=torch.int32, device=dev)
    if S:
        launch(get_kernels(cuda_source(CODE), NAMES)["ddtree_tree"], S, 32, ids, lps, S, L, k, budget,
               tokens, parents, depths, count, smem=(2 * budget + 1) * ENTRY_BYTES)
    return tokens, parents, depths, count


def ddtree_build(logits: torch.Tensor, k: int, budget: int):
    return ddtree_tree(*ddtree_topk(logits, k), budget)


def ddtree_topk_ref(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.float()
    ids = torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]  # ties: lower id first
    return ids, torch.log_softmax(x, dim=-1).gather(-1, ids)


def ddtree_tree_ref(ids: torch.Tensor, lps: torch.Tensor, budget: int):
    """drafter_service/tree.py build_tree per session, padded into the kernel's output layout."""
    S, L, k = ids.shape
    tokens = torch.full((S, budget), -1, dtype=torch.int64)
    parents = torch.full((S, budget), -1, dtype=torch.int32)
    depths = torch.zeros((S, budget), dtype=torch.int32)
    count = torch.zeros(S, dtype=torch.int32)
    for s in range(S):
        lp, tok = lps[s].double().tolist(), ids[s].tolist()
        heap = [(-lp[0][0], 1, (0,), 0, 0.0)] if budget and L and k else []
        n = 0
        while heap and n < budget:
            neg, depth, ranks, parent, parent_score = heapq.heappop(heap)
            tokens[s, n], parents[s, n], depths[s, n] = tok[depth - 1][ranks[-1]], parent, depth
            n += 1
            if ranks[-1] + 1 < k:
                score = parent_score + lp[depth - 1][ranks[-1] + 1]
                heapq.heappush(heap, (-score, depth, ranks[:-1] + (ranks[-1] + 1,), parent, parent_score))
            if depth < L:
                heapq.heappush(heap, (-(-neg + lp[depth][0]), depth + 1, ranks + (0,), n, -neg))
        count[s] = n
    return tuple(t.to(ids.device) for t in (tokens, parents, depths, count))


def ddtree_build_ref(logits: torch.Tensor, k: int, budget: int):
    return ddtree_tree_ref(*ddtree_topk_ref(logits, k), budget)
