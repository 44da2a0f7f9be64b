"""The gateway's OpenAI-compatible HTTP surface on the real stack (drafter, verifier, gateway processes; random
tiny model), driven by the official `openai` client: greedy DDTree output over HTTP equals plain AR decoding
over gRPC, streamed deltas add up to it, logprobs and stop strings match the gRPC path's, every refusal is an
OpenAI error naming its parameter, the bearer token guards both ports, and a client that hangs up frees its
session."""

from __future__ import annotations

import http.client
import json
import re
import signal
import time
import urllib.request

import grpc
import openai
import pytest
from gateway.tokenizer import KimiTokenizer
from stack import (PROMPTS, free_port, gen_request, generate, new_stack, pb, prometheus_samples, tiny_ckpt,  # noqa: F401
                   wait_until)

KEY = "test-key-123"
AUTH = (("authorization", f"Bearer {KEY}"),)
N = 40
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three trees."}]
DDTREE = {"spec_mode": "ddtree", "tree_budget": 16, "ignore_eos": True}


@pytest.fixture(scope="module")
def stack(request, tiny_ckpt, tmp_path_factory):
    with new_stack(request, tiny_ckpt, tmp_path_factory) as st:
        st.http_port = free_port()
        st.add_drafter(wait=False)
        st.verifier_metrics = free_port()
        st.add_verifier("--metrics-port", str(st.verifier_metrics), wait=False, adaptive=True)
        st.add_gateway("--http-port", str(st.http_port), "--api-key", KEY)
        yield st


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture
def idle(stack):
    yield stack
    wait_until(lambda: stack.verifier_info().pages_used == 0 and stack.drafter_info().sessions == 0, 10,
               "KV pages and drafter sessions to return to 0")


def grpc_ar(stack, req: pb.GenerateRequest, max_new: int = N):
    """The reference: plain autoregressive decoding of the same input through gRPC Generate."""
    req.stopping.max_new_tokens = max_new
    req.stopping.ignore_eos = True
    req.speculation.mode = pb.SPEC_MODE_AR
    return generate(_Authed(stack.generation), req)


class _Authed:
    def __init__(self, stub):
        self.stub = stub

    def Generate(self, req, timeout):
        return self.stub.Generate(req, timeout=timeout, metadata=AUTH)


def chat_ref(stack, thinking: bool | None = None):
    """AR over gRPC, and its answer and thinking cut out of the token ids by hand: (result, reasoning, answer)."""
    req = pb.GenerateRequest()
    for m in CHAT:
        req.chat.messages.add(**m)
    if thinking is not None:
        req.chat.thinking = thinking
    ref = grpc_ar(stack, req)
    tok = KimiTokenizer.from_dir(stack.model)
    end = ref.ids.index(tok.think_tokens.end) if tok.think_tokens.end in ref.ids else len(ref.ids)
    if thinking is False:
        end = -1
    thought = tok.decode(ref.ids[:max(end, 0)], skip_special_tokens=True)
    return ref, thought, tok.decode(ref.ids[end + 1:], skip_special_tokens=True)


def raw(stack, method: str, path: str, body: bytes | None = None, key: str | None = KEY):
    conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=30)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    conn.request(method, path, body=body, headers=headers)
    resp = conn.getresponse()
    return resp.status, resp.read(), resp


def test_models_health_and_metrics(stack, client):
    assert raw(stack, "GET", "/health", key=None)[0] == 200
    status, body, _ = raw(stack, "GET", "/metrics", key=None)
    assert status == 200 and b"ddtree_num_requests_running" in body
    models = client.models.list().data
    assert [m.id for m in models] == [stack.verifier_info().model_name]


@pytest.mark.parametrize("thinking", [None, False], ids=["thinking", "instant"])
def test_chat_greedy_ddtree_equals_grpc_ar(idle, client, thinking):
    ref, thought, answer = chat_ref(idle, thinking)
    assert ref.text == answer and ref.reasoning == thought  # gRPC's split
    model = client.models.list().data[0].id
    extra = DDTREE if thinking is None else {**DDTREE, "chat_template_kwargs": {"thinking": thinking}}
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=N, extra_body=extra)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == answer
    assert (choice.message.model_extra["reasoning_content"] or "") == thought
    assert bool(thought) == (thinking is None) and choice.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ref.final.usage.prompt_tokens, N)
    stats = r.model_extra["spec_stats"]
    assert stats["mode"] == "ddtree" and stats["tree_budget"] == 16 and stats["verify_steps"] >= 1, stats


def test_chat_stream_adds_up_to_the_reference(idle, client):
    ref, thought, answer = chat_ref(idle)
    events = list(client.chat.completions.create(model=client.models.list().data[0].id, messages=CHAT, max_tokens=N,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=DDTREE))
    assert events[0].choices[0].delta.role == "assistant"
    assert "".join(c.delta.content or "" for e in events for c in e.choices) == answer
    assert "".join(c.delta.model_extra.get("reasoning_content") or "" for e in events for c in e.choices) == thought
    assert [c.finish_reason for e in events for c in e.choices if c.finish_reason] == ["length"]
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == N
    assert len({e.id for e in events}) == 1 and events[0].id.startswith("chatcmpl-")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_n_choices_each_equal_their_seeded_grpc_reference(idle, client, stream):
    """n = 3 sampled choices over HTTP (DDTree): choice i is AR over gRPC with seed + i, the usage sums them."""
    refs = []
    for i in range(3):
        req = pb.GenerateRequest()
        req.token_ids.ids.extend(PROMPTS[1])
        req.sampling.temperature, req.sampling.seed = 1.0, 40 + i
        refs.append(grpc_ar(idle, req, 24))
    assert len({tuple(r.ids) for r in refs}) == 3, "the seeds must matter"
    kwargs = dict(model=client.models.list().data[0].id, prompt=PROMPTS[1], max_tokens=24, n=3, temperature=1.0,
                  seed=40, extra_body=DDTREE)
    if stream:
        events = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        texts = ["".join(c.text for e in events for c in e.choices if c.index == i) for i in range(3)]
        assert sorted(c.index for e in events for c in e.choices if c.finish_reason) == [0, 1, 2]
        usage = events[-1].usage
    else:
        r = client.completions.create(**kwargs)
        texts, usage = [c.text for c in sorted(r.choices, key=lambda c: c.index)], r.usage
        assert all(c.model_extra["spec_stats"]["mode"] == "ddtree" for c in r.choices)
    assert texts == [ref.text for ref in refs]
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(PROMPTS[1]), 72)


def _verifier_metric(stack, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.verifier_metrics}/metrics", timeout=10) as r:
        return sum(float(line.split()[-1]) for line in r.read().decode().splitlines() if line.startswith(name + " "))


def test_n_choices_share_the_prompt_prefill(idle, client):
    """The other choices start once the first has prefilled: they find its whole pages in the prefix cache."""
    prompt = [(i * 97 + 13) % 1792 for i in range(70)]  # pages of 16: 64 tokens reusable
    hits = _verifier_metric(idle, "ddtree_prefix_cache_hits_total")
    r = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=4, n=3,
                                  temperature=1.0, seed=3, extra_body=DDTREE)
    assert r.usage.prompt_tokens_details.cached_tokens == 0 and len(r.choices) == 3
    assert _verifier_metric(idle, "ddtree_prefix_cache_hits_total") - hits == 2 * 64


def test_a_drafter_that_does_not_pay_is_not_waited_for(idle, client):
    """The test checkpoint's drafter is random: its nodes are (almost) never accepted. The adaptive budget soon runs
    root-only steps that send no Propose (counted in ddtree_draft_skipped_steps_total), and the answer is still
    plain decoding's, token for token."""
    prompt = [(i * 31 + 7) % 1500 for i in range(40)]
    model = client.models.list().data[0].id
    ar = client.completions.create(model=model, prompt=prompt, max_tokens=160, temperature=0,
                                   extra_body={"spec_mode": "ar", "ignore_eos": True})
    skipped = _verifier_metric(idle, "ddtree_draft_skipped_steps_total")
    r = client.completions.create(model=model, prompt=prompt, max_tokens=160, temperature=0, extra_body=DDTREE)
    assert r.choices[0].text == ar.choices[0].text and r.usage.completion_tokens == 160
    assert _verifier_metric(idle, "ddtree_draft_skipped_steps_total") - skipped > 0
    assert r.model_extra["spec_stats"]["draft_unavailable_steps"] == 0  # a choice, not a failure


def test_named_tool_choice_returns_that_call(idle, client):
    """tool_choice naming a function: the answer opens that call (forced), and a bias on <|tool_call_end|> closes it
    right after, so the response carries a get_weather call with empty arguments."""
    tok = KimiTokenizer.from_dir(idle.model)
    close = tok.encode("<|tool_call_end|>", allow_special=True)[0]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    r = client.chat.completions.create(model=client.models.list().data[0].id, messages=CHAT, tools=tools,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       logit_bias={str(close): 100}, max_tokens=40,
                                       extra_body={**DDTREE, "chat_template_kwargs": {"thinking": False}})
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather" and calls[0].id == "functions.get_weather:0", r
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=client.models.list().data[0].id, messages=CHAT, tools=tools,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert e.value.response.json()["error"]["param"] == "tool_choice"


def test_structured_outputs_over_http(idle, client):
    """response_format json_schema with DDTree over HTTP gives the tokens of the same format by AR over gRPC, and the
    content is JSON of the schema; completions' structured_outputs.choice answers one of the choices, then stops."""
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer",
              "minimum": 1, "maximum": 9}}, "required": ["city", "days"], "additionalProperties": False,
              "x-guidance": {"whitespace_flexible": False}}
    model = client.models.list().data[0].id
    r = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=48,
        response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": schema, "strict": True}},
        extra_body={"spec_mode": "ddtree", "tree_budget": 16, "chat_template_kwargs": {"thinking": False}})
    answer = json.loads(r.choices[0].message.content)
    assert answer["city"] in ("Paris", "Oslo") and 1 <= answer["days"] <= 9 and r.choices[0].finish_reason == "stop"
    req = pb.GenerateRequest()
    for m in CHAT:
        req.chat.messages.add(**m)
    req.chat.thinking = False
    req.response_format.json_schema = json.dumps(schema)
    req.stopping.max_new_tokens, req.speculation.mode = 48, pb.SPEC_MODE_AR
    ref = generate(_Authed(idle.generation), req)
    assert r.choices[0].message.content == ref.text and r.usage.completion_tokens == len(ref.ids)
    c = client.completions.create(model=model, prompt="The best color is", max_tokens=8,
                                  extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert c.choices[0].text in ("red", "green", "blue") and c.choices[0].finish_reason == "stop", c


def _claude(stack, key: str = KEY):
    import anthropic
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{stack.http_port}", api_key=key, max_retries=0,
                               timeout=60)


def test_anthropic_messages_equal_grpc(idle, client):
    """Anthropic's client on /v1/messages (its `x-api-key`), DDTree, whole and streamed: the answer of the same chat
    by AR over gRPC, Anthropic's usage and stop reason, and count_tokens the prompt's length."""
    claude, model = _claude(idle), client.models.list().data[0].id
    system, turns = CHAT[0]["content"], CHAT[1:]
    args = dict(model=model, system=system, messages=turns, max_tokens=N, thinking={"type": "disabled"},
                extra_body={"spec_mode": "ddtree", "tree_budget": 16})
    ref, _, answer = chat_ref(idle, thinking=False)
    whole = claude.messages.create(**args)
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text == answer
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == N
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == ref.final.usage.prompt_tokens
    with claude.messages.stream(**args) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].text == answer and streamed.stop_reason == "max_tokens"
    count = claude.messages.count_tokens(model=model, system=system, messages=turns, thinking={"type": "disabled"})
    assert count.input_tokens == ref.final.usage.prompt_tokens


def test_anthropic_errors_are_anthropics_shape(idle):
    import anthropic

    model = idle.verifier_info().model_name
    with pytest.raises(anthropic.BadRequestError) as e:
        _claude(idle).messages.create(model=model, messages=[{"role": "robot", "content": "hi"}], max_tokens=4)
    err = e.value.response.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith("messages[0].role")
    with pytest.raises(anthropic.BadRequestError) as e:
        _claude(idle).messages.count_tokens(model=model, messages=[{"role": "user", "content": [{"type": "image",
                                                                                                  "source": {}}]}])
    assert e.value.response.json()["error"]["message"].startswith("messages[0].content[0]")
    with pytest.raises(anthropic.AuthenticationError) as e:
        _claude(idle, key="wrong").messages.create(model=model, messages=CHAT[1:], max_tokens=4)
    assert e.value.response.json()["error"]["type"] == "authentication_error"
    ok = _claude(idle).messages.create(model=model, messages=CHAT[1:], max_tokens=2)  # still serving
    assert ok.usage.output_tokens == 2


def test_chat_with_tools_and_tool_turns(idle, client):
    """Tools and a finished tool round trip go through the template as the tokenizer renders them."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [*CHAT, {"role": "assistant", "content": "", "tool_calls": [{"id": "functions.get_weather:0",
                "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18 C"}]
    r = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, tools=tools,
                                       max_tokens=4, extra_body=DDTREE)
    want = KimiTokenizer.from_dir(idle.model).encode_chat(messages, tools=tools)
    assert r.usage.prompt_tokens == len(want) and r.usage.completion_tokens == 4


def test_completions_token_ids_with_logprobs_equal_grpc(idle, client):
    """Logprobs and top-3 alternatives of DDTree over HTTP against AR over gRPC (the same target distributions)."""
    req = pb.GenerateRequest(return_logprobs=True, top_logprobs=3)
    req.token_ids.ids.extend(PROMPTS[2])
    ref = grpc_ar(idle, req)
    chunks = [msg.chunk for msg in _Authed(idle.generation).Generate(req, 60) if msg.HasField("chunk")]
    ref_lps = [lp for c in chunks for lp in c.logprobs]
    ref_tops = [list(top.logprobs) for c in chunks for top in c.top_logprobs]
    r = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPTS[2], max_tokens=N, logprobs=3,
                                  extra_body=DDTREE)
    choice = r.choices[0]
    assert choice.text == ref.text and r.usage.completion_tokens == len(ref.ids) == N
    assert len(choice.logprobs.tokens) == N
    assert choice.logprobs.token_logprobs == pytest.approx(ref_lps, abs=1e-4)  # AR vs tree rows: same target
    tops = choice.logprobs.top_logprobs
    assert len(tops) == N and all(len(t) == 3 for t in tops)
    assert [sorted(t.values(), reverse=True) for t in tops] == [pytest.approx(v, abs=1e-4) for v in ref_tops]
    assert all(max(t.values()) == pytest.approx(lp, abs=1e-6) for t, lp in zip(tops, choice.logprobs.token_logprobs))


def test_completions_penalties_and_logit_bias_equal_grpc(idle, client):
    """OpenAI's presence/frequency penalties and logit_bias, vLLM's repetition_penalty: DDTree over HTTP gives the
    tokens of AR over gRPC with the same fields (the penalized target), and they are not the unpenalized ones."""
    req = pb.GenerateRequest()
    req.token_ids.ids.extend(PROMPTS[2])
    plain = grpc_ar(idle, pb.GenerateRequest(token_ids=req.token_ids))
    bias = {plain.ids[0]: -100.0, plain.ids[2]: 3.0}
    req.sampling.presence_penalty, req.sampling.frequency_penalty, req.sampling.repetition_penalty = 0.5, 0.25, 1.2
    req.sampling.logit_bias.update(bias)
    ref = grpc_ar(idle, req)
    r = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPTS[2], max_tokens=N,
                                  presence_penalty=0.5, frequency_penalty=0.25,
                                  logit_bias={str(k): v for k, v in bias.items()},
                                  extra_body={**DDTREE, "repetition_penalty": 1.2})
    assert r.choices[0].text == ref.text and ref.ids != plain.ids


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completions_echo_with_logprobs(idle, client, stream):
    """lm-eval's loglikelihood request (`echo`, `logprobs`, `max_tokens` 0): the prompt comes back with each token's
    log-probability (the first has none) equal to one in-process prefill of it; with `max_tokens` N the completion
    follows, as gRPC AR gives it."""
    import torch
    from model_fixtures import load_model, new_cache, one_thread, prefill

    tok = KimiTokenizer.from_dir(idle.model)
    kwargs = dict(model=client.models.list().data[0].id, prompt=PROMPTS[2], echo=True, logprobs=2, extra_body=DDTREE)

    def complete(**more):
        if not stream:
            r = client.completions.create(**kwargs, **more)
            return r.choices[0].text, r.choices[0].logprobs.token_logprobs, r.choices[0].logprobs.top_logprobs, r.usage
        events = list(client.completions.create(**kwargs, **more, stream=True, stream_options={"include_usage": True}))
        choices = [c for e in events for c in e.choices]
        lps = [c.logprobs for c in choices if c.logprobs]
        return ("".join(c.text for c in choices), [x for lp in lps for x in lp.token_logprobs],
                [x for lp in lps for x in lp.top_logprobs], events[-1].usage)

    text, logprobs, tops, usage = complete(max_tokens=0)
    assert text == tok.decode(PROMPTS[2]) and usage.completion_tokens == 0 and usage.prompt_tokens == len(PROMPTS[2])
    assert logprobs[0] is None and tops[0] is None and len(logprobs) == len(tops) == len(PROMPTS[2])
    with one_thread():
        model = load_model(idle.model)
        lsm = torch.log_softmax(prefill(model, new_cache(model), "ref", PROMPTS[2]).logits.float(), -1)
    want = lsm[:-1].gather(-1, torch.tensor(PROMPTS[2][1:]).unsqueeze(-1)).squeeze(-1)
    assert logprobs[1:] == pytest.approx(want.tolist(), abs=1e-4)
    assert all(len(t) == 2 and max(t.values()) >= lp - 1e-6 for t, lp in zip(tops[1:], logprobs[1:]))
    req = pb.GenerateRequest()
    req.token_ids.ids.extend(PROMPTS[2])
    ref = grpc_ar(idle, req, 12)
    text, logprobs, _, usage = complete(max_tokens=12)
    assert text == tok.decode(PROMPTS[2]) + ref.text and usage.completion_tokens == 12
    assert len(logprobs) == len(PROMPTS[2]) + 12


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_stop_string_truncates_like_grpc(idle, client, stream):
    ref = grpc_ar(idle, gen_request(PROMPTS[3], N))
    stop = next(ref.text[i:i + 2] for i in range(5, len(ref.text) - 2) if ref.text[i:i + 2].strip())
    kwargs = dict(model=client.models.list().data[0].id, prompt=PROMPTS[3], max_tokens=N, stop=[stop],
                  extra_body=DDTREE)
    if stream:
        events = list(client.completions.create(stream=True, **kwargs))
        text = "".join(c.text for e in events for c in e.choices)
        last = events[-1].choices[0]
    else:
        last = client.completions.create(**kwargs).choices[0]
        text = last.text
    assert text == ref.text[:ref.text.index(stop)]
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == stop


@pytest.mark.parametrize("kwargs, status, param", [
    (dict(temperature=-1), 400, "temperature"),
    (dict(max_tokens=100000), 400, "max_tokens"),
    (dict(n=17), 400, "n"),
    (dict(presence_penalty=2.5), 400, "presence_penalty"),
    (dict(logit_bias={"-4": 1}), 400, "logit_bias[-4]"),
    (dict(extra_body={"tree_budget": 0}), 400, "tree_budget"),
    (dict(messages=[{"role": "robot", "content": "hi"}]), 400, "messages[0].role"),
    (dict(model="gpt-5"), 404, "model"),
])
def test_bad_requests_name_the_parameter(idle, client, kwargs, status, param):
    args = {"model": client.models.list().data[0].id, "messages": CHAT, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(**args)
    err = e.value.response.json()["error"]
    assert e.value.status_code == status and err["param"] == param, err
    model = client.models.list().data[0].id  # and the service goes on serving
    assert client.chat.completions.create(model=model, messages=CHAT, max_tokens=2).usage.completion_tokens == 2


def test_malformed_bodies_and_paths(idle):
    for body, param in ((b"{not json", "body"), (b"[1, 2]", "body"), (json.dumps({"prompt": 5}).encode(), "prompt")):
        status, data, _ = raw(idle, "POST", "/v1/completions", body)
        assert status == 400 and json.loads(data)["error"]["param"] == param, data
    assert raw(idle, "GET", "/v1/nope")[0] == 404
    assert raw(idle, "GET", "/v1/completions")[0] == 405


def test_bearer_token_guards_both_ports(idle, client):
    for key in (None, "wrong"):
        status, data, _ = raw(idle, "GET", "/v1/models", key=key)
        assert status == 401 and json.loads(data)["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0).models.list()
    req = gen_request(PROMPTS[0], 2)
    with pytest.raises(grpc.RpcError) as e:
        generate(idle.generation, req)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert len(generate(_Authed(idle.generation), gen_request(PROMPTS[0], 2)).ids) == 2
    assert raw(idle, "GET", "/health", key=None)[0] == 200


def _open_stream(port: int, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A streamed completion read up to its first event; closing the returned connection hangs up."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    assert resp.readline().startswith(b"data: {")  # the first token has come
    return conn, resp


def test_client_hangup_frees_the_session(idle):
    model = idle.verifier_info().model_name
    conn, _ = _open_stream(idle.http_port, {"model": model, "prompt": PROMPTS[2], "max_tokens": 250, "stream": True,
                                         **DDTREE})
    wait_until(lambda: idle.drafter_info().sessions == 1, 10, "the drafter to hold the session")
    assert idle.verifier_info().pages_used > 0
    t0 = time.monotonic()
    conn.close()
    wait_until(lambda: idle.verifier_info().pages_used == 0, 5, "KV pages freed after the hang-up", period=0.02)
    assert time.monotonic() - t0 < 2.0
    wait_until(lambda: idle.drafter_info().sessions == 0, 5, "drafter session released after the hang-up")


def test_admission_limit_is_429(idle):
    port = free_port()
    gw = idle.add_gateway("--max-concurrent-requests", "1", "--http-port", str(port), name="gateway-http-admission")
    try:
        model = idle.verifier_info().model_name
        held, _ = _open_stream(port, {"model": model, "prompt": PROMPTS[1], "max_tokens": 250, "stream": True,
                                   "spec_mode": "ar", "ignore_eos": True})
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model=model, prompt="x", max_tokens=2)
        assert e.value.response.headers["Retry-After"] == "1"
        held.close()
        wait_until(lambda: idle.verifier_info().pages_used == 0, 5, "the held stream to end")
        assert c.completions.create(model=model, prompt="x", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.RateLimitError):  # n choices are n requests: the second is refused, both end
            c.completions.create(model=model, prompt="x", max_tokens=200, n=2, extra_body={"ignore_eos": True})
        wait_until(lambda: idle.verifier_info().pages_used == 0 and idle.verifier_info().live_sessions == 0, 5,
                   "the admitted choice to end with the refused one")
        assert c.completions.create(model=model, prompt="x", max_tokens=2).usage.completion_tokens == 2
    finally:
        gw.kill()


def test_cli_generate_sends_the_token(idle, capsys):
    from service_kit.cli import main
    args = ["generate", "--address", idle.gateway.address, "--max-new-tokens", "3", "--mode", "ar", "hello"]
    assert main([*args, "--api-key", KEY]) == 0
    assert "completion=3" in capsys.readouterr().err
    assert main([*args, "--api-key", ""]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_cli_generate_structured_output(idle, capsys, tmp_path):
    """`ddtree generate --regex / --json-schema`: the printed answer matches the format."""
    import re

    from service_kit.cli import main
    base = ["generate", "--address", idle.gateway.address, "--max-new-tokens", "24", "--api-key", KEY, "Count:"]
    assert main([*base, "--regex", "[0-9]{1,4}( [0-9]{1,4}){0,3}"]) == 0
    assert re.fullmatch("[0-9]{1,4}( [0-9]{1,4}){0,3}\n", capsys.readouterr().out)
    schema = tmp_path / "schema.json"
    number = {"type": "integer", "minimum": 0, "maximum": 99}
    schema.write_text(json.dumps({"type": "object", "properties": {"n": number}, "required": ["n"],
                                  "additionalProperties": False,
                                  "x-guidance": {"whitespace_flexible": False}}))
    assert main([*base, "--json-schema", str(schema)]) == 0
    assert 0 <= json.loads(capsys.readouterr().out)["n"] <= 99


def test_cli_generate_marks_the_thinking_block(idle, capsys):
    from service_kit.cli import main
    user = CHAT[1]["content"]  # the CLI sends one user turn
    args = ["generate", "--address", idle.gateway.address, "--max-new-tokens", str(N), "--mode", "ddtree",
            "--chat", "--api-key", KEY, user]
    req = pb.GenerateRequest()
    req.chat.messages.add(role="user", content=user)
    ref = grpc_ar(idle, req)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out == f"<think>{ref.reasoning}" + (f"</think>{ref.text}" if ref.text else "") + "\n"


def test_sigterm_drains_http_streams(idle):
    """SIGTERM to a gateway: /health stops answering 200 at once, the open HTTP stream still runs to its end
    ([DONE], every token), then the process exits cleanly."""
    port = free_port()
    gw = idle.add_gateway("--http-port", str(port), name="gateway-http-drain")
    try:
        model = idle.verifier_info().model_name
        _, resp = _open_stream(port, {"model": model, "prompt": PROMPTS[1], "max_tokens": 160, "stream": True,
                                   "spec_mode": "ar", "ignore_eos": True, "stream_options": {"include_usage": True}})
        gw.signal(signal.SIGTERM)  # 160 tokens take longer than this test's first event (~0.5 s on CPU)

        def health() -> int | None:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                c.request("GET", "/health")
                return c.getresponse().status
            except OSError:
                return None
        wait_until(lambda: health() != 200, 3, "/health to stop answering 200 while draining", period=0.02)
        events = [line for line in resp.read().split(b"\n") if line.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]"
        assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 160
        assert gw.wait(15) == 0, gw.log_tail()
    finally:
        gw.kill()


def test_concurrent_http_streams_each_equal_their_grpc_reference(idle, client):
    """Eight streams at once over HTTP, mixed modes and budgets: each one's text is its own prompt's AR text."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    refs = [grpc_ar(idle, gen_request(p, 24), max_new=24).text for p in prompts]
    model = client.models.list().data[0].id

    def one(i: int) -> str:
        extra = {"spec_mode": ("ar", "chain", "ddtree")[i % 3], "tree_budget": (4, 16, 64)[i % 3], "ignore_eos": True}
        if i % 3 == 1:
            extra.pop("tree_budget")
        events = client.completions.create(model=model, prompt=prompts[i], max_tokens=24, stream=True,
                                           extra_body=extra)
        return "".join(c.text for e in events for c in e.choices)

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, range(8)))
    assert got == refs


def test_server_info_lists_the_http_surface(idle):
    info = idle.generation.GetServerInfo(pb.GetServerInfoRequest(), timeout=5, metadata=AUTH)
    want = {"openai_http", "anthropic_http", "reasoning_text", "tool_calls", "response_format"}
    assert want <= set(info.supported_features)
    with pytest.raises(grpc.RpcError) as e:  # the token guards GetServerInfo too
        idle.generation.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_tokenize_and_detokenize_match_the_generation_prompt(idle, client):
    tok = KimiTokenizer.from_dir(idle.model)
    status, body, _ = raw(idle, "POST", "/tokenize", json.dumps({"messages": CHAT}).encode())
    got = json.loads(body)
    want = tok.encode_chat(CHAT)
    assert status == 200 and got["tokens"] == want and got["count"] == len(want) > 0
    r = client.chat.completions.create(model=client.models.list().data[0].id, messages=CHAT, max_tokens=1)
    assert r.usage.prompt_tokens == got["count"]  # the same prompt a generation gets
    status, body, _ = raw(idle, "POST", "/tokenize", json.dumps({"prompt": "hello world"}).encode())
    assert status == 200 and json.loads(body)["tokens"] == tok.encode("hello world")
    status, body, _ = raw(idle, "POST", "/detokenize", json.dumps({"tokens": want}).encode())
    assert status == 200 and json.loads(body)["prompt"] == tok.decode(want)
    for path, payload, param in (("/detokenize", {"tokens": [10**9]}, "tokens[0]"), ("/detokenize", {}, "tokens"),
                                 ("/tokenize", {"messages": []}, "messages"), ("/tokenize", {"prompt": 5}, "prompt")):
        status, body, _ = raw(idle, "POST", path, json.dumps(payload).encode())
        assert status == 400 and json.loads(body)["error"]["param"] == param, (path, body)
    assert raw(idle, "POST", "/tokenize", json.dumps({"prompt": "x"}).encode(), key=None)[0] == 401


def _summary(proc, event: str, trace_id: str) -> dict[str, str]:
    """The key=value fields of `proc`'s `event` line for `trace_id` (console log format), once it is written."""
    found: dict[str, str] = {}

    def seen() -> bool:
        for line in proc.log_path.read_text(errors="replace").splitlines():
            if event in line and f"trace_id={trace_id}" in line:
                found.update(re.findall(r"(\w+)=(\S+)", line))
                return True
        return False

    wait_until(seen, 10, f"{proc.name}: a {event} line of trace {trace_id}")
    return found


@pytest.mark.parametrize("via", ["grpc", "http"])
def test_traceparent_reaches_every_log_line_of_the_request(idle, via):
    """A client's W3C traceparent is continued by the gateway (its request_finished line) and, as the gateway
    span's child, by the verifier (its session_finished line): one trace id greps one request out of both logs."""
    trace = "4bf92f3577b34da6a3ce929d0e0e47" + ("01" if via == "grpc" else "02")
    parent = "00f067aa0ba902b7"
    header = f"00-{trace}-{parent}-01"
    if via == "grpc":
        req = gen_request(PROMPTS[0], 8, mode=pb.SPEC_MODE_DDTREE)
        for _ in idle.generation.Generate(req, timeout=60, metadata=(*AUTH, ("traceparent", header))):
            pass
    else:
        conn = http.client.HTTPConnection("127.0.0.1", idle.http_port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": PROMPTS[0], "max_tokens": 8, **DDTREE}),
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}",
                              "traceparent": header})
        assert conn.getresponse().status == 200
    gw = _summary(idle.gateway, "request_finished", trace)
    vf = _summary(idle.verifier, "session_finished", trace)
    assert gw["parent_span_id"] == parent and re.fullmatch(r"[0-9a-f]{16}", gw["span_id"]) and gw["span_id"] != parent
    assert vf["parent_span_id"] == gw["span_id"] and vf["span_id"] not in (parent, gw["span_id"])
    assert gw["request_id"] == vf["request_id"] and gw["outcome"] == "FINISH_REASON_LENGTH"
    assert gw["completion_tokens"] == vf["completion_tokens"] == "8" and gw["mode"] == "SPEC_MODE_DDTREE"


@pytest.mark.parametrize("key, ok", [(KEY, True), ("wrong", False)])
def test_deep_health_probe_generates_one_token(stack, key, ok):
    """`ddtree health --deep`: SERVING and one real token through gateway, verifier and model (the bearer token from
    DDTREE_API_KEY); with a wrong token the health check passes but the probe does not."""
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "service_kit.cli", "health", f"--address={stack.gateway.address}",
                        "--service=ddtree.v1.Generation", "--deep", "--timeout-s=60"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "DDTREE_API_KEY": key})
    assert r.returncode == (0 if ok else 1), r.stdout + r.stderr
    assert ("deep: 1 token in" in r.stdout) == ok and ("UNAUTHENTICATED" in r.stderr) != ok


def _gateway_samples(stack) -> dict[str, float]:
    return prometheus_samples(raw(stack, "GET", "/metrics", key=None)[1].decode())


def test_per_request_histograms(idle, client):
    """One request of 5 prompt and 6 generated tokens adds exactly that to the per-request histograms."""
    before = _gateway_samples(idle)
    r = client.completions.create(model=client.models.list().data[0].id, prompt=[11, 12, 13, 14, 15], max_tokens=6,
                                  extra_body=DDTREE)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (5, 6)
    after = _gateway_samples(idle)
    for name, total in (("ddtree_request_prompt_tokens", 5), ("ddtree_request_generation_tokens", 6)):
        assert after[f"{name}_count"] - before.get(f"{name}_count", 0) == 1
        assert after[f"{name}_sum"] - before.get(f"{name}_sum", 0) == total
    tpot = "ddtree_request_time_per_output_token_seconds"
    assert after[f"{tpot}_count"] - before.get(f"{tpot}_count", 0) == 1
    assert 0 < after[f"{tpot}_sum"] - before.get(f"{tpot}_sum", 0) < 60


def test_verifier_phase_histograms(idle, client):
    """One request adds one observation to each of the verifier's queue, prefill and decode histograms, and the
    three add up to less than the gateway's end-to-end time for it."""
    names = [f"ddtree_request_{p}_time_seconds" for p in ("queue", "prefill", "decode")]
    before = {n: (_verifier_metric(idle, n + "_count"), _verifier_metric(idle, n + "_sum")) for n in names}
    t0 = time.monotonic()
    client.completions.create(model=client.models.list().data[0].id, prompt=PROMPTS[0], max_tokens=8,
                              extra_body=DDTREE)
    e2e = time.monotonic() - t0
    spent = 0.0
    for n in names:
        count, total = _verifier_metric(idle, n + "_count"), _verifier_metric(idle, n + "_sum")
        assert count - before[n][0] == 1, n
        spent += total - before[n][1]
    assert 0 < spent < e2e


def test_responses_carry_timing(idle, client):
    """`timing` beside `spec_stats` (seconds): the verifier's phases within the gateway's end-to-end time."""
    r = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPTS[0], max_tokens=6,
                                  extra_body=DDTREE)
    t = r.model_extra["timing"]
    assert set(t) == {"queue_s", "prefill_s", "decode_s", "ttft_s", "e2e_s"}
    assert 0 < t["ttft_s"] <= t["e2e_s"] and t["queue_s"] + t["prefill_s"] + t["decode_s"] <= t["e2e_s"]
    events = list(client.completions.create(model=r.model, prompt=PROMPTS[0], max_tokens=6, stream=True,
                                            extra_body=DDTREE))
    last = events[-1].model_extra
    assert last["timing"]["e2e_s"] > 0 and "spec_stats" in last


def test_metadata_labels_reach_the_request_log_line(idle):
    """OpenAI's `metadata` (GenerateRequest.labels) is written into the gateway's request_finished line."""
    trace = "4bf92f3577b34da6a3ce929d0e0e4703"
    conn = http.client.HTTPConnection("127.0.0.1", idle.http_port, timeout=30)
    body = {"prompt": PROMPTS[0], "max_tokens": 3, "metadata": {"tenant": "acme-labs"}, **DDTREE}
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}",
                          "traceparent": f"00-{trace}-00f067aa0ba902b7-01"})
    assert conn.getresponse().status == 200

    def line():
        return next((ln for ln in idle.gateway.log_path.read_text(errors="replace").splitlines()
                     if "request_finished" in ln and trace in ln), None)

    assert "acme-labs" in wait_until(line, 10, "the request_finished line")
