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

from collections import Counter

import torch

from verifier_service.session import GenParams, Session


class Penalties:
    """One session's bias and penalties. On the logits' device: the output token counts (fp32 [V]), the prompt's
    tokens (bool [V], with a repetition penalty) and the bias (fp32 [V]); `columns` lists every token these can
    touch (prompt, output, bias ids), so a step changes only those columns of its rows."""

    def __init__(self, params: GenParams, prompt: list[int], vocab_size: int, device: torch.device):
        self.params, self.device = params, device
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.in_prompt = None
        self._touched = set()  # token ids of `columns`
        if params.repetition_penalty != 1.0:
            self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.in_prompt[torch.tensor(prompt, device=device)] = True
            self._touched.update(prompt)
        self.bias = None
        if params.logit_bias:
            ids, values = zip(*params.logit_bias)
            self.bias = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            self.bias[torch.tensor(ids, device=device)] = torch.tensor(values, device=device)
            self._touched.update(ids)
        self.columns = torch.tensor(sorted(self._touched), dtype=torch.long, device=device)

    @property
    def penalizes(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or bool(p.frequency_penalty) or bool(p.presence_penalty)

    def add(self, tokens: list[int]) -> None:
        """Tokens just emitted (they join every later row's output context)."""
        if not tokens or not self.penalizes:
            return
        self.counts.index_add_(0, torch.tensor(tokens, device=self.device), torch.ones(len(tokens), device=self.device))
        if not self._touched.issuperset(tokens):
            self._touched.update(tokens)
            self.columns = torch.tensor(sorted(self._touched), dtype=torch.long, device=self.device)

    def apply(self, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """logits [R, V] of rows whose drafted path tokens (root excluded) are `paths` -> new fp32 [R, V]."""
        x = logits.float().clone()
        self.apply_(x, logits, paths)
        return x

    def apply_(self, x: torch.Tensor, raw: torch.Tensor, paths: list[list[int]]) -> None:
        """`apply` in place: x [R, V] fp32 holds the rows' raw logits `raw`. First every row's `columns` get the
        bias and the penalties of the output so far ([R, C] gathered); then the few (row, token) entries whose
        count its path raises are recomputed from the raw logit."""
        p = self.params
        if self.columns.numel():
            cols = self.columns
            v = x[:, cols] + self.bias[cols] if self.bias is not None else x[:, cols]  # [R, C]
            if self.penalizes:
                count = self.counts[cols]
                seen = count > 0
                if p.repetition_penalty != 1.0:
                    v = torch.where(seen | self.in_prompt[cols], _repetition(v, p.repetition_penalty), v)
                v = v - (p.frequency_penalty * count + p.presence_penalty * seen.float())
            x[:, cols] = v
        if not self.penalizes:
            return
        rows, tokens, extra = [], [], []  # each row's path tokens with their multiplicity
        for r, path in enumerate(paths):
            for token, n in Counter(path).items():
                rows.append(r), tokens.append(token), extra.append(n)
        if rows:
            index = torch.tensor([rows, tokens], device=x.device)
            r, t = index[0], index[1]
            v = raw[r, t].float() + (self.bias[t] if self.bias is not None else 0.0)
            count = self.counts[t] + torch.tensor(extra, dtype=torch.float32, device=x.device)
            x[r, t] = _repetition(v, p.repetition_penalty) - (p.frequency_penalty * count + p.presence_penalty)


def _repetition(x: torch.Tensor, penalty: float) -> torch.Tensor:
    return torch.where(x > 0, x / penalty, x * penalty)


def tree_paths(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """Rows [root, nodes…] of a tree (parents[i-1] < i is node i's row) -> each row's drafted path tokens."""
    paths: list[list[int]] = [[]]
    for token, parent in zip(tokens, parents):
        paths.append(paths[parent] + [token])
    return paths


def penalized_logits(jobs: list[dict], logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A step's logit rows [Rl, V] -> the rows the target chooses from: `logits` itself unless a job's session
    has bias or penalties, else a copy with those jobs' rows replaced (jobs: the engine's, with `logits` slices)."""
    penalized = [job for job in jobs if job["s"].params.penalized and job["logits"].stop > job["logits"].start]
    if not penalized:
        return logits
    out = logits.float().clone()
    for job in penalized:
        s, rows = job["s"], job["logits"]
        paths = tree_paths(job["tokens"], job["parents"]) if job["kind"] == "verify" else [[]]
        session_penalties(s, vocab_size, logits.device).apply_(out[rows], logits[rows], paths)
    return out


def session_penalties(s: Session, vocab_size: int, device: torch.device) -> Penalties:
    if s.penalties is None:
        s.penalties = Penalties(s.params, s.prompt, vocab_size, device)
    return s.penalties
