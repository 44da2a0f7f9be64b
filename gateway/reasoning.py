"""Kimi's thinking block, split off a chat answer by token id.

In thinking mode the generation prompt ends with `<think>`: the model writes its reasoning, then `</think>`,
then the answer. Both markers are special tokens, which detokenization drops, so the split has to happen on
ids (as vLLM's and SGLang's reasoning parsers do): every id before `</think>` is reasoning, every id after it
answer. Instant mode (`<think></think>` in the prompt) or a completion prompt starts in the answer, unless the
model opens the block with `<think>` as its first token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkTokens:
    start: int  # <think>
    end: int  # </think>


class ReasoningSplitter:
    def __init__(self, think: ThinkTokens, prompt_ids: Sequence[int]):
        self.think = think
        self.in_reasoning = bool(prompt_ids) and prompt_ids[-1] == think.start
        self.started = False  # any output seen yet
        self.reasoning_tokens = 0  # </think> included

    def split(self, ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """(reasoning ids, answer ids) of the next output ids, in order; markers go to neither list."""
        if not self.started and ids and ids[0] == self.think.start:
            self.in_reasoning = True
        self.started = self.started or bool(ids)
        if not self.in_reasoning:
            return [], list(ids)
        end = next((i for i, t in enumerate(ids) if t == self.think.end), None)
        if end is None:
            self.reasoning_tokens += len(ids)
            return [t for t in ids if t != self.think.start], []
        self.in_reasoning = False
        self.reasoning_tokens += end + 1
        return [t for t in ids[:end] if t != self.think.start], list(ids[end + 1:])
