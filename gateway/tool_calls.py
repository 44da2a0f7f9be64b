"""Kimi's tool calls, parsed out of a chat answer by token id.

The model writes them as special tokens around plain text (reference/k26.md §1.3):
  <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>
    …
  <|tool_calls_section_end|>
Detokenization drops special tokens, so, like the thinking block (gateway/reasoning.py), the parse works on
ids: ids outside a section are answer text; inside, each call's id and argument tokens are decoded when its
<|tool_call_end|> arrives. A call still open when the output ends is dropped (its ids are in the chunks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ddtree.v1 import generation_pb2 as pb

MARKERS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
           "<|tool_call_argument_begin|>", "<|tool_call_end|>")


@dataclass(frozen=True)
class ToolCallTokens:
    section_begin: int
    section_end: int
    call_begin: int
    argument_begin: int
    call_end: int


def openai_tool_call(call: pb.ToolCall) -> dict:
    """A call in OpenAI's message shape, as the chat template reads it and the HTTP surface returns it."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def function_name(call_id: str) -> str:
    """Kimi's call ids read "functions.{name}:{index}"; any other id is taken as the name."""
    name = call_id.removeprefix("functions.")
    head, sep, index = name.rpartition(":")
    return head if sep and index.isdigit() else name


class ToolCallParser:
    def __init__(self, tokens: ToolCallTokens, decode):
        self.t, self.decode = tokens, decode  # decode(ids) -> text, special tokens dropped
        self.state = "text"  # -> "section" -> "id" -> "arguments" -> "section" … -> "text"
        self.id_ids: list[int] = []
        self.arg_ids: list[int] = []

    def feed(self, ids: Sequence[int]) -> tuple[list[int], list[pb.ToolCall]]:
        """(answer-text ids, calls completed) of the next answer ids, in order."""
        text, calls = [], []
        for i in ids:
            if self.state == "text":
                if i == self.t.section_begin:
                    self.state = "section"
                else:
                    text.append(i)
            elif i == self.t.section_end:
                self.state = "text"
            elif i == self.t.call_begin:
                self.state, self.id_ids, self.arg_ids = "id", [], []
            elif i == self.t.argument_begin and self.state == "id":
                self.state = "arguments"
            elif i == self.t.call_end and self.state == "arguments":
                calls.append(self._call())
                self.state = "section"
            elif self.state == "id":
                self.id_ids.append(i)
            elif self.state == "arguments":
                self.arg_ids.append(i)
        return text, calls

    def _call(self) -> pb.ToolCall:
        call_id = self.decode(self.id_ids).strip()
        return pb.ToolCall(id=call_id, name=function_name(call_id), arguments=self.decode(self.arg_ids).strip())
