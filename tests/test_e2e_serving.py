"""End to end on the real stack (drafter, verifier, gateway processes; random tiny model): lossless
greedy and seeded sampling, 16 mixed concurrent streams, cancellation, bad input, admission (issue 5)."""

from __future__ import annotations

import re
import time

import grpc
import pytest
from stack import (PROMPTS, Streaming, first_difference, gen_request, generate, generate_many, new_stack,  # noqa: F401
                   ok, pb, tiny_ckpt, vpb, wait_until)

from ddtree.v1 import generation_pb2_grpc as pb_grpc

N = 64


@pytest.fixture(scope="module")
def stack(request, tiny_ckpt, tmp_path_factory):
    with new_stack(request, tiny_ckpt, tmp_path_factory) as st:
        st.add_drafter(wait=False)
        st.add_verifier("--prefill-chunk", "32", wait=False)
        st.add_gateway("--max-message-mb", "1")
        yield st


@pytest.fixture(scope="module")
def ar_refs(stack):
    """Plain AR decoding of PROMPTS: the reference every mode must reproduce."""
    return [generate(stack.generation, gen_request(p, N, mode=pb.SPEC_MODE_AR)) for p in PROMPTS]


@pytest.fixture
def idle(stack):
    """After the test: no session, KV page or drafter cache left behind."""
    yield stack
    wait_until(lambda: stack.verifier_info().pages_used == 0 and stack.drafter_info().sessions == 0, 10,
               "KV pages and drafter sessions to return to 0")


@pytest.mark.parametrize("mode, budget", [(pb.SPEC_MODE_DDTREE, 4), (pb.SPEC_MODE_DDTREE, 16),
                                          (pb.SPEC_MODE_DDTREE, 64), (pb.SPEC_MODE_CHAIN, None)],
                         ids=["ddtree4", "ddtree16", "ddtree64", "chain"])
def test_greedy_equals_ar(idle, ar_refs, mode, budget):
    got = ok(generate_many(idle.generation, [gen_request(p, N, mode=mode, budget=budget) for p in PROMPTS]))
    for i, (r, ref) in enumerate(zip(got, ar_refs)):
        assert r.ids == ref.ids, f"prompt {i}: {first_difference(r.ids, ref.ids)}"
        s = r.final.spec_stats
        assert s.mode == mode and s.draft_tokens > 0 and s.draft_unavailable_steps == 0, s
        assert s.tree_budget == (budget or 7) and s.draft_tokens <= s.tree_budget * s.verify_steps, s
        assert len(ref.ids) == N and ref.final.spec_stats.mode == pb.SPEC_MODE_AR
        assert ref.final.spec_stats.tree_budget == 0 and ref.final.spec_stats.draft_tokens == 0


def test_ar_mode_equals_in_process_recompute(idle, ar_refs, tiny_ckpt):
    """The served AR path (chunked prefill, paged cache, one row per step) against an independent
    greedy loop in this process that re-runs the whole sequence through the model every token; and the
    served DDTree stream's top-5 logprobs (tree rows) against that loop's log-softmax."""
    import torch
    from model_fixtures import load_model, new_cache, one_thread, prefill

    req = gen_request(PROMPTS[2], N, mode=pb.SPEC_MODE_DDTREE, budget=16)
    req.return_logprobs, req.top_logprobs = True, 5
    tops = [top for msg in idle.generation.Generate(req, timeout=120) if msg.HasField("chunk")
            for top in msg.chunk.top_logprobs]  # DDTree: tree rows' top-5, against AR recomputed here
    assert len(tops) == N
    with one_thread():
        model = load_model(tiny_ckpt)
        for i in (2,):  # 45 tokens: two prefill chunks of 32, pages of 16
            seq = list(PROMPTS[i])
            for k in range(N):
                logits = prefill(model, new_cache(model), "ref", seq).logits[-1]
                top2 = torch.topk(logits, 2).values
                token = int(logits.argmax())
                if token != ar_refs[i].ids[k]:
                    gap = float(top2[0] - top2[1])
                    assert gap < 1e-4, (f"prompt {i}, token {k}: served {ar_refs[i].ids[k]}, "
                                        f"reference {token} (gap {gap:.2e})")
                    break  # a numerical tie: the rest may diverge legitimately
                want = torch.log_softmax(logits.float(), -1).topk(5)
                assert list(tops[k].token_ids)[:1] == [token], k
                torch.testing.assert_close(torch.tensor(list(tops[k].logprobs)), want.values, atol=1e-3, rtol=0,
                                           msg=f"token {k}: top-5 logprobs")
                seq.append(token)


SAMPLING = [dict(temperature=1.0, seed=11), dict(temperature=1.0, top_k=20, seed=12),
            dict(temperature=1.0, top_p=0.8, seed=13), dict(temperature=1.0, top_k=50, top_p=0.9, seed=14),
            dict(temperature=1.3, min_p=0.1, seed=15)]


def test_seeded_sampling_reproducible_and_batch_independent(idle):
    n = 32
    prompt = PROMPTS[1]
    ars = []
    for i, s in enumerate(SAMPLING):
        ar = generate(idle.generation, gen_request(prompt, n, mode=pb.SPEC_MODE_AR, **s)).ids
        ars.append(ar)
        mode, budget = [(pb.SPEC_MODE_DDTREE, 16), (pb.SPEC_MODE_CHAIN, None)][i % 2]
        alone = [generate(idle.generation, gen_request(prompt, n, mode=mode, budget=budget, **s)).ids
                 for _ in range(2)]
        assert alone[0] == alone[1], f"{s} not reproducible: {first_difference(*alone)}"
        assert alone[0] == ar, f"{s} {pb.SpecMode.Name(mode)} vs AR: {first_difference(alone[0], ar)}"
    # The same seeded requests inside a batch of concurrent streams (other prompts, modes, seeds).
    batch = [gen_request(prompt, n, mode=pb.SPEC_MODE_DDTREE, budget=16, **s) for s in SAMPLING]
    batch += [gen_request(p, n, mode=m, budget=b, temperature=1.0, seed=99)
              for p, (m, b) in zip(PROMPTS, [(pb.SPEC_MODE_AR, None), (pb.SPEC_MODE_CHAIN, None),
                                             (pb.SPEC_MODE_DDTREE, 64), (pb.SPEC_MODE_DDTREE, 4),
                                             (pb.SPEC_MODE_DDTREE, 16)])]
    got = ok(generate_many(idle.generation, batch))
    for s, r, ar in zip(SAMPLING, got, ars):
        assert r.ids == ar, f"{s} in a batch: {first_difference(r.ids, ar)}"
    assert len({tuple(r.ids) for r in got[:len(SAMPLING)]}) == len(SAMPLING), "seeds must matter"
    no_min_p = {k: v for k, v in SAMPLING[-1].items() if k != "min_p"}  # min_p reaches the sampler
    assert generate(idle.generation, gen_request(prompt, n, mode=pb.SPEC_MODE_AR, **no_min_p)).ids != ars[-1]


PENALTIES = dict(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3)


def _penalized(req: pb.GenerateRequest, bias: dict[int, float]) -> pb.GenerateRequest:
    for name, value in PENALTIES.items():
        setattr(req.sampling, name, value)
    req.sampling.logit_bias.update(bias)
    return req


def test_penalties_lossless_and_equal_plain_decoding(idle, ar_refs, tiny_ckpt):
    """Bias and penalties: DDTree and chain give AR's tokens (greedy, and seeded sampling), and AR's greedy
    tokens are those of an in-process loop that recomputes the whole sequence every token and penalizes its
    last row with transformers' processor and plain loops (tests/sampling_reference.py)."""
    import torch
    from model_fixtures import load_model, new_cache, one_thread, prefill
    from sampling_reference import reference_penalize

    prompt, n = PROMPTS[2], 40
    bias = {ar_refs[2].ids[0]: -100.0, ar_refs[2].ids[3]: 2.5}  # ban the unpenalized first token
    ar = generate(idle.generation, _penalized(gen_request(prompt, n), bias)).ids
    assert ar != ar_refs[2].ids[:n] and ar[0] != ar_refs[2].ids[0], "the penalties must change the output"
    for mode, budget in ((pb.SPEC_MODE_DDTREE, 16), (pb.SPEC_MODE_DDTREE, 64), (pb.SPEC_MODE_CHAIN, None)):
        got = generate(idle.generation, _penalized(gen_request(prompt, n, mode=mode, budget=budget), bias)).ids
        assert got == ar, f"{pb.SpecMode.Name(mode)} {budget}: {first_difference(got, ar)}"
    sampled = [generate(idle.generation, _penalized(gen_request(prompt, n, mode=mode, budget=16, temperature=1.0,
                                                                top_p=0.9, seed=5), bias)).ids
               for mode in (pb.SPEC_MODE_AR, pb.SPEC_MODE_DDTREE)]
    assert sampled[0] == sampled[1], first_difference(*sampled)
    with one_thread():
        model = load_model(tiny_ckpt)
        seq, out = list(prompt), []
        for k in range(n):
            logits = reference_penalize(prefill(model, new_cache(model), "ref", seq).logits[-1], list(prompt), out,
                                        presence=0.4, frequency=0.3, repetition=1.3, bias=bias)
            top2 = torch.topk(logits, 2).values
            token = int(logits.argmax())
            if token != ar[k]:
                gap = float(top2[0] - top2[1])
                assert gap < 1e-4, f"token {k}: served {ar[k]}, reference {token} (gap {gap:.2e})"
                break  # a numerical tie: the rest may diverge legitimately
            seq.append(token)
            out.append(token)


def _recomputed_greedy(model, prompt: list[int], n: int, served: list[int]) -> None:
    """Checks `served` against a loop that re-runs the whole sequence through the model every token."""
    import torch
    from model_fixtures import new_cache, prefill

    seq = list(prompt)
    for k in range(n):
        logits = prefill(model, new_cache(model), "ref", seq).logits[-1]
        token = int(logits.argmax())
        if token != served[k]:
            top2 = torch.topk(logits, 2).values
            gap = float(top2[0] - top2[1])
            assert gap < 1e-4, f"token {k}: served {served[k]}, reference {token} (gap {gap:.2e})"
            return  # a numerical tie: the rest may diverge legitimately
        seq.append(token)


def test_prefix_cache_reuses_prompt_and_output_pages_losslessly(idle, tiny_ckpt):
    """A prompt served again, and a next turn (prompt + answer + new tokens): the repeats start from whole pages
    of the verifier's prefix cache (Usage.cached_prompt_tokens; pages of 16), and every output equals a loop
    in this process that recomputes the whole sequence every token (greedy), or the cold run (seeded)."""
    from model_fixtures import load_model, one_thread

    prompt, n = [(i * 71 + 3) % 1792 for i in range(50)], 16  # no other test's prompt shares its first page
    cold = generate(idle.generation, gen_request(prompt, n, mode=pb.SPEC_MODE_AR))
    assert cold.final.usage.cached_prompt_tokens == 0
    warm = [generate(idle.generation, gen_request(prompt, n, mode=m, budget=b))
            for m, b in ((pb.SPEC_MODE_DDTREE, 16), (pb.SPEC_MODE_AR, None))]
    assert [r.final.usage.cached_prompt_tokens for r in warm] == [48, 48]
    assert all(r.ids == cold.ids for r in warm), [first_difference(r.ids, cold.ids) for r in warm]
    turn = prompt + cold.ids + [5, 6, 7]  # the AR run committed 50 + 15 tokens: 4 whole pages
    nxt = generate(idle.generation, gen_request(turn, n, mode=pb.SPEC_MODE_DDTREE, budget=16))
    assert nxt.final.usage.cached_prompt_tokens == 64
    other = [(i * 89 + 1) % 1792 for i in range(40)]
    sampled = [generate(idle.generation, gen_request(other, n, mode=pb.SPEC_MODE_DDTREE, budget=16, temperature=1.0,
                                                     seed=8)) for _ in range(2)]
    assert [r.final.usage.cached_prompt_tokens for r in sampled] == [0, 32]
    assert sampled[0].ids == sampled[1].ids, first_difference(sampled[0].ids, sampled[1].ids)
    with one_thread():
        model = load_model(tiny_ckpt)
        _recomputed_greedy(model, prompt, n, cold.ids)
        _recomputed_greedy(model, turn, n, nxt.ids)


def test_prompt_logprobs_equal_the_models_prefill(idle, ar_refs, tiny_ckpt):
    """prompt_logprobs: each prompt token's log-probability (and top-3) from the served verifier, over 32-token
    prefill chunks, against one in-process prefill of the whole prompt; the prompt is prefilled again even when
    cached, and the generated tokens stay AR's."""
    import torch
    from model_fixtures import load_model, new_cache, one_thread, prefill

    prompt = PROMPTS[2]  # 45 tokens; ar_refs cached its first two pages
    req = gen_request(prompt, 8, mode=pb.SPEC_MODE_DDTREE, budget=16)
    req.prompt_logprobs, req.return_logprobs, req.top_logprobs = True, True, 3
    chunks = [m.chunk for m in idle.generation.Generate(req, timeout=60) if m.HasField("chunk")]
    final = generate(idle.generation, gen_request(prompt, 1)).final
    assert final.usage.cached_prompt_tokens == 32  # the cache serves other requests of this prompt
    got, tops = list(chunks[0].prompt_logprobs), list(chunks[0].prompt_top_logprobs)
    assert all(not c.prompt_logprobs for c in chunks[1:]) and len(got) == len(tops) == len(prompt) - 1
    assert [t for c in chunks for t in c.token_ids] == ar_refs[2].ids[:8]
    with one_thread():
        model = load_model(tiny_ckpt)
        lsm = torch.log_softmax(prefill(model, new_cache(model), "ref", prompt).logits.float(), -1)  # [45, V]
    want = lsm[:-1].gather(-1, torch.tensor(prompt[1:]).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(torch.tensor(got), want, atol=1e-4, rtol=0)
    best = lsm[:-1].topk(3, dim=-1)
    torch.testing.assert_close(torch.tensor([list(t.logprobs) for t in tops]), best.values, atol=1e-4, rtol=0)


def test_min_new_tokens_holds_back_stop_ids_losslessly(idle, ar_refs, tiny_ckpt):
    """A stop id the model emits at index 2 cannot end the output before min_new_tokens = 10: AR's tokens are a
    whole-sequence recompute's with that id banned for the first 10, and DDTree and chain give AR's."""
    import torch
    from model_fixtures import load_model, new_cache, one_thread, prefill

    prompt, n, stop = PROMPTS[2], 24, ar_refs[2].ids[2]

    def request(mode, budget=None):
        req = gen_request(prompt, n, mode=mode, budget=budget)
        req.stopping.stop_token_ids.append(stop)
        req.stopping.min_new_tokens = 10
        return req

    ar = generate(idle.generation, request(pb.SPEC_MODE_AR))
    assert stop not in ar.ids[:10] and len(ar.ids) >= 10
    for mode, budget in ((pb.SPEC_MODE_DDTREE, 16), (pb.SPEC_MODE_CHAIN, None)):
        got = generate(idle.generation, request(mode, budget)).ids
        assert got == ar.ids, f"{pb.SpecMode.Name(mode)}: {first_difference(got, ar.ids)}"
    with one_thread():
        model = load_model(tiny_ckpt)
        seq = list(prompt)
        for k, served in enumerate(ar.ids):
            logits = prefill(model, new_cache(model), "ref", seq).logits[-1].clone()
            if k < 10:
                logits[stop] = float("-inf")
            token = int(logits.argmax())
            top2 = torch.topk(logits, 2).values
            assert token == served or float(top2[0] - top2[1]) < 1e-4, f"token {k}: {served} vs {token}"
            if token != served:
                break
            seq.append(token)


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def _tool_chat(choice: str, thinking: bool, mode: int, budget: int | None = None, bias: dict | None = None):
    import json

    req = gen_request("", 24, mode=mode, budget=budget)
    req.ClearField("input")
    req.chat.messages.add(role="user", content="What is the weather in Paris?")
    req.chat.tools_json, req.chat.tool_choice, req.chat.thinking = json.dumps(WEATHER), choice, thinking
    req.sampling.logit_bias.update(bias or {})
    return req


@pytest.mark.parametrize("thinking", [False, True], ids=["instant", "thinking"])
def test_tool_choice_forces_the_call_losslessly(idle, tiny_ckpt, thinking):
    """tool_choice "get_weather" / "required": the answer (after </think>, which a bias makes the thinking model
    write first) starts with the call's opening tokens, and DDTree and chain give AR's tokens."""
    from gateway.tokenizer import KimiTokenizer

    tok = KimiTokenizer.from_dir(tiny_ckpt)
    marks = [tok.encode(m, allow_special=True)[0] for m in ("<|tool_calls_section_begin|>", "<|tool_call_begin|>",
                                                             "<|tool_call_argument_begin|>")]
    end = tok.encode("</think>", allow_special=True)[0]
    bias = {end: 100.0} if thinking else {}
    head = [end] if thinking else []
    named = head + marks[:2] + tok.encode("functions.get_weather:0") + marks[2:]
    for choice, want in (("get_weather", named), ("required", head + marks[:2])):
        ar = generate(idle.generation, _tool_chat(choice, thinking, pb.SPEC_MODE_AR, bias=bias)).ids
        assert ar[:len(want)] == want, (choice, ar[:len(want) + 2], want)
        for mode, budget in ((pb.SPEC_MODE_DDTREE, 16), (pb.SPEC_MODE_CHAIN, None)):
            got = generate(idle.generation, _tool_chat(choice, thinking, mode, budget, bias)).ids
            assert got == ar, f"{choice} {pb.SpecMode.Name(mode)}: {first_difference(got, ar)}"
    free = generate(idle.generation, _tool_chat("auto", thinking, pb.SPEC_MODE_AR, bias=bias)).ids
    assert free[:len(named)] != named


@pytest.mark.slow
def test_sixteen_concurrent_mixed_streams_equal_solo(idle):
    modes = [(pb.SPEC_MODE_AR, None), (pb.SPEC_MODE_CHAIN, None), (pb.SPEC_MODE_DDTREE, 1),
             (pb.SPEC_MODE_DDTREE, 4), (pb.SPEC_MODE_DDTREE, 16), (pb.SPEC_MODE_DDTREE, 64),
             (pb.SPEC_MODE_UNSPECIFIED, None)]
    reqs = []
    for i in range(16):
        mode, budget = modes[i % len(modes)]
        sampling = SAMPLING[i % len(SAMPLING)] if i % 3 == 0 else {}
        reqs.append(gen_request(PROMPTS[i % len(PROMPTS)], 12 + 2 * i, mode=mode, budget=budget, **sampling))
    solo = [generate(idle.generation, r).ids for r in reqs]
    for r in reqs:
        r.request_id += "-batched"
    got = ok(generate_many(idle.generation, reqs))
    for i, (r, s) in enumerate(zip(got, solo)):
        assert r.ids == s, f"stream {i} ({reqs[i].speculation}): {first_difference(r.ids, s)}"
        assert len(r.ids) == reqs[i].stopping.max_new_tokens


def _cancel_and_check_freed(stack, cancel) -> None:
    assert stack.verifier_info().pages_used == 0 and stack.drafter_info().sessions == 0
    stream = Streaming(stack.generation, gen_request(PROMPTS[2], 250, mode=pb.SPEC_MODE_DDTREE, budget=16))
    stream.wait_tokens(3)
    wait_until(lambda: stack.drafter_info().sessions == 1, 10, "the drafter to hold the session")
    assert stack.verifier_info().pages_used > 0
    t0 = time.monotonic()
    cancel(stream)
    wait_until(lambda: stack.verifier_info().pages_used == 0, 5, "KV pages freed after cancel", period=0.02)
    freed_s = time.monotonic() - t0
    wait_until(lambda: stack.drafter_info().sessions == 0, 5, "drafter session released after cancel")
    info = stack.verifier_info()
    assert info.live_sessions == 0 and all(d.sessions == 0 for d in info.drafters), info
    stream.join(10)
    assert len(stream.ids) < 250, "the stream finished before it was cancelled"
    assert freed_s < 2.0, f"pages freed {freed_s:.2f}s after the cancel"
    return stream


def test_client_cancel_frees_pages_and_drafter_session(idle):
    stream = _cancel_and_check_freed(idle, lambda s: s.call.cancel())
    assert stream.error is not None and stream.error.code() == grpc.StatusCode.CANCELLED


def test_verifier_cancel_rpc_ends_stream_cancelled(idle):
    def cancel(s):
        assert idle.verifier_stub.Cancel(vpb.CancelRequest(request_id=s.req.request_id), timeout=5).found
    stream = _cancel_and_check_freed(idle, cancel)
    assert stream.error is None and stream.final.finish_reason == pb.FINISH_REASON_CANCELLED
    assert not idle.verifier_stub.Cancel(vpb.CancelRequest(request_id=stream.req.request_id), timeout=5).found


def test_get_load_follows_a_stream(idle):
    """GetLoad: nothing in flight when idle; one request, one session and its KV pages while a stream runs (the
    verifier's own GetInfo is the reference for the pages)."""
    g = idle.generation
    quiet = g.GetLoad(pb.GetLoadRequest(), timeout=5)
    assert (quiet.running_requests, quiet.live_sessions, quiet.kv_pages_used) == (0, 0, 0)
    assert quiet.kv_pages_total == idle.verifier_info().pages_total > 0 and quiet.max_concurrent_requests == 64
    assert quiet.drafter_replicas == quiet.drafter_replicas_healthy == 1
    stream = Streaming(g, gen_request(PROMPTS[2], 250, mode=pb.SPEC_MODE_DDTREE, budget=16))
    stream.wait_tokens(3)
    busy = g.GetLoad(pb.GetLoadRequest(), timeout=5)
    stream.call.cancel()
    stream.join(10)
    assert (busy.running_requests, busy.live_sessions) == (1, 1) and busy.kv_pages_used > 0


def test_public_cancel_rpc_ends_stream_cancelled(idle):
    """The gateway's Cancel (for routers that hold ids, not streams): the stream ends CANCELLED, its pages and drafter
    session are freed, and only ids that were generating come back."""
    def cancel(s):
        r = idle.generation.Cancel(pb.CancelRequest(request_ids=["not-generating", s.req.request_id]), timeout=5)
        assert list(r.cancelled) == [s.req.request_id]
    stream = _cancel_and_check_freed(idle, cancel)
    assert stream.error is None and stream.final.finish_reason == pb.FINISH_REASON_CANCELLED
    assert not idle.generation.Cancel(pb.CancelRequest(request_ids=[stream.req.request_id]), timeout=5).cancelled
    for ids, field in (([], "request_ids"), (["a", ""], "request_ids[1]"), (["x" * 257], "request_ids[0]")):
        with pytest.raises(grpc.RpcError) as e:
            idle.generation.Cancel(pb.CancelRequest(request_ids=ids), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details(), e.value


def _bad(**changes):
    """A valid request with some fields changed; `input=None` clears the prompt."""
    def build(info):
        req = gen_request(PROMPTS[1], 4)
        for key, value in changes.items():
            if key == "input":
                req.ClearField("input") if value is None else value(req, info)
            elif key in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                         "repetition_penalty"):
                setattr(req.sampling, key, value)
            elif key == "logit_bias":
                req.sampling.logit_bias.update(value(info))
            elif key == "max_new_tokens":
                req.stopping.max_new_tokens = value(info) if callable(value) else value
            elif key in ("min_new_tokens", "max_duration_ms"):
                setattr(req.stopping, key, value)
            elif key == "labels":
                req.labels.update(value)
            elif key == "tree_budget":
                req.speculation.tree_budget = value(info) if callable(value) else value
            elif key == "top_logprobs":
                req.return_logprobs, req.top_logprobs = value
        return req
    return build


def _text(text):
    return lambda req, info: setattr(req, "text", text)


def _chat_tools(tools_json, tool_choice=""):
    def set_chat(req, info):
        req.chat.messages.add(role="user", content="hi")
        req.chat.tools_json, req.chat.tool_choice = tools_json, tool_choice
    return set_chat


def _ids(make):
    def set_ids(req, info):
        req.token_ids.SetInParent()
        del req.token_ids.ids[:]
        req.token_ids.ids.extend(make(info))
    return set_ids


BAD_INPUT = {
    "no input": (_bad(input=None), "input"),
    "empty text": (_bad(input=_text("")), "input"),
    "empty token ids": (_bad(input=_ids(lambda info: [])), "input"),
    "max_new_tokens 0": (_bad(max_new_tokens=0), "stopping.max_new_tokens"),
    "max_new_tokens -3": (_bad(max_new_tokens=-3), "stopping.max_new_tokens"),
    "max_new_tokens above limit": (_bad(max_new_tokens=lambda i: i.max_new_tokens_limit + 1),
                                   "stopping.max_new_tokens"),
    "temperature < 0": (_bad(temperature=-0.5), "sampling.temperature"),
    "temperature nan": (_bad(temperature=float("nan")), "sampling.temperature"),
    "top_p 0": (_bad(top_p=0.0), "sampling.top_p"),
    "top_p > 1": (_bad(top_p=1.5), "sampling.top_p"),
    "top_k < 0": (_bad(top_k=-1), "sampling.top_k"),
    "min_p > 1": (_bad(min_p=1.5), "sampling.min_p"),
    "min_p nan": (_bad(min_p=float("nan")), "sampling.min_p"),
    "presence_penalty 3": (_bad(presence_penalty=3.0), "sampling.presence_penalty"),
    "frequency_penalty nan": (_bad(frequency_penalty=float("nan")), "sampling.frequency_penalty"),
    "repetition_penalty 0": (_bad(repetition_penalty=0.0), "sampling.repetition_penalty"),
    "logit_bias token = vocab": (_bad(logit_bias=lambda i: {i.vocab_size: 1.0}), "sampling.logit_bias"),
    "logit_bias value 101": (_bad(logit_bias=lambda i: {3: 101.0}), "sampling.logit_bias[3]"),
    "token id = vocab": (_bad(input=_ids(lambda i: [5, i.vocab_size, 7])), "token_ids.ids[1]"),
    "token id < 0": (_bad(input=_ids(lambda i: [-2])), "token_ids.ids[0]"),
    "prompt fills the context": (_bad(input=_ids(lambda i: [9] * i.max_context_length)), "input"),
    "prompt beyond the context": (_bad(input=_ids(lambda i: [9] * (i.max_context_length + 10))), "input"),
    "tree_budget 0": (_bad(tree_budget=0), "speculation.tree_budget"),
    "tree_budget above limit": (_bad(tree_budget=lambda i: i.max_tree_budget + 1), "speculation.tree_budget"),
    "tools_json not JSON": (_bad(input=_chat_tools("[{")), "chat.tools_json"),
    "tools_json not a list": (_bad(input=_chat_tools('{"type": "function"}')), "chat.tools_json"),
    "top_logprobs 21": (_bad(top_logprobs=(True, 21)), "top_logprobs"),
    "top_logprobs -1": (_bad(top_logprobs=(True, -1)), "top_logprobs"),
    "top_logprobs without logprobs": (_bad(top_logprobs=(False, 3)), "top_logprobs"),
    "tool_choice of no tool": (_bad(input=_chat_tools('[{"type": "function", "function": {"name": "a"}}]', "b")),
                               "chat.tool_choice"),
    "tool_choice without tools": (_bad(input=_chat_tools("", "required")), "chat.tool_choice"),
    "min_new_tokens above max": (_bad(min_new_tokens=5), "stopping.min_new_tokens"),
    "max_duration_ms 0": (_bad(max_duration_ms=0), "stopping.max_duration_ms"),
    "17 labels": (_bad(labels={f"k{i}": "v" for i in range(17)}), "labels"),
    "label value too long": (_bad(labels={"k": "v" * 513}), "labels[k]"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_invalid_argument(idle, case):
    build, field = BAD_INPUT[case]
    info = idle.generation.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    with pytest.raises(grpc.RpcError) as e:
        generate(idle.generation, build(info), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert field in e.value.details(), f"field {field!r} not named in {e.value.details()!r}"
    assert len(generate(idle.generation, gen_request(PROMPTS[0], 3)).ids) == 3, "the stack stopped serving"


def test_oversized_message_is_rejected(idle):
    """The gateway runs with --max-message-mb 1: gRPC's own limit answers RESOURCE_EXHAUSTED."""
    with pytest.raises(grpc.RpcError) as e:
        generate(idle.generation, gen_request("x" * (3 << 19), 4), timeout=30)
    assert e.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT), e.value
    assert len(generate(idle.generation, gen_request(PROMPTS[0], 3)).ids) == 3, "the stack stopped serving"


def test_admission_limit_rejects_the_excess(idle):
    """A second gateway with --max-concurrent-requests 2 on the same verifier: while two streams run,
    further requests get RESOURCE_EXHAUSTED; the two finish; then it admits again."""
    gw = idle.add_gateway("--max-concurrent-requests", "2", name="gateway-admission")
    try:
        stub = pb_grpc.GenerationStub(idle.channel(gw.address))
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
        assert info.max_concurrent_requests == 2
        n = 250
        running = [Streaming(stub, gen_request(p, n, mode=pb.SPEC_MODE_AR)) for p in PROMPTS[:2]]
        for s in running:
            s.wait_tokens(2)
        rejected = generate_many(stub, [gen_request(p, 8) for p in PROMPTS[:4]])
        codes = [r.code() if isinstance(r, grpc.RpcError) else "OK" for r in rejected]
        assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 4, codes
        assert not any(s.done for s in running), "the admitted streams ended before the excess was tried"
        for s in running:
            r = s.result(60)
            assert len(r.ids) == n and r.final.finish_reason == pb.FINISH_REASON_LENGTH
        assert len(generate(stub, gen_request(PROMPTS[0], 3)).ids) == 3
    finally:
        gw.kill()


def _check_timing(t: pb.Timing) -> None:
    """The verifier's three phases are nested in the gateway's end-to-end time; the first token comes inside it."""
    assert t.queue_s >= 0 and t.prefill_s > 0 and t.decode_s >= 0, t
    assert 0 < t.ttft_s <= t.e2e_s and t.queue_s + t.prefill_s + t.decode_s <= t.e2e_s, t
    assert t.queue_s + t.prefill_s <= t.ttft_s, t  # the verifier's first token precedes the gateway's


def test_max_duration_ends_with_time_limit_and_keeps_the_output(idle, ar_refs):
    """max_duration_ms 1: the limit has passed by the first step that emits, so the generation ends there with
    FINISH_REASON_TIME_LIMIT (and an OK status); the tokens it kept are plain decoding's."""
    ref = ar_refs[0]
    req = gen_request(PROMPTS[0], N, mode=pb.SPEC_MODE_DDTREE, budget=16)
    req.stopping.max_duration_ms = 1
    r = generate(idle.generation, req)
    assert r.final.finish_reason == pb.FINISH_REASON_TIME_LIMIT
    assert 1 <= len(r.ids) < N and r.ids == ref.ids[:len(r.ids)] and r.final.usage.completion_tokens == len(r.ids)
    req.request_id += "-roomy"
    req.stopping.max_duration_ms = 600_000  # a limit that does not bind changes nothing
    r = generate(idle.generation, req)
    assert r.final.finish_reason == pb.FINISH_REASON_LENGTH and r.ids == ref.ids


def test_final_timing(idle):
    for mode in (pb.SPEC_MODE_AR, pb.SPEC_MODE_DDTREE):
        r = generate(idle.generation, gen_request(PROMPTS[1], 16, mode=mode, budget=16))
        _check_timing(r.final.timing)
        assert r.final.timing.decode_s > 0  # 16 tokens: several steps after the first


def test_stop_string_truncates_text_and_reports_stats(idle, ar_refs):
    """A stop string taken from the AR text: output is the AR text cut before its first occurrence,
    `matched_stop` names it, and the speculative stats come from the cancelled session."""
    ref = next(r for r in ar_refs if len(r.text) > 30)
    stop = ref.text[20:24]
    cut = ref.text.index(stop)
    req = gen_request(PROMPTS[ar_refs.index(ref)], N, mode=pb.SPEC_MODE_DDTREE, budget=16)
    req.stopping.stop.append(stop)
    r = generate(idle.generation, req)
    assert r.text == ref.text[:cut]
    assert r.final.finish_reason == pb.FINISH_REASON_STOP and r.final.matched_stop == stop
    assert r.final.spec_stats.verify_steps > 0 and r.final.spec_stats.mode == pb.SPEC_MODE_DDTREE
    _check_timing(r.final.timing)  # the stop path's final carries the cancelled session's timing too
    req.request_id += "-included"  # vLLM's include_stop_str_in_output: the text ends with the stop string
    req.stopping.include_stop_str_in_output = True
    r = generate(idle.generation, req)
    assert r.text == ref.text[:cut + len(stop)] and r.final.matched_stop == stop


def test_generate_unary_equals_the_stream_concatenated(idle):
    """GenerateUnary returns what Generate streams, field by field: greedy DDTree with logprobs and prompt
    logprobs (deterministic, so two calls must agree), and a chat answer with its thinking split off."""
    req = gen_request(PROMPTS[2], 24, mode=pb.SPEC_MODE_DDTREE, budget=16)
    req.return_logprobs, req.top_logprobs, req.prompt_logprobs = True, 2, True
    chat = pb.GenerateRequest(request_id="unary-chat", stopping=pb.StoppingCriteria(max_new_tokens=24))
    chat.chat.messages.add(role="user", content="Name three trees.")
    for r in (req, chat):
        msgs = list(idle.generation.Generate(r, timeout=60))
        r.request_id += "-unary"
        got = idle.generation.GenerateUnary(r, timeout=60)
        chunks = [m.chunk for m in msgs if m.HasField("chunk")]
        assert list(got.token_ids) == [t for c in chunks for t in c.token_ids] and len(got.token_ids) > 0
        assert got.text == "".join(c.text for c in chunks)
        assert got.reasoning_text == "".join(c.reasoning_text for c in chunks)
        for name in ("logprobs", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs", "tool_calls"):
            assert list(getattr(got, name)) == [x for c in chunks for x in getattr(c, name)], name
        final = msgs[-1].final
        assert (got.final.finish_reason, got.final.usage.completion_tokens) == \
            (final.finish_reason, final.usage.completion_tokens) == (pb.FINISH_REASON_LENGTH, 24)
    assert len(got.reasoning_text) + len(got.text) > 0  # the chat's answer, split as the stream splits it
    with pytest.raises(grpc.RpcError) as e:  # its errors are Generate's
        idle.generation.GenerateUnary(_bad(temperature=-0.5)(None), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.temperature" in e.value.details()


def test_detokenize_inverts_tokenize(idle):
    g = idle.generation
    text = "def main(argv):\n    return 0  # ünïcode ✓"
    ids = list(g.Tokenize(pb.TokenizeRequest(text=text), timeout=5).token_ids)
    assert g.Detokenize(pb.DetokenizeRequest(token_ids=ids), timeout=5).text == text
    chat = pb.TokenizeRequest()
    chat.chat.messages.add(role="user", content="hello there")
    ids = list(g.Tokenize(chat, timeout=5).token_ids)
    full = g.Detokenize(pb.DetokenizeRequest(token_ids=ids), timeout=5).text
    bare = g.Detokenize(pb.DetokenizeRequest(token_ids=ids, skip_special_tokens=True), timeout=5).text
    assert "<|im_user|>" in full and bare == re.sub(r"<\|[^|]*\|>|</?think>", "", full)  # chat markers dropped
    vocab = g.GetServerInfo(pb.GetServerInfoRequest(), timeout=5).vocab_size
    for bad, field in (([1, vocab], "token_ids[1]"), ([-1], "token_ids[0]")):
        with pytest.raises(grpc.RpcError) as e:
            g.Detokenize(pb.DetokenizeRequest(token_ids=bad), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
    assert g.Detokenize(pb.DetokenizeRequest(), timeout=5).text == ""
