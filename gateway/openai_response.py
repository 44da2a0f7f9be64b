"""The public `GenerateResponse` messages of one request → OpenAI's JSON (the HTTP surface,
gateway/http_api.py): chat.completion(.chunk) and text_completion objects, streamed or whole."""

from __future__ import annotations

import time

from google.protobuf import json_format

from ddtree.v1 import generation_pb2 as pb
from gateway.tool_calls import openai_tool_call

FINISH_REASONS = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_EOS: "stop",
                  pb.FINISH_REASON_CANCELLED: "abort", pb.FINISH_REASON_TIME_LIMIT: "length"}


class OpenAIResponse:
    """One choice's `GenerateResponse` messages as OpenAI JSON: streamed chunks (`start`, `chunk`, `end`) or,
    after `add`ing every message, the whole `response()`; `merged_response` and `usage_event` join a request's
    choices. Extensions: `spec_stats` beside `usage` (DDTree's per-request speculation summary), `timing` (where the
    request's time went, seconds: Final.timing) and vLLM's `stop_reason` (the matched stop string or token id)."""

    def __init__(self, chat: bool, request_id: str, model: str, tokenizer, logprobs: bool, index: int = 0,
                 echo: tuple[list[int], str] | None = None, prompt_only: bool = False):
        """echo (completions): the prompt's ids and text, returned before the completion (with their logprobs, which
        the first chunk carries); prompt_only: the completion itself is not returned (`max_tokens` 0)."""
        self.chat, self.model, self.tok = chat, model, tokenizer
        self.echo, self.prompt_only = echo, prompt_only
        self.request_id = request_id
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())
        self.logprobs, self.index = logprobs, index
        self.texts: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[dict] = []
        self.lps: list[dict] = []  # each chunk's logprobs object (_logprobs), joined by response()
        self.offset = 0  # completions' text_offset of the next token, characters
        self.final: pb.Final | None = None

    def _envelope(self, choices: list[dict], stream: bool, **extra) -> dict:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def _entry(self, token: int, logprob: float) -> dict:
        return {"token": self.tok.decode([token]), "logprob": logprob, "bytes": list(self.tok.token_bytes(token))}

    def _logprobs(self, chunk: pb.Chunk) -> dict | None:
        """Chat: `content` entries, each with its `top_logprobs`; completions: tokens, token_logprobs,
        top_logprobs (one {token: logprob} per token, None without alternatives) and text_offset."""
        if not self.logprobs:
            return None
        tops = list(chunk.top_logprobs) or [None] * len(chunk.token_ids)
        if self.chat:
            return {"content": [{**self._entry(t, lp), "top_logprobs": [] if top is None else [
                self._entry(i, v) for i, v in zip(top.token_ids, top.logprobs)]}
                for t, lp, top in zip(chunk.token_ids, chunk.logprobs, tops)]}
        return self._completion_logprobs(chunk.token_ids, list(chunk.logprobs), chunk.top_logprobs)

    def _completion_logprobs(self, ids, logprobs: list, tops) -> dict:
        tokens = [self.tok.decode([t]) for t in ids]
        offsets = []
        for s in tokens:
            offsets.append(self.offset)
            self.offset += len(s)
        alternatives = None if not tops else [
            None if top is None else {self.tok.decode([i]): v for i, v in zip(top.token_ids, top.logprobs)}
            for top in tops]
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": alternatives, "text_offset": offsets}

    def _completion_part(self, chunk: pb.Chunk) -> tuple[str, dict | None]:
        """Completions: one chunk's text and logprobs, the echoed prompt first (with the first chunk; its first
        token has no logprob, as OpenAI's); without the completion when only the prompt is asked for."""
        parts = []
        if self.echo is not None:
            ids, text = self.echo
            self.echo = None
            first = [None] if chunk.prompt_top_logprobs else None
            parts.append((text, self._completion_logprobs(ids, [None, *chunk.prompt_logprobs],
                                                          first and first + list(chunk.prompt_top_logprobs))
                          if self.logprobs else None))
        if not self.prompt_only:
            parts.append((chunk.text, self._logprobs(chunk)))
        lps = [lp for _, lp in parts if lp is not None]
        return "".join(t for t, _ in parts), _joined(lps) if lps else None

    def _tool_calls(self, chunk: pb.Chunk) -> list[dict]:
        """The chunk's calls in OpenAI's shape, each stream delta numbered across the response (`index`)."""
        new = [openai_tool_call(c) for c in chunk.tool_calls]
        numbered = [{"index": len(self.calls) + k, **call} for k, call in enumerate(new)]
        self.calls += new
        return numbered

    def _finish(self, final: pb.Final) -> dict:
        stop = final.matched_stop or (final.matched_stop_token_id if final.HasField("matched_stop_token_id") else None)
        reason = FINISH_REASONS.get(final.finish_reason, "stop")
        if self.calls and final.finish_reason == pb.FINISH_REASON_EOS:
            reason = "tool_calls"  # the turn ended after calling tools: the client runs them
        return {"finish_reason": reason, "stop_reason": stop}

    def _usage_and_stats(self, final: pb.Final) -> dict:
        u = pb.Usage()
        u.CopyFrom(final.usage)
        if self.prompt_only:
            u.completion_tokens = 0  # generated to end the request, not returned
        stats = json_format.MessageToDict(final.spec_stats, preserving_proto_field_name=True,
                                          always_print_fields_with_no_presence=True)
        stats["mode"] = pb.SpecMode.Name(final.spec_stats.mode).removeprefix("SPEC_MODE_").lower()
        return {"usage": {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                          "total_tokens": u.prompt_tokens + u.completion_tokens,
                          "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
                          "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens}},
                "spec_stats": stats, "timing": timing_dict(final)}

    def start(self) -> dict | None:
        """The stream's first event: chat announces the assistant role; completions send nothing."""
        if not self.chat:
            return None
        return self._envelope([{"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}], True)

    def chunk(self, chunk: pb.Chunk) -> dict | None:
        """A streamed event for one chunk; None when it carries nothing to show (text held back, no logprobs).
        Chat puts the model's thinking in `reasoning_content` (vLLM's and DeepSeek's name), the answer in `content`."""
        if not self.chat:
            text, logprobs = self._completion_part(chunk)
            if not text and not (logprobs and logprobs["tokens"]):
                return None
            return self._envelope([{"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": None}],
                                  True)
        if not (chunk.text or chunk.reasoning_text or chunk.tool_calls or (self.logprobs and chunk.token_ids)):
            return None
        delta = {"reasoning_content": chunk.reasoning_text} if chunk.reasoning_text else {}
        if chunk.tool_calls:
            delta["tool_calls"] = self._tool_calls(chunk)
        body = {"delta": {**delta, "content": chunk.text} if chunk.text or not delta else delta}
        return self._envelope([{"index": self.index, **body, "logprobs": self._logprobs(chunk), "finish_reason": None}],
                              True)

    def end(self, final: pb.Final) -> dict:
        """The choice's last stream event: its finish reason, with its spec_stats."""
        self.final = final
        body = {"delta": {}} if self.chat else {"text": ""}
        done = self._usage_and_stats(final)
        return self._envelope([{"index": self.index, **body, "logprobs": None, **self._finish(final)}], True,
                              spec_stats=done["spec_stats"], timing=done["timing"])

    def add(self, msg: pb.GenerateResponse) -> None:
        if msg.HasField("final"):
            self.final = msg.final
            return
        if self.chat:
            self.texts.append(msg.chunk.text)
            self.reasoning.append(msg.chunk.reasoning_text)
            self._tool_calls(msg.chunk)
            lp = self._logprobs(msg.chunk)
        else:
            text, lp = self._completion_part(msg.chunk)
            self.texts.append(text)
        if lp is not None:
            self.lps.append(lp)

    def response(self) -> dict:
        """The whole non-streamed response, after `add` saw the final message."""
        text = "".join(self.texts)
        body = {"text": text}
        if self.chat:
            body = {"message": {"role": "assistant", "content": text or (None if self.calls else ""),
                                "reasoning_content": "".join(self.reasoning) or None,
                                "tool_calls": self.calls or None}}
        logprobs = None
        if self.logprobs and self.chat:
            logprobs = {"content": [e for lp in self.lps for e in lp["content"]]}
        elif self.logprobs:
            logprobs = _joined(self.lps)
        return self._envelope([{"index": self.index, **body, "logprobs": logprobs, **self._finish(self.final)}], False,
                              **self._usage_and_stats(self.final))


def _joined(lps: list[dict]) -> dict:
    """Completions' logprobs objects, one after the other, as one (top_logprobs: None when none has alternatives)."""
    joined = {k: [x for lp in lps for x in lp[k]] for k in ("tokens", "token_logprobs", "text_offset")}
    tops = [lp["top_logprobs"] or [None] * len(lp["tokens"]) for lp in lps]
    joined["top_logprobs"] = [x for t in tops for x in t] if any(lp["top_logprobs"] for lp in lps) else None
    return joined


def _usage(outs: list[OpenAIResponse]) -> dict:
    """The request's usage: the prompt once (as the first choice saw it: its cached tokens), the completions (and
    their reasoning) of every choice."""
    each = [o._usage_and_stats(o.final)["usage"] for o in outs]
    completion = sum(u["completion_tokens"] for u in each)
    reasoning = sum(u["completion_tokens_details"]["reasoning_tokens"] for u in each)
    prompt = each[0]["prompt_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": each[0]["prompt_tokens_details"],
            "completion_tokens_details": {"reasoning_tokens": reasoning}}


def merged_response(outs: list[OpenAIResponse]) -> dict:
    """The whole response of n choices (after each saw its final message). With several, each choice carries its
    own spec_stats."""
    whole = [o.response() for o in outs]
    if len(whole) == 1:
        return whole[0]
    choices = [{**w["choices"][0], "spec_stats": w["spec_stats"], "timing": w["timing"]} for w in whole]
    rest = {k: v for k, v in whole[0].items() if k not in ("choices", "spec_stats", "timing")}
    return {**rest, "choices": choices, "usage": _usage(outs)}


def usage_event(outs: list[OpenAIResponse]) -> dict:
    """The stream's usage event (`stream_options.include_usage`), after every choice's end."""
    return outs[0]._envelope([], True, usage=_usage(outs))


def timing_dict(final: pb.Final) -> dict:
    """Final.timing as JSON (seconds): the verifier's queue_s, prefill_s, decode_s; the gateway's ttft_s, e2e_s."""
    return json_format.MessageToDict(final.timing, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)
