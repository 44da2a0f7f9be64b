"""Forced output tokens (a forced tool call): the output must continue with `forced_ids` right after its first
`forced_after` token (the end of the thinking block), or from its first token when that is None. And banned ones:
no EOS or stop token id before `min_new_tokens` emitted tokens.

This changes the target distribution at those positions to the forced token, so speculation applies it per row,
like the penalties: a tree row at depth d predicts output index len(output) + d, and whether and where the trigger
occurred is read from its own context (the output so far plus its drafted path). Rows inside the forced window keep
only the forced token's logit (the others -inf), so greedy and sampled decoding both pick it, in any mode; rows that
predict an output index below `min_new_tokens` get -inf at the EOS (unless ignored) and stop ids.
"""

from __future__ import annotations

import torch

from verifier_service.acceptance import tree_depths
from verifier_service.session import Session


def _window_start(forced_after: int | None, context: list[int]) -> int | None:
    """The index in `context` where the forced tokens begin (just after the first trigger), None before it."""
    if forced_after is None:
        return 0
    return context.index(forced_after) + 1 if forced_after in context else None


def forced_token(s: Session, context: list[int]) -> int | None:
    """The token forced at output index len(context), given the output tokens before it (None: free)."""
    start = _window_start(s.params.forced_after, context) if s.params.forced_ids else None
    k = None if start is None else len(context) - start
    return s.params.forced_ids[k] if k is not None and k < len(s.params.forced_ids) else None


def row_forcing(s: Session, tokens: list[int], parents: list[int]) -> list[tuple[int, int]]:
    """A verify's rows [root, nodes…] -> (row, forced token) for the rows whose prediction is forced. Row r at depth
    d predicts output index len(output) + d; its context is the output plus its drafted path."""
    forced, n = s.params.forced_ids, len(s.output)
    start = _window_start(s.params.forced_after, s.output)
    if start is not None and n - start >= len(forced):
        return []  # the window is behind the output (the common case, after a few steps)
    out, paths = [], [[]]
    for token, parent in zip(tokens, parents):
        paths.append(paths[parent] + [token])
    for row, path in enumerate(paths):
        if start is not None:  # the window opened in the output
            k = n + len(path) - start
        else:  # maybe on this row's path
            at = _window_start(s.params.forced_after, path)
            if at is None:
                continue
            k = len(path) - at
        if k < len(forced):
            out.append((row, forced[k]))
    return out


def early_rows(s: Session, job: dict) -> list[int]:
    """The job's logit rows (0-based) that predict an output index below s.params.min_new_tokens."""
    if job["kind"] == "prefill":  # only the prompt's last row predicts an output token: index 0
        last = job["start"] + job["n"] == len(s.prompt)
        return [job["logits"].stop - job["logits"].start - 1] if last and s.params.min_new_tokens > 0 else []
    depths = tree_depths(job["parents"])
    return [row for row, d in enumerate(depths) if len(s.output) + d < s.params.min_new_tokens]


def forced_logits(jobs: list[dict], logits: torch.Tensor, raw: torch.Tensor, eos_ids=frozenset()) -> torch.Tensor:
    """A step's logit rows (maybe already penalized; `raw` the model's own) -> the same with every forced row keeping
    only its forced token's logit, and the EOS / stop ids banned where the output is still shorter than its minimum;
    a copy when any row changes (never `raw` itself)."""
    hits, bans = [], []  # (logit row, token)
    for job in jobs:
        s, lr = job["s"], job["logits"]
        if lr.stop == lr.start:
            continue
        if s.params.min_new_tokens > len(s.output):
            banned = sorted(s.params.stop_token_ids | (set() if s.params.ignore_eos else set(eos_ids)))
            bans += [(lr.start + row, t) for row in early_rows(s, job) for t in banned]
        if not s.params.forced_ids:
            continue
        if job["kind"] == "verify":
            hits += [(lr.start + row, token) for row, token in row_forcing(s, job["tokens"], job["parents"])]
        elif job["start"] + job["n"] == len(s.prompt):  # the prompt's last row predicts output index 0
            token = forced_token(s, [])
            if token is not None:
                hits.append((lr.stop - 1, token))
    if not hits and not bans:
        return logits
    out = logits.clone() if logits is raw else logits
    if bans:
        rows, tokens = torch.tensor(bans, device=out.device).T
        out[rows, tokens] = float("-inf")
    if hits:
        rows, tokens = torch.tensor(hits, device=out.device).T
        kept = out[rows, tokens]
        out[rows] = float("-inf")
        out[rows, tokens] = kept
    return out

