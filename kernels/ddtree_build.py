"""DDTree construction on the device: per-depth log-softmax + top-K, then the best-first tree.

    ddtree_build(logits, k, budget) -> (tokens, parents, depths, logprobs, count)

logits   [S, L, V] bf16 or fp32 contiguous: the drafter's block logits for depths 1..L (L <= 16)
k        ranks kept per depth, 1 <= k <= min(64, V)
budget   nodes per tree, 0 <= budget <= 1024
tokens   int64 [S, budget]  token of node i (1..count) at [:, i-1]; -1 past count
parents  int32 [S, budget]  parent of node i in [0, i), 0 = the root; -1 past count
depths   int32 [S, budget]  1..L; 0 past count
logprobs fp32  [S, budget]  node i's log-prob at its depth, log q_d(token) (not the path's sum); 0 past count
count    int32 [S]          nodes built (< budget only when L·k candidates run out)

Same tree as drafter_service/tree.py (topk_logprobs + build_tree): nodes in the order score
descending, depth ascending, rank path ascending; scores are fp64 sums of fp32 log-probs. Top-k
order is logit descending, then token id ascending, exactly (also on ties). Nothing leaves the device.

One launch for budget <= TREE_WARP_MAX (ddtree_build.cu): every row is split into chunks of CHUNK
logits, one block each (S·L·C blocks stream the logits once); the last block of a row merges the
chunks, the last row of a session builds its tree in one warp. Larger budgets: the same launch
without trees, then ddtree_tree (one thread's heap). The blocks find the last one through counters
that each launch leaves at zero: calls on one device must not run concurrently on two streams.
"""

from __future__ import annotations

import heapq

import torch

from kernels._compile import cuda_source, get_kernels, launch

CODE = "ddtree_build.cu"
NAMES = ("ddtree_fused<float>", "ddtree_fused<u16>", "ddtree_tree")
ENTRY_BYTES = 40  # sizeof(Entry) in the .cu
NT = 256  # threads of a top-K block
TREE_WARP_MAX = 95  # 32 * MS - 1: largest tree built by one warp (and inside the fused launch)
_COUNTERS: dict[int, torch.Tensor] = {}  # device index -> int32 zeros, kept at zero by the kernel


def _counters(device: torch.device, n: int) -> torch.Tensor:
    buf = _COUNTERS.get(device.index)
    if buf is None or buf.numel() < n:
        assert not torch.cuda.is_current_stream_capturing(), "call ddtree_build once before graph capture"
        buf = _COUNTERS[device.index] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf


def _fused(logits: torch.Tensor, k: int, budget: int, tree: tuple | None):
    """The fused launch: ids/lps [S, L, k]; with `tree` (tokens, parents, depths, logprobs, count) also the trees."""
    S, L, V = logits.shape
    chunk = NT * 64 // logits.element_size()  # 4 x 16 bytes per thread
    C = -(-V // chunk)
    dev = logits.device
    ids = torch.empty(S, L, k, dtype=torch.int64, device=dev)
    lps = torch.empty(S, L, k, dtype=torch.float32, device=dev)
    part_keys = torch.empty(S * L * C * k, dtype=torch.int64, device=dev)
    part_ms = torch.empty(S * L * C * 2, dtype=torch.float32, device=dev)
    vec_ok = int(logits.data_ptr() % 16 == 0 and V * logits.element_size() % 16 == 0)
    name = "ddtree_fused<float>" if logits.dtype == torch.float32 else "ddtree_fused<u16>"
    outs = tree if tree is not None else (ids,) * 5  # unused pointers without trees
    launch(get_kernels(cuda_source(CODE), NAMES)[name], (C, S * L), NT, logits, V, k, C, L, vec_ok, part_keys,
           part_ms, ids, lps, _counters(dev, S * L + S), budget if tree is not None else -1, *outs)
    return ids, lps


def _check_logits(logits: torch.Tensor, k: int) -> None:
    S, L, V = logits.shape
    assert logits.is_cuda and logits.is_contiguous() and logits.dtype in (torch.float32, torch.bfloat16)
    assert 1 <= k <= min(64, V) and V + 8192 < 2**31 and L <= 16 and S * L < 65536, (S, L, V, k)


def ddtree_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, L, V] -> (ids int64 [S, L, k], log-probs fp32 [S, L, k]), best first."""
    _check_logits(logits, k)
    S, L, _ = logits.shape
    if S * L == 0:
        return (torch.empty(S, L, k, dtype=torch.int64, device=logits.device),
                torch.empty(S, L, k, dtype=torch.float32, device=logits.device))
    return _fused(logits, k, -1, None)


def _tree_outputs(S: int, budget: int, dev):
    return (torch.empty(S, budget, dtype=torch.int64, device=dev),
            torch.empty(S, budget, dtype=torch.int32, device=dev),
            torch.empty(S, budget, dtype=torch.int32, device=dev),
            torch.empty(S, budget, dtype=torch.float32, device=dev),
            torch.empty(S, dtype=torch.int32, device=dev))


def ddtree_tree(ids: torch.Tensor, lps: torch.Tensor, budget: int):
    """Top-k tables [S, L, k] -> (tokens, parents, depths, logprobs, count) as in `ddtree_build`."""
    S, L, k = ids.shape
    assert ids.dtype == torch.int64 and lps.dtype == torch.float32 and lps.shape == ids.shape
    assert ids.is_contiguous() and lps.is_contiguous() and L <= 16 and k <= 64 and 0 <= budget <= 1024
    out = _tree_outputs(S, budget, ids.device)
    if S:
        smem = (2 * budget + 1) * ENTRY_BYTES if budget > TREE_WARP_MAX else 0
        launch(get_kernels(cuda_source(CODE), NAMES)["ddtree_tree"], S, 32, ids, lps, S, L, k, budget, *out,
               smem=smem)
    return out


def ddtree_build(logits: torch.Tensor, k: int, budget: int):
    _check_logits(logits, k)
    assert 0 <= budget <= 1024
    S, L, _ = logits.shape
    if S * L == 0 or budget > TREE_WARP_MAX:
        return ddtree_tree(*ddtree_topk(logits, k), budget)
    out = _tree_outputs(S, budget, logits.device)
    _fused(logits, k, budget, out)
    return out


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
    logprobs = torch.zeros((S, budget), dtype=torch.float32)
    count = torch.zeros(S, dtype=torch.int32)
    for s in range(S):
        lp, lp32, tok = lps[s].double().tolist(), lps[s].tolist(), ids[s].tolist()
        heap = [(-lp[0][0], 1, (0,), 0, 0.0)] if budget and L and k else []
        n = 0
        while heap and n < budget:
            neg, depth, ranks, parent, parent_score = heapq.heappop(heap)
            tokens[s, n], parents[s, n], depths[s, n] = tok[depth - 1][ranks[-1]], parent, depth
            logprobs[s, n] = lp32[depth - 1][ranks[-1]]
            n += 1
            if ranks[-1] + 1 < k:
                score = parent_score + lp[depth - 1][ranks[-1] + 1]
                heapq.heappush(heap, (-score, depth, ranks[:-1] + (ranks[-1] + 1,), parent, parent_score))
            if depth < L:
                heapq.heappush(heap, (-(-neg + lp[depth][0]), depth + 1, ranks + (0,), n, -neg))
        count[s] = n
    return tuple(t.to(ids.device) for t in (tokens, parents, depths, logprobs, count))


def ddtree_build_ref(logits: torch.Tensor, k: int, budget: int):
    return ddtree_tree_ref(*ddtree_topk_ref(logits, k), budget)
