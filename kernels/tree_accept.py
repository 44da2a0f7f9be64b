"""Greedy tree acceptance on the device, batched over sessions (verifier_service/acceptance.py walk_tree).

    tree_accept(tokens, parents, target_tokens) -> (accepted_rows, emitted, num_accepted)

tokens         int64 [S, N]    token of node i (1..N) at tokens[:, i-1]
parents        int64 [S, N]    parent row of node i, in [0, i) (0 = root); -1 marks a padding node
target_tokens  int64 [S, N+1]  the target's token (argmax or sample) for each row, row 0 = root
accepted_rows  int64 [S, N+1]  rows on the accepted path, root first, then -1
emitted        int64 [S, N+1]  target_tokens at those rows (path tokens then the bonus), then -1
num_accepted   int64 [S]       path length incl. the root; bonus row = accepted_rows[s, num_accepted-1]

The walk moves from row r to its lowest-index child whose token equals target_tokens[r]
(children_by_token keeps the first), and stops at the first row without one.
"""

from __future__ import annotations

import torch

from kernels._compile import cuda_source, get_kernels, launch

CODE = r"""
// One warp per session; each step scans the rows after `row` 32 at a time (children have larger ids).
extern "C" __global__ void tree_accept(const i64* tokens, const i64* parents, const i64* target, int S, int N,
                                       i64* accepted, i64* emitted, i64* num_accepted) {
  const int s = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (s >= S) return;
  const i64 *tok = tokens + (i64)s * N, *par = parents + (i64)s * N;
  i64 *acc = accepted + (i64)s * (N + 1), *emi = emitted + (i64)s * (N + 1);
  int row = 0, n = 0;
  while (true) {
    const i64 want = target[(i64)s * (N + 1) + row];
    if (lane == 0) acc[n] = row, emi[n] = want;
    ++n;
    int child = -1;
    for (int base = row; base < N && child < 0; base += 32) {  // node i+1 sits at index i
      const int i = base + lane;
      const unsigned hit = __ballot_sync(0xffffffffu, i < N && par[i] == row && tok[i] == want);
      if (hit) child = base + __ffs(hit);  // lowest matching index i -> node i + 1
    }
    if (child < 0) break;
    row = child;
  }
  for (int i = n + lane; i <= N; i += 32) acc[i] = -1, emi[i] = -1;
  if (lane == 0) num_accepted[s] = n;
}
"""
NAMES = ("tree_accept",)


def tree_accept(tokens: torch.Tensor, parents: torch.Tensor, target_tokens: torch.Tensor):
    S, N = tokens.shape
    for x, shape in ((tokens, (S, N)), (parents, (S, N)), (target_tokens, (S, N + 1))):
        assert x.is_cuda and x.dtype == torch.int64 and x.shape == shape and x.is_contiguous()
    accepted = torch.empty(S, N + 1, dtype=torch.int64, device=tokens.device)
    emitted = torch.empty_like(accepted)
    num = torch.empty(S, dtype=torch.int64, device=tokens.device)
    if S:
        ker = get_kernels(cuda_source(CODE), NAMES)["tree_accept"]
        launch(ker, -(-S // 4), 128, tokens, parents, target_tokens, S, N, accepted, emitted, num)
    return accepted, emitted, num


def tree_accept_ref(tokens: torch.Tensor, parents: torch.Tensor, target_tokens: torch.Tensor):
    S, N = tokens.shape
    accepted = torch.full((S, N + 1), -1, dtype=torch.int64)
    emitted, num = accepted.clone(), torch.zeros(S, dtype=torch.int64)
    for s, (tok, par, tgt) in enumerate(zip(tokens.tolist(), parents.tolist(), target_tokens.tolist())):
        kids: list[dict[int, int]] = [{} for _ in range(N + 1)]
        for i, (t, p) in enumerate(zip(tok, par), start=1):
            if p >= 0:
                kids[p].setdefault(t, i)
        row, path = 0, [0]
        while (child := kids[row].get(tgt[row])) is not None:
            path.append(row := child)
        accepted[s, : len(path)] = torch.tensor(path)
        emitted[s, : len(path)] = torch.tensor([tgt[r] for r in path])
        num[s] = len(path)
    dev = tokens.device
    return accepted.to(dev), emitted.to(dev), num.to(dev)
