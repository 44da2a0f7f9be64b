"""Anthropic Messages bodies → GenerateRequest (gateway/anthropic_api.py) and GenerateResponse messages → Messages
JSON (gateway/anthropic_response.py). The reference for the request side is the chat template fed the equivalent
OpenAI-shaped turns by hand; for the response side, the whole message must be what its stream events add up to."""

from __future__ import annotations

import json

import pytest

from ddtree.v1 import generation_pb2 as pb
from gateway.anthropic_api import anthropic_param, messages_request
from gateway.anthropic_response import AnthropicResponse, tool_input
from gateway.tokenizer import KimiTokenizer
from gateway.validation import Limits, to_job
from service_kit.errors import InvalidArgument

LIMITS = Limits(vocab_size=5000, max_context=4096, max_new_tokens=64, default_max_new_tokens=8, max_tree_budget=16,
                max_stop_strings=4)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


@pytest.fixture(scope="module")
def tok():
    return KimiTokenizer.from_dir("models/kimi-tiny")


def test_a_tool_round_trip_renders_as_the_equivalent_chat(tok):
    body = {"model": "m", "max_tokens": 32, "system": [{"type": "text", "text": "Be brief."}],
            "tools": [{"name": "get_weather", "description": "Weather now", "input_schema": SCHEMA}],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Look it up.", "signature": "x"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "functions.get_weather:0", "name": "get_weather",
                     "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "functions.get_weather:0",
                     "content": [{"type": "text", "text": "18 C"}]},
                    {"type": "text", "text": "And tomorrow?"}]}],
            "thinking": {"type": "enabled", "budget_tokens": 1024}}
    got = to_job(messages_request(body), tok, LIMITS).request.prompt_ids
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                               "parameters": SCHEMA}}]
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": "Checking.", "reasoning_content": "Look it up.",
              "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
             {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18 C"},
             {"role": "user", "content": "And tomorrow?"}]
    assert list(got) == tok.encode_chat(turns, tools=tools, thinking=True)


def test_sampling_stopping_and_choices():
    req = messages_request({"max_tokens": 7, "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5,
                            "top_p": 0.9, "top_k": 20, "stop_sequences": ["\n\n"], "spec_mode": "chain",
                            "tools": [{"name": "f", "input_schema": SCHEMA}], "tool_choice": {"type": "any"},
                            "thinking": {"type": "disabled"}})
    assert req.stopping.max_new_tokens == 7 and list(req.stopping.stop) == ["\n\n"]
    assert (round(req.sampling.temperature, 3), round(req.sampling.top_p, 3), req.sampling.top_k) == (0.5, 0.9, 20)
    assert req.speculation.mode == pb.SPEC_MODE_CHAIN and req.chat.tool_choice == "required"
    assert req.chat.HasField("thinking") and not req.chat.thinking
    base = {"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "f"}]}
    assert messages_request({**base, "tool_choice": {"type": "tool", "name": "f"}}).chat.tool_choice == "f"
    assert not messages_request({**base, "tool_choice": {"type": "none"}}).chat.tools_json
    assert messages_request({**base, "tool_choice": {"type": "auto"}}).chat.tool_choice == ""
    plain = messages_request({"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert not plain.sampling.HasField("temperature")  # unset: greedy, the target's exact output
    assert messages_request({"messages": [{"role": "user", "content": "hi"}]}, count_only=True).chat.messages


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 4, "messages": []}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]}, "messages[0].role"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0]"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"max_tokens": 4, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "input": {}}]}]},
     "messages[0].content[0].name"),
    ({"max_tokens": 4, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f",
                                                                        "input": "x"}]}]},
     "messages[0].content[0].input"),
    ({"max_tokens": 4, "system": [{"type": "image"}], "messages": [{"role": "user", "content": "hi"}]}, "system[0]"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "maybe"}},
     "tool_choice"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tools": [{"input_schema": {}}]}, "tools[0]"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "on"}}, "thinking.type"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "temperature": "warm"}, "temperature"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": [1]}, "stop_sequences"),
])
def test_refusals_name_the_parameter(body, param):
    with pytest.raises(InvalidArgument) as e:
        messages_request(body)
    assert e.value.field == param, e.value.message


def test_validation_errors_carry_message_names(tok):
    for body, param in (({"max_tokens": 99}, "max_tokens"), ({"max_tokens": 4, "temperature": -1}, "temperature"),
                        ({"max_tokens": 4, "tree_budget": 99}, "tree_budget"),
                        ({"max_tokens": 4, "stop_sequences": ["a", ""]}, "stop_sequences[1]")):
        with pytest.raises(InvalidArgument) as e:
            to_job(messages_request({"messages": [{"role": "user", "content": "hi"}], **body}), tok, LIMITS)
        assert anthropic_param(e.value.field) == param, e.value.message


def _stream(final: pb.Final, *chunks: pb.Chunk) -> list[pb.GenerateResponse]:
    return [pb.GenerateResponse(chunk=c) for c in chunks] + [pb.GenerateResponse(final=final)]


def _final(reason, stop="") -> pb.Final:
    return pb.Final(finish_reason=reason, matched_stop=stop,
                    usage=pb.Usage(prompt_tokens=40, completion_tokens=9, cached_prompt_tokens=32))


def _replay(events: list[dict]) -> dict:
    """A client's view: the blocks the stream's events build, checking their order."""
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    blocks, open_index = [], None
    for e in events[1:-2]:
        if e["type"] == "content_block_start":
            assert open_index is None and e["index"] == len(blocks)
            blocks.append(dict(e["content_block"]))
            open_index = e["index"]
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_index
            d, b = e["delta"], blocks[open_index]
            if d["type"] == "input_json_delta":
                b["input"] = json.loads(d["partial_json"])
            else:
                key = d["type"].removesuffix("_delta")
                b[key] += d[key]
        else:
            assert e["type"] == "content_block_stop" and e["index"] == open_index
            open_index = None
    assert open_index is None and events[-2]["type"] == "message_delta"
    return {"content": blocks, **events[-2]["delta"], "usage": events[-2]["usage"]}


@pytest.mark.parametrize("case", ["answer", "tool", "length", "stop"])
def test_whole_message_equals_its_stream(case):
    call = pb.ToolCall(id="functions.get_weather:0", name="get_weather", arguments='{"city": "Oslo"}')
    chunks = [pb.Chunk(reasoning_text="Let me "), pb.Chunk(reasoning_text="think."), pb.Chunk(text="It is "),
              pb.Chunk(text="sunny.")]
    if case == "tool":
        chunks.append(pb.Chunk(tool_calls=[call]))
    reason = {"length": pb.FINISH_REASON_LENGTH, "stop": pb.FINISH_REASON_STOP}.get(case, pb.FINISH_REASON_EOS)
    msgs = _stream(_final(reason, stop="\n\n" if case == "stop" else ""), *chunks)
    whole = AnthropicResponse("r1", "kimi", 40)
    for m in msgs:
        whole.add(m)
    message = whole.message()
    streamed = AnthropicResponse("r1", "kimi", 40)
    events = [streamed.start()]
    for m in msgs:
        events += streamed.end(m.final) if m.HasField("final") else streamed.chunk(m.chunk)
    assert _replay(events) == {k: message[k] for k in ("content", "stop_reason", "stop_sequence", "usage")}
    assert message["content"][:2] == [{"type": "thinking", "thinking": "Let me think.", "signature": ""},
                                      {"type": "text", "text": "It is sunny."}]
    want = {"answer": ("end_turn", None), "tool": ("tool_use", None), "length": ("max_tokens", None),
            "stop": ("stop_sequence", "\n\n")}[case]
    assert (message["stop_reason"], message["stop_sequence"]) == want
    if case == "tool":
        assert message["content"][2] == {"type": "tool_use", "id": call.id, "name": "get_weather",
                                         "input": {"city": "Oslo"}}
    assert message["usage"] == {"input_tokens": 8, "output_tokens": 9, "cache_read_input_tokens": 32,
                                "cache_creation_input_tokens": 0}
    assert message["id"] == "msg_r1" and message["type"] == "message" and message["role"] == "assistant"


def test_tool_input_keeps_arguments_that_are_not_an_object():
    assert tool_input('{"a": 1}') == {"a": 1} and tool_input("") == {}
    assert tool_input("[1, 2]") == {"arguments": "[1, 2]"} and tool_input("{oops") == {"arguments": "{oops"}
