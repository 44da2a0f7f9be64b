"""The OpenAI JSON ↔ ddtree.v1 conversions (gateway/openai_api.py) and the HTTP error mapping, without a
server: each request field lands in the proto field the gRPC API documents; every refusal names the OpenAI
parameter the client sent; streamed events add up to the non-streamed response."""

from __future__ import annotations

import json

import grpc
import pytest

from ddtree.v1 import generation_pb2 as pb
from gateway.http_api import error_body
from gateway.openai_api import chat_request, choice_count, completion_request, openai_param, stream_flags
from gateway.openai_response import OpenAIResponse, merged_response, usage_event
from gateway.tokenizer import KimiTokenizer
from gateway.validation import Limits, choice_jobs, to_job
from service_kit.errors import InvalidArgument, ResourceExhausted, ServiceError

LIMITS_LONG = Limits(vocab_size=5000, max_context=4096, max_new_tokens=32, default_max_new_tokens=8,
                     max_tree_budget=16, max_stop_strings=2)
LIMITS = Limits(vocab_size=1000, max_context=64, max_new_tokens=32, default_max_new_tokens=8, max_tree_budget=16,
                max_stop_strings=2)


@pytest.fixture(scope="module")
def tok():
    return KimiTokenizer.from_dir("models/kimi-tiny")


def test_completion_fields_land_in_the_proto():
    req = completion_request({"prompt": "hi", "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 7, "min_p": 0.25,
                              "max_tokens": 12, "stop": "\n", "stop_token_ids": [3], "ignore_eos": True,
                              "spec_mode": "chain", "tree_budget": 4, "logprobs": 0, "n": 1, "echo": False})
    assert req.text == "hi" and req.return_logprobs
    assert (req.sampling.temperature, round(req.sampling.top_p, 6), req.sampling.top_k, req.sampling.seed) == \
        (0.5, 0.9, 5, 7)
    assert req.sampling.min_p == 0.25
    assert req.stopping.max_new_tokens == 12 and list(req.stopping.stop) == ["\n"]
    assert list(req.stopping.stop_token_ids) == [3] and req.stopping.ignore_eos
    assert not req.stopping.include_stop_str_in_output
    assert completion_request({"prompt": "x", "include_stop_str_in_output": True}).stopping.include_stop_str_in_output
    assert not req.stopping.HasField("max_duration_ms")
    assert completion_request({"prompt": "x", "max_duration_ms": 2500}).stopping.max_duration_ms == 2500
    assert req.speculation.mode == pb.SPEC_MODE_CHAIN and req.speculation.tree_budget == 4


def test_metadata_becomes_labels(tok):
    req = completion_request({"prompt": "x", "metadata": {"tenant": "acme", "job": "42"}})
    assert dict(req.labels) == {"tenant": "acme", "job": "42"}
    assert to_job(req, tok, LIMITS).labels == (("job", "42"), ("tenant", "acme"))
    with pytest.raises(InvalidArgument) as e:
        completion_request({"prompt": "x", "metadata": {"n": 5}})
    assert e.value.field == "metadata"
    for bad in ({f"k{i}": "v" for i in range(17)}, {"": "v"}, {"k" * 65: "v"}, {"k": "v" * 513}):
        with pytest.raises(InvalidArgument) as e:
            to_job(completion_request({"prompt": "x", "metadata": bad}), tok, LIMITS)
        assert openai_param(e.value.field, {}, False).startswith("metadata"), e.value.field


def test_min_p_must_be_a_number():
    with pytest.raises(InvalidArgument) as e:
        completion_request({"prompt": "x", "min_p": "high"})
    assert e.value.field == "min_p"


def test_top_logprobs_fields():
    req = completion_request({"prompt": "x", "logprobs": 5})
    assert req.return_logprobs and req.top_logprobs == 5
    req = chat_request({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 3})
    assert req.return_logprobs and req.top_logprobs == 3


def test_completion_prompt_forms_and_defaults():
    assert list(completion_request({"prompt": [5, 6, 7]}).token_ids.ids) == [5, 6, 7]
    assert list(completion_request({"prompt": [[5, 6]]}).token_ids.ids) == [5, 6]
    assert completion_request({"prompt": ["one"]}).text == "one"
    req = completion_request({"prompt": "x", "top_k": -1, "stop": None, "response_format": {"type": "text"},
                              "logit_bias": {}, "presence_penalty": 0.0})
    for field in ("temperature", "top_p", "top_k", "min_p", "seed"):
        assert not req.sampling.HasField(field), field  # unset: the server's default (greedy), as over gRPC
    assert not req.stopping.HasField("max_new_tokens") and not req.return_logprobs
    assert req.speculation.mode == pb.SPEC_MODE_UNSPECIFIED


def test_penalties_and_logit_bias_fields(tok):
    body = {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5, "frequency_penalty": -1,
            "repetition_penalty": 1.25, "logit_bias": {"5": 100, "7": -2.5}}
    s = chat_request(body).sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -1.0, 1.25)
    assert dict(s.logit_bias) == {5: 100.0, 7: -2.5}
    for bad, param in (({"presence_penalty": 2.5}, "presence_penalty"), ({"logit_bias": {"5": 101}}, "logit_bias[5]"),
                       ({"logit_bias": {str(LIMITS_LONG.vocab_size): 1}}, f"logit_bias[{LIMITS_LONG.vocab_size}]")):
        with pytest.raises(InvalidArgument) as e:
            to_job(chat_request({**body, **bad}), tok, LIMITS_LONG)
        assert openai_param(e.value.field, body, chat=True) == param, e.value.message


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, True]}, "prompt"),
    ({"prompt": [2**40]}, "prompt"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": True}, "temperature"),
    ({"prompt": "x", "max_tokens": 2**40}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
    ({"prompt": "x", "spec_mode": "eagle"}, "spec_mode"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "echo": 1}, "echo"),
    ({"prompt": "x", "presence_penalty": "high"}, "presence_penalty"),
    ({"prompt": "x", "repetition_penalty": True}, "repetition_penalty"),
    ({"prompt": "x", "logit_bias": [5, 100]}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"five": 100}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {str(2**40): 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": "100"}}, "logit_bias[5]"),
    ({"prompt": "x", "response_format": {"type": "grammar"}}, "response_format.type"),
    ({"prompt": "x", "response_format": "json"}, "response_format"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": "{}"}}},
     "response_format.json_schema.schema"),
    ({"prompt": "x", "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"ebnf": "a"}}, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"prompt": "x", "structured_outputs": {"choice": "a"}}, "structured_outputs.choice"),
    ({"prompt": "x", "structured_outputs": {"json": 5}}, "structured_outputs.json"),
    ({"prompt": "x", "structured_outputs": {"grammar": ["start"]}}, "structured_outputs.grammar"),
])
def test_completion_refusals_name_the_parameter(body, param):
    with pytest.raises(InvalidArgument) as e:
        completion_request(body)
    assert e.value.field == param, e.value.message


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_chat_tools_and_tool_turns(tok):
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": "", "reasoning_content": "I should look.",
                          "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                                          "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                         {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather",
                          "content": "18 C"}],
            "tools": [WEATHER]}
    req = chat_request(body)
    assert json.loads(req.chat.tools_json) == [WEATHER]
    call = req.chat.messages[1].tool_calls[0]
    assert (call.id, call.name, json.loads(call.arguments)) == ("functions.get_weather:0", "get_weather",
                                                                 {"city": "Paris"})
    assert req.chat.messages[1].reasoning_content == "I should look."
    assert (req.chat.messages[2].tool_call_id, req.chat.messages[2].name) == ("functions.get_weather:0", "get_weather")
    assert not chat_request({**body, "tool_choice": "none"}).chat.tools_json
    # The prompt is the template's rendering of exactly these messages and tools (OpenAI's shapes).
    want = [dict(m) for m in body["messages"]]
    want[1]["tool_calls"] = [{"id": "functions.get_weather:0", "type": "function",
                              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert list(to_job(req, tok, LIMITS_LONG).request.prompt_ids) == tok.encode_chat(want, tools=[WEATHER])
    assert "tool_declare" in tok.decode(tok.encode_chat(want, tools=[WEATHER]))


@pytest.mark.parametrize("tools_json", ["{not json", '{"type": "function"}', "[1]"])
def test_grpc_tools_json_is_checked(tok, tools_json):
    req = pb.GenerateRequest()
    req.chat.messages.add(role="user", content="x")
    req.chat.tools_json = tools_json
    with pytest.raises(InvalidArgument) as e:
        to_job(req, tok, LIMITS_LONG)
    assert e.value.field == "chat.tools_json", e.value.message


def test_streamed_tool_calls_and_finish_reason(tok):
    calls = [pb.ToolCall(id=f"functions.get_weather:{k}", name="get_weather", arguments=f'{{"k": {k}}}')
             for k in range(3)]
    msgs = [pb.GenerateResponse(chunk=pb.Chunk(token_ids=[1], text="Checking.", tool_calls=calls[:2])),
            pb.GenerateResponse(chunk=pb.Chunk(token_ids=[2], tool_calls=calls[2:])),
            pb.GenerateResponse(final=pb.Final(finish_reason=pb.FINISH_REASON_EOS, usage=pb.Usage()))]
    whole = OpenAIResponse(True, "r", "m", tok, logprobs=False)
    for m in msgs:
        whole.add(m)
    choice = whole.response()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    assert [c["function"]["arguments"] for c in choice["message"]["tool_calls"]] == ['{"k": 0}', '{"k": 1}', '{"k": 2}']
    streamed = OpenAIResponse(True, "r", "m", tok, logprobs=False)
    events = [streamed.chunk(m.chunk) for m in msgs[:2]] + [streamed.end(msgs[2].final)]
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert [t["index"] for d in deltas for t in d.get("tool_calls", [])] == [0, 1, 2]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    plain = OpenAIResponse(True, "r", "m", tok, logprobs=False)
    plain.add(msgs[2])
    assert plain.response()["choices"][0]["finish_reason"] == "stop"
    assert plain.response()["choices"][0]["message"]["tool_calls"] is None


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_top_logprobs_shapes(tok, chat):
    a, b = tok.encode(" there")[0], tok.encode(" world")[0]
    sa, sb = tok.decode([a]), tok.decode([b])
    tops = [pb.TopLogprobs(token_ids=[a, b], logprobs=[-0.5, -2.5]),
            pb.TopLogprobs(token_ids=[b, a], logprobs=[-0.25, -1.5])]
    msgs = [pb.GenerateResponse(chunk=pb.Chunk(token_ids=[a, b], text=sa + sb, logprobs=[-0.5, -0.25],
                                               top_logprobs=tops)),
            pb.GenerateResponse(final=pb.Final(finish_reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage()))]
    out = OpenAIResponse(chat, "r", "m", tok, logprobs=True)
    for m in msgs:
        out.add(m)
    lp = out.response()["choices"][0]["logprobs"]
    if chat:
        assert [(e["token"], e["logprob"]) for e in lp["content"][0]["top_logprobs"]] == [(sa, -0.5), (sb, -2.5)]
        assert bytes(lp["content"][1]["top_logprobs"][1]["bytes"]) == tok.token_bytes(a)
    else:
        assert lp["top_logprobs"] == [{sa: -0.5, sb: -2.5}, {sb: -0.25, sa: -1.5}]


def test_stream_flags():
    assert stream_flags({}) == (False, False)
    assert stream_flags({"stream": True, "stream_options": {"include_usage": True}}) == (True, True)
    for body, param in (({"stream": "yes"}, "stream"), ({"stream_options": []}, "stream_options"),
                        ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage")):
        with pytest.raises(InvalidArgument) as e:
            stream_flags(body)
        assert e.value.field == param


def test_chat_messages_parts_and_template_kwargs():
    req = chat_request({"messages": [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                  {"type": "text", "text": "b"}]},
                                     {"role": "assistant", "content": None}],
                        "chat_template_kwargs": {"thinking": False}, "logprobs": True, "top_logprobs": 0,
                        "max_completion_tokens": 5, "max_tokens": 9})
    assert [(m.role, m.content) for m in req.chat.messages] == [("system", "be brief"), ("user", "a\nb"),
                                                                ("assistant", "")]
    assert req.chat.HasField("thinking") and not req.chat.thinking
    assert req.return_logprobs and req.stopping.max_new_tokens == 5  # max_completion_tokens wins, as at OpenAI
    assert not chat_request({"messages": [{"role": "user", "content": "x"}]}).chat.HasField("thinking")
    assert chat_request({"messages": [{"role": "developer", "content": "be brief"}]}).chat.messages[0].role == "system"


def test_preserve_thinking_reaches_the_template(tok):
    """K2.6's preserve_thinking keeps an earlier assistant turn's reasoning in the prompt; default: dropped."""
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "SECRET"},
             {"role": "user", "content": "c"}]
    for kwargs, kept in (({}, False), ({"preserve_thinking": True}, True), ({"preserve_thinking": False}, False)):
        req = chat_request({"messages": turns, "chat_template_kwargs": kwargs})
        prompt = tok.decode(list(to_job(req, tok, LIMITS_LONG).request.prompt_ids))
        assert ("SECRET" in prompt) == kept, (kwargs, prompt)


@pytest.mark.parametrize("body, param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1"}]}]}, "messages[0].tool_calls[0]"),
    ({"messages": [{"role": "assistant", "tool_calls": {"id": "1"}}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes", "tools": [{"function": {}}]},
     "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": {"type": "function"}}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"mode": 1}},
     "chat_template_kwargs.mode"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"thinking": "no"}},
     "chat_template_kwargs.thinking"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "retrieval", "function": {}}]}, "tools[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
])
def test_chat_refusals_name_the_parameter(body, param):
    with pytest.raises(InvalidArgument) as e:
        chat_request(body)
    assert e.value.field == param, e.value.message


def test_structured_output_fields():
    """response_format and vLLM's structured_outputs -> GenerateRequest.response_format."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = {"messages": [{"role": "user", "content": "x"}]}
    cases = [
        ({"response_format": {"type": "text"}}, None, None),
        ({"response_format": {"type": "json_object"}}, "json_object", True),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}},
         "json_schema", schema),
        ({"structured_outputs": {"json": schema}}, "json_schema", schema),
        ({"structured_outputs": {"json": json.dumps(schema)}}, "json_schema", schema),
        ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+"),
        ({"structured_outputs": {"grammar": 'start: "a"'}}, "lark", 'start: "a"'),
        ({"structured_outputs": {"json_object": True}}, "json_object", True),
        ({"structured_outputs": {"choice": ['say "hi"', "ünï"]}}, "lark", 'start: "say \\"hi\\"" | "ünï"'),
    ]
    for extra, kind, want in cases:
        for req in (chat_request({**chat, **extra}), completion_request({"prompt": "x", **extra})):
            fmt = req.response_format
            assert fmt.WhichOneof("format") == kind, extra
            if kind == "json_schema":
                assert json.loads(fmt.json_schema) == want
            elif kind is not None:
                assert getattr(fmt, kind) == want


def test_structured_output_grammars(tok):
    """The gateway compiles each format into an llguidance grammar, with bounded JSON whitespace unless the schema
    chooses its own; the answer follows </think> in thinking mode."""
    import llguidance

    def job(extra, **fields):
        return to_job(chat_request({"messages": [{"role": "user", "content": "x"}], **extra, **fields}), tok,
                      LIMITS_LONG).request

    for extra in ({"response_format": {"type": "json_object"}}, {"structured_outputs": {"regex": "a|b"}},
                  {"structured_outputs": {"choice": ["x", "y"]}}, {"structured_outputs": {"grammar": 'start: "q"'}}):
        r = job(extra)
        assert r.grammar and llguidance.LLMatcher.validate_grammar(r.grammar) == "", extra
    bounded = job({"response_format": {"type": "json_object"}}).grammar
    assert "{1,64}" in bounded
    own = {"type": "object", "x-guidance": {"whitespace_flexible": False}}
    assert "{1,64}" not in job({"structured_outputs": {"json": own}}).grammar
    thinking = job({"response_format": {"type": "json_object"}}, chat_template_kwargs={"thinking": True})
    assert thinking.grammar_after_id == tok.think_tokens.end
    assert not job({"response_format": {"type": "json_object"}}, chat_template_kwargs={"thinking": False}) \
        .HasField("grammar_after_id")
    assert not job({}).grammar
    with pytest.raises(InvalidArgument) as e:  # a forced tool call is not the format's text
        job({"response_format": {"type": "json_object"}}, tools=[WEATHER], tool_choice="required")
    assert e.value.field == "response_format"


@pytest.mark.parametrize("body, chat, param", [
    ({"prompt": "x", "temperature": -1}, False, "temperature"),
    ({"prompt": "x", "top_p": 0}, False, "top_p"),
    ({"prompt": "x", "min_p": 1.5}, False, "min_p"),
    ({"prompt": "x", "max_tokens": 0}, False, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 99}, True, "max_completion_tokens"),
    ({"prompt": "x", "stop": ["a", "b", "c"]}, False, "stop"),
    ({"prompt": "x", "stop": ["a", ""]}, False, "stop[1]"),
    ({"prompt": "x", "stop_token_ids": [5000]}, False, "stop_token_ids[0]"),
    ({"prompt": "x", "tree_budget": 99}, False, "tree_budget"),
    ({"prompt": [1, 2, 5000]}, False, "prompt[2]"),
    ({"prompt": "x" * 400}, False, "prompt"),
    ({"messages": [{"role": "robot", "content": "x"}]}, True, "messages[0].role"),
    ({"prompt": "x", "logprobs": 21}, False, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, True, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30}, True, "top_logprobs"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strang"}}}},
     False, "response_format.json_schema"),
    ({"prompt": "x", "structured_outputs": {"regex": "(a"}}, False, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"grammar": "start: b"}}, False, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"regex": "a"}, "min_tokens": 2}, False, "min_tokens"),
    ({"prompt": "x", "structured_outputs": {"regex": "a"}, "ignore_eos": True}, False, "ignore_eos"),
])
def test_validation_errors_carry_openai_names(tok, body, chat, param):
    """The shared validation (gateway/validation.py) names proto paths; the HTTP client sees its own names."""
    req = chat_request(body) if chat else completion_request(body)
    with pytest.raises(InvalidArgument) as e:
        to_job(req, tok, LIMITS)
    assert openai_param(e.value.field, body, chat) == param, e.value.message


def _messages(tok, pieces: list[str], logprobs: list[float], thought: str = "") -> list[pb.GenerateResponse]:
    msgs = []
    if thought:  # the thinking block, closed by </think> (id 3 stands in for it)
        ids = tok.encode(thought) + [3]
        chunk = pb.Chunk(token_ids=ids, reasoning_text=thought, logprobs=[-2.0] * len(ids))
        msgs.append(pb.GenerateResponse(chunk=chunk))
    for text, lp in zip(pieces, logprobs):
        ids = tok.encode(text)
        msgs.append(pb.GenerateResponse(chunk=pb.Chunk(token_ids=ids, text=text, logprobs=[lp] * len(ids))))
    msgs.append(pb.GenerateResponse(chunk=pb.Chunk(token_ids=[7], text="", logprobs=[-3.0])))  # held back
    stats = pb.SpecStats(verify_steps=2, accepted_draft_tokens=3, mean_acceptance_length=2.5, tree_budget=16,
                         draft_tokens=32, mode=pb.SPEC_MODE_DDTREE, acceptance_histogram=[0, 1, 1])
    msgs.append(pb.GenerateResponse(final=pb.Final(finish_reason=pb.FINISH_REASON_STOP, matched_stop="END",
                                                   usage=pb.Usage(prompt_tokens=4, completion_tokens=5,
                                                                  reasoning_tokens=2),
                                                   spec_stats=stats)))
    return msgs


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_streamed_events_add_up_to_the_response(tok, chat):
    thought = "Hmm." if chat else ""
    msgs = _messages(tok, ["Hello", " world"], [-0.5, -1.25], thought)
    whole = OpenAIResponse(chat, "r1", "m", tok, logprobs=True)
    for m in msgs:
        whole.add(m)
    full = merged_response([whole])
    assert full == whole.response()
    streamed = OpenAIResponse(chat, "r1", "m", tok, logprobs=True)
    events = [streamed.start()] + [streamed.chunk(m.chunk) for m in msgs[:-1]] + [streamed.end(msgs[-1].final)]
    events.append(usage_event([streamed]))
    events = [e for e in events if e is not None]
    choice = full["choices"][0]
    assert full["id"] == ("chatcmpl-r1" if chat else "cmpl-r1")
    assert full["object"] == ("chat.completion" if chat else "text_completion")
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "END")
    assert full["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9,
                             "prompt_tokens_details": {"cached_tokens": 0},
                             "completion_tokens_details": {"reasoning_tokens": 2}}
    assert full["spec_stats"]["mode"] == "ddtree" and full["spec_stats"]["acceptance_histogram"] == [0, 1, 1]
    text = (choice["message"]["content"] if chat else choice["text"])
    assert text == "Hello world"
    deltas = [c["delta"].get("content", "") if chat else c["text"] for e in events for c in e["choices"]]
    assert "".join(deltas) == text
    if chat:
        assert choice["message"]["reasoning_content"] == thought
        assert "".join(c["delta"].get("reasoning_content", "") for e in events for c in e["choices"]) == thought
        assert events[1]["choices"][0]["delta"] == {"reasoning_content": thought}  # no empty content beside it
    assert events[-1]["choices"] == [] and events[-1]["usage"] == full["usage"]
    assert events[-2]["choices"][0]["finish_reason"] == "stop" and events[-2]["spec_stats"] == full["spec_stats"]
    n = len(tok.encode("Hello")) + len(tok.encode(" world")) + 1
    if chat:
        content = choice["logprobs"]["content"][len(tok.encode(thought)) + 1:]
        assert len(content) == n and content[0]["logprob"] == -0.5 and content[-1]["logprob"] == -3.0
        assert b"".join(bytes(c["bytes"]) for c in content[:-1]) == b"Hello world"
    else:
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == n
        assert "".join(lp["tokens"][:-1]) == "Hello world" and lp["text_offset"][1] == len(lp["tokens"][0])
        assert lp["token_logprobs"][-2:] == [-1.25, -3.0]


def test_error_statuses():
    cases = [(InvalidArgument("temperature", "bad"), 400, "temperature"),
             (ResourceExhausted("full"), 429, None),
             (ServiceError("down", grpc.StatusCode.UNAVAILABLE), 503, None),
             (ServiceError("late", grpc.StatusCode.DEADLINE_EXCEEDED), 504, None),
             (ServiceError("who", grpc.StatusCode.UNAUTHENTICATED), 401, None),
             (ServiceError("boom"), 500, None)]
    for err, status, param in cases:
        got, body = error_body(err)
        assert got == status and body["error"]["param"] == param and body["error"]["message"] == err.message


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_n_choices_are_indexed_with_their_own_stats_and_summed_usage(tok, chat):
    outs = [OpenAIResponse(chat, "r", "m", tok, logprobs=False, index=i) for i in range(3)]
    for i, out in enumerate(outs):
        for m in _messages(tok, ["Hello", " world" * (i + 1)], [-0.5, -1.0], "Hmm." if chat else ""):
            out.add(m)
    full = merged_response(outs)
    assert [c["index"] for c in full["choices"]] == [0, 1, 2] and "spec_stats" not in full
    assert all(c["spec_stats"]["mode"] == "ddtree" for c in full["choices"])
    assert full["usage"] == {"prompt_tokens": 4, "completion_tokens": 15, "total_tokens": 19,
                             "prompt_tokens_details": {"cached_tokens": 0},
                             "completion_tokens_details": {"reasoning_tokens": 6}}
    texts = [c["message"]["content"] if chat else c["text"] for c in full["choices"]]
    assert texts == ["Hello world", "Hello world world", "Hello world world world"]
    assert usage_event(outs)["usage"] == full["usage"] and usage_event(outs)["choices"] == []


def test_n_jobs_and_bounds(tok):
    req = chat_request({"messages": [{"role": "user", "content": "x"}], "n": 3, "seed": 5, "temperature": 1})
    req.request_id, req.sampling.seed = "abc", 2**64 - 2  # gRPC's uint64 wraps around
    jobs = choice_jobs(to_job(req, tok, LIMITS_LONG), choice_count({"n": 3}))
    assert [j.request.request_id for j in jobs] == ["abc-0", "abc-1", "abc-2"]
    assert [j.request.sampling.seed for j in jobs] == [2**64 - 2, 2**64 - 1, 0]
    assert len({tuple(j.request.prompt_ids) for j in jobs}) == 1 and jobs[0].request.sampling.temperature == 1
    unseeded = choice_jobs(to_job(chat_request({"messages": [{"role": "user", "content": "x"}]}), tok, LIMITS_LONG), 2)
    assert not any(j.request.sampling.HasField("seed") for j in unseeded)
    assert choice_jobs(jobs[0], 1) == [jobs[0]]
    for n in (0, 17, -1):
        with pytest.raises(InvalidArgument) as e:
            choice_count({"n": n})
        assert e.value.field == "n"


def test_min_tokens_maps_and_is_bounded(tok):
    req = completion_request({"prompt": "x", "min_tokens": 3, "max_tokens": 5})
    assert req.stopping.min_new_tokens == 3
    with pytest.raises(InvalidArgument) as e:
        to_job(completion_request({"prompt": "x", "min_tokens": 9, "max_tokens": 5}), tok, LIMITS_LONG)
    assert openai_param(e.value.field, {}, chat=False) == "min_tokens"
