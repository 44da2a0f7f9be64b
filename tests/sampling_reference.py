"""An independent reference of the logit bias and penalties, for tests: transformers' repetition-penalty processor
and plain loops over the token lists, one row at a time (what plain decoding would apply)."""

from __future__ import annotations

from collections import Counter

import torch
from transformers import RepetitionPenaltyLogitsProcessor


def reference_penalize(logits: torch.Tensor, prompt: list[int], output: list[int], *, presence: float = 0.0,
                       frequency: float = 0.0, repetition: float = 1.0,
                       bias: dict[int, float] | None = None) -> torch.Tensor:
    """logits [V] of the position after prompt + output -> the penalized fp32 [V] (vLLM's order: bias,
    repetition over prompt and output, then frequency and presence over the output)."""
    x = logits.float().clone()
    for token, value in (bias or {}).items():
        x[token] += value
    if repetition != 1.0:
        ids = torch.tensor([prompt + output])
        x = RepetitionPenaltyLogitsProcessor(repetition)(ids, x.unsqueeze(0)).squeeze(0)
    for token, count in Counter(output).items():
        x[token] -= frequency * count + presence
    return x
