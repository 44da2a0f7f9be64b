"""Per-session arithmetic of a step: the target's token for each verified row (argmax, or a sample
with the session's per-position uniforms), the acceptance walk, and emitted-token logprobs."""

from __future__ import annotations

import torch

from verifier_service.acceptance import Walk, filter_probs, forced_walk, sample_with_uniforms, tree_depths, walk_tree
from verifier_service.session import Session


def target_tokens(s: Session, logits: torch.Tensor, depths: list[int]) -> list[int]:
    """logits [R, V] fp32 for rows at `depths` → the target's token per row. Row at depth d predicts
    output index s.emitted + d, so it samples with that index's uniform (SessionRng)."""
    p = s.params
    if p.greedy:
        return logits.argmax(-1).tolist()
    u = s.rng.peek(max(depths) + 1)[torch.tensor(depths)]
    probs = filter_probs(logits, p.temperature, p.top_k, p.top_p)
    return sample_with_uniforms(probs, u).tolist()


def accept_session(s: Session, tokens: list[int], parents: list[int], logits: torch.Tensor,
                   force_depth: int = 0) -> tuple[Walk, list[float]]:
    """logits [N+1, V] for rows [root, nodes…] → the walk and the logprob of each emitted token.
    force_depth > 0: the TEST ONLY forced walk (acceptance.forced_walk), not the target's choice."""
    targets = target_tokens(s, logits, tree_depths(parents))
    walk = forced_walk(tokens, parents, targets, force_depth) if force_depth else walk_tree(tokens, parents, targets)
    logprobs = []
    if s.params.return_logprobs:
        # Emitted token j was predicted by accepted row j (root first); bonus by the last accepted row.
        rows = walk.accepted_rows
        lsm = torch.log_softmax(logits[rows], dim=-1)  # [k+1, V]
        logprobs = lsm.gather(-1, torch.tensor(walk.tokens).unsqueeze(-1)).squeeze(-1).tolist()
    return walk, logprobs


def first_token(s: Session, logits: torch.Tensor) -> tuple[int, float]:
    """The token after the prompt, from the prefill's last row (output index 0)."""
    token = target_tokens(s, logits.unsqueeze(0), [0])[0]
    logprob = float(torch.log_softmax(logits, dim=-1)[token]) if s.params.return_logprobs else 0.0
    return token, logprob
