"""The public `GenerateResponse` messages of one request → Anthropic's Messages JSON: the whole `message` object, or
its server-sent events (message_start, content_block_start / _delta / _stop, message_delta, message_stop).

Content blocks in order of arrival: the thinking block (`thinking`, with an empty `signature`: no signing here), the
answer's `text`, and a `tool_use` block per call (its `input` the call's JSON arguments; arguments that are not a
JSON object come as {"arguments": "<text>"}). Stop reasons: end_turn, tool_use (the turn ended after calls),
max_tokens, stop_sequence (with the matched string). Usage: `input_tokens` are the prompt tokens not read from the
prefix cache, `cache_read_input_tokens` the rest; DDTree's `spec_stats` and `timing` ride beside `usage`.
"""

from __future__ import annotations

import json

from google.protobuf import json_format

from ddtree.v1 import generation_pb2 as pb
from gateway.openai_response import timing_dict


def tool_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        value = None
    return value if isinstance(value, dict) else {"arguments": arguments}


class AnthropicResponse:
    """One request's messages as a Messages response: streamed events (`start`, `chunk`, `end`) or, after `add`ing
    every message, the whole `message()`."""

    def __init__(self, request_id: str, model: str, prompt_tokens: int):
        self.id, self.request_id, self.model, self.prompt_tokens = "msg_" + request_id, request_id, model, prompt_tokens
        self.blocks: list[dict] = []  # the content so far; the last one is open while streaming
        self.calls = 0
        self.final: pb.Final | None = None

    def _usage(self, final: pb.Final | None) -> dict:
        if final is None:
            return {"input_tokens": self.prompt_tokens, "output_tokens": 0}
        u = final.usage
        return {"input_tokens": u.prompt_tokens - u.cached_prompt_tokens, "output_tokens": u.completion_tokens,
                "cache_read_input_tokens": u.cached_prompt_tokens, "cache_creation_input_tokens": 0}

    def _stop(self, final: pb.Final) -> dict:
        reason = {pb.FINISH_REASON_LENGTH: "max_tokens", pb.FINISH_REASON_TIME_LIMIT: "max_tokens",
                  pb.FINISH_REASON_STOP: "stop_sequence"}.get(final.finish_reason, "end_turn")
        if self.calls and final.finish_reason == pb.FINISH_REASON_EOS:
            reason = "tool_use"
        return {"stop_reason": reason, "stop_sequence": final.matched_stop or None}

    def _spec_stats(self, final: pb.Final) -> dict:
        stats = json_format.MessageToDict(final.spec_stats, preserving_proto_field_name=True,
                                          always_print_fields_with_no_presence=True)
        stats["mode"] = pb.SpecMode.Name(final.spec_stats.mode).removeprefix("SPEC_MODE_").lower()
        return stats

    def _events(self, chunk: pb.Chunk) -> list[dict]:
        """Folds the chunk into `blocks`; the stream events that say so (a new block closes the open one)."""
        events = []
        parts = [("thinking", chunk.reasoning_text), ("text", chunk.text)]
        for kind, text in parts:
            if not text:
                continue
            if not self.blocks or self.blocks[-1]["type"] != kind:
                events += self._open({"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})})
            self.blocks[-1][kind] += text
            events.append({"type": "content_block_delta", "index": len(self.blocks) - 1,
                           "delta": {"type": f"{kind}_delta", kind: text}})
        for call in chunk.tool_calls:
            self.calls += 1
            events += self._open({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
            self.blocks[-1]["input"] = tool_input(call.arguments)
            events.append({"type": "content_block_delta", "index": len(self.blocks) - 1,
                           "delta": {"type": "input_json_delta", "partial_json": json.dumps(self.blocks[-1]["input"])}})
        return events

    def _open(self, block: dict) -> list[dict]:
        events = self._close()
        self.blocks.append(block)
        start = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
        return events + [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": start}]

    def _close(self) -> list[dict]:
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}] if self.blocks else []

    def start(self) -> dict:
        return {"type": "message_start", "message": {"id": self.id, "type": "message", "role": "assistant",
                                                     "model": self.model, "content": [], "stop_reason": None,
                                                     "stop_sequence": None, "usage": self._usage(None)}}

    def chunk(self, chunk: pb.Chunk) -> list[dict]:
        return self._events(chunk)

    def end(self, final: pb.Final) -> list[dict]:
        self.final = final
        return self._close() + [
            {"type": "message_delta", "delta": self._stop(final), "usage": self._usage(final),
             "spec_stats": self._spec_stats(final), "timing": timing_dict(final)},
            {"type": "message_stop"}]

    def add(self, msg: pb.GenerateResponse) -> None:
        if msg.HasField("final"):
            self.final = msg.final
        else:
            self._events(msg.chunk)

    def message(self) -> dict:
        """The whole response, after `add` saw the final message."""
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": self.blocks,
                **self._stop(self.final), "usage": self._usage(self.final), "spec_stats": self._spec_stats(self.final),
                "timing": timing_dict(self.final)}
