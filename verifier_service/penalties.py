"""Logit bias and repetition / frequency / presence penalties, applied to a session's verified rows.

They change the target distribution itself, so speculation must apply them per row: a tree row at depth d
predicts the token after its own context, the tokens emitted so far plus the d drafted tokens on its path from
the root (the root is the pending token, already emitted and counted). Each row is penalized for exactly that
context, so the walk picks what plain autoregressive decoding with the same parameters picks, token by token.

vLLM's order and formulas (the reference of the tests is transformers' processors and a plain loop):
    logits[t] += logit_bias[t]
    seen(t) = t in the prompt or in the row's output context
    logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep      where seen(t)
    logits[t] -= frequency · count(t) + presence · [count(t) > 0]          count over the output context only
Temperature, top-k and top-p come after (acceptance.filter_probs). Emitted logprobs stay the raw model's.
The drafter does not see them: drafts only lose acceptance where the penalties move the argmax.
"""

from __future__ import annotations

import numpy as np
import torch

from verifier_service.session import GenParams, Session


PathCounts = np.ndarray  # int64 [3, n]: (row, token, count), see path_counts
NO_PATHS = np.zeros((3, 0), dtype=np.int64)


class Penalties:
    """One session's bias and penalties, with its output token counts on the logits' device (fp32 [V])."""

    def __init__(self, params: GenParams, prompt: list[int], vocab_size: int, device: torch.device):
        self.params = params
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.in_prompt = None
        if params.repetition_penalty != 1.0:
            self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.in_prompt[torch.tensor(prompt, device=device)] = True
        self.bias = None  # fp32 [V]
        if params.logit_bias:
            ids, values = zip(*params.logit_bias)
            self.bias = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            self.bias[torch.tensor(ids, device=device)] = torch.tensor(values, device=device)

    @property
    def penalizes(self) -> bool:
        """Beyond the bias: a row's own path changes its logits."""
        p = self.params
        return p.repetition_penalty != 1.0 or bool(p.frequency_penalty) or bool(p.presence_penalty)

    def add(self, tokens: list[int]) -> None:
        """Tokens just emitted (they join every later row's output context)."""
        if tokens and self.penalizes:
            self.counts.index_add_(0, torch.tensor(tokens, device=self.counts.device),
                                   torch.ones(len(tokens), device=self.counts.device))

    def apply(self, logits: torch.Tensor, paths: PathCounts) -> torch.Tensor:
        """logits [R, V] of rows whose drafted paths hold `paths` (see `path_counts`) -> new fp32 [R, V].
        Every row first gets the penalties of the output so far (dense, [V] vectors broadcast over the rows);
        then the few (row, token) entries whose count its path raises are recomputed from the raw logit."""
        p = self.params
        x = logits.float() + self.bias if self.bias is not None else logits.float().clone()
        if not self.penalizes:
            return x
        seen = self.counts > 0  # [V]
        if p.repetition_penalty != 1.0:
            x = torch.where(seen | self.in_prompt, _repetition(x, p.repetition_penalty), x)
        x -= p.frequency_penalty * self.counts + p.presence_penalty * seen.float()
        if paths.size:
            entries = torch.from_numpy(paths).to(x.device)  # [3, n]: row, token, count
            r, t = entries[0], entries[1]
            v = logits[r, t].float() + (self.bias[t] if self.bias is not None else 0.0)
            count = self.counts[t] + entries[2].float()
            x[r, t] = _repetition(v, p.repetition_penalty) - (p.frequency_penalty * count + p.presence_penalty)
        return x


def _repetition(x: torch.Tensor, penalty: float) -> torch.Tensor:
    return torch.where(x > 0, x / penalty, x * penalty)


def path_counts(tokens: list[int], parents: list[int]) -> PathCounts:
    """Rows [root, nodes…] of a tree (parents[i-1] < i is node i's row) -> int64 [3, n]: (row, token, count) for
    each token on a row's drafted path (the root excluded, the row's own token included), once per pair."""
    n = len(tokens)
    if not n:
        return NO_PATHS
    on_path = np.zeros((n + 1, n), dtype=bool)  # [row, node - 1]
    for i, parent in enumerate(parents, start=1):  # a parent's row comes before its children's
        on_path[i] = on_path[parent]
        on_path[i, i - 1] = True
    rows, nodes = np.nonzero(on_path)
    keys, counts = np.unique((rows.astype(np.int64) << 32) | np.asarray(tokens, dtype=np.int64)[nodes],
                             return_counts=True)
    return np.stack([keys >> 32, keys & 0xFFFFFFFF, counts]).astype(np.int64)


def penalized_logits(jobs: list[dict], logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A step's logit rows [Rl, V] -> the rows the target chooses from: `logits` itself unless a job's session
    has bias or penalties, else a copy with those jobs' rows replaced (jobs: the engine's, with `logits` slices)."""
    penalized = [job for job in jobs if job["s"].params.penalized and job["logits"].stop > job["logits"].start]
    if not penalized:
        return logits
    out = logits.float().clone()
    for job in penalized:
        s, rows = job["s"], job["logits"]
        pen = session_penalties(s, vocab_size, logits.device)
        paths = path_counts(job["tokens"], job["parents"]) if job["kind"] == "verify" and pen.penalizes else NO_PATHS
        out[rows] = pen.apply(logits[rows], paths)
    return out


def session_penalties(s: Session, vocab_size: int, device: torch.device) -> Penalties:
    if s.penalties is None:
        s.penalties = Penalties(s.params, s.prompt, vocab_size, device)
    return s.penalties
