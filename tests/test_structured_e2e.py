"""Structured output end to end (drafter, verifier and gateway processes; the random tiny model): the answer matches
its format, AR equals an in-process constrained recompute (regex oracle), DDTree and chain equal AR greedy and
seeded, in thinking mode the format starts after </think>, and bad formats are INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import json

import grpc
import pytest
import regex
from stack import PROMPTS, first_difference, gen_request, generate, new_stack, pb, tiny_ckpt, vpb  # noqa: F401

MODES = ((pb.SPEC_MODE_DDTREE, 16), (pb.SPEC_MODE_CHAIN, None))
PATTERN = r"[yn]( [0-9]{1,3})?,[rgb]{1,4}!"  # ASCII, no `.`, no forced runs: see tests/test_structured.py
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "count": {"type": "integer",
          "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}}, "required": ["answer", "count", "ok"],
          "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}  # compact: the random model
# would fill every allowed whitespace gap


@pytest.fixture(scope="module")
def stack(request, tiny_ckpt, tmp_path_factory):
    with new_stack(request, tiny_ckpt, tmp_path_factory) as st:
        st.add_drafter(wait=False)
        st.add_verifier(wait=False)
        st.add_gateway()
        yield st


@pytest.fixture
def idle(stack):
    yield stack
    info = stack.verifier_info()
    assert info.pages_used == 0 and info.live_sessions == 0, info


def request(prompt, mode=pb.SPEC_MODE_AR, budget=None, n=48, **fmt):
    req = gen_request(prompt, n, mode=mode, budget=budget, ignore_eos=False)
    for name, value in fmt.items():
        if name in ("temperature", "seed", "top_p"):
            setattr(req.sampling, name, value)
        else:
            setattr(req.response_format, name, value)
    return req


def check_modes(stack, make, label):
    """DDTree and chain give AR's tokens."""
    ar = generate(stack.generation, make(pb.SPEC_MODE_AR, None))
    for mode, budget in MODES:
        got = generate(stack.generation, make(mode, budget))
        assert got.ids == ar.ids, f"{label} {pb.SpecMode.Name(mode)}: {first_difference(got.ids, ar.ids)}"
        assert got.final.spec_stats.draft_tokens > 0
    return ar


def test_regex_answer_equals_constrained_recompute(idle, tiny_ckpt):
    """Greedy AR against a loop in this process that re-runs the whole sequence every token and takes the argmax
    over the ids the `regex` module's partial match allows; the answer is a full match, ended by EOS."""
    import torch
    from model_fixtures import load_model, new_cache, one_thread, prefill

    from gateway.tokenizer import KimiTokenizer

    tok = KimiTokenizer.from_dir(tiny_ckpt)
    for prompt in (PROMPTS[1], PROMPTS[3]):
        ar = check_modes(idle, lambda m, b: request(prompt, m, b, regex=PATTERN), "regex")
        assert regex.fullmatch(PATTERN, ar.text), ar.text
        assert ar.final.finish_reason == pb.FINISH_REASON_EOS, ar.final
        with one_thread():
            model = load_model(tiny_ckpt)
            seq = list(prompt) if isinstance(prompt, list) else tok.encode(prompt)
            out = []
            for served in ar.ids + [tok.stop_ids[0]]:
                logits = prefill(model, new_cache(model), "ref", seq + out).logits[-1]
                text = b"".join(tok.token_bytes(t) for t in out).decode("latin-1")
                allowed = [t for t in range(tok.num_regular)
                           if regex.fullmatch(PATTERN, text + tok.token_bytes(t).decode("latin-1"), partial=True)]
                allowed += list(tok.stop_ids) if regex.fullmatch(PATTERN, text) else []
                mask = torch.full_like(logits, float("-inf"))
                mask[allowed] = 0
                token = int((logits + mask).argmax())
                assert token == served or token in tok.stop_ids and served in tok.stop_ids, (len(out), token, served)
                out.append(token)


def test_json_schema_lossless_greedy_and_seeded(idle):
    for i, sampling in enumerate(({}, dict(temperature=1.0, seed=5), dict(temperature=0.8, top_p=0.9, seed=6))):
        prompt = PROMPTS[2 + i % 3]
        ar = check_modes(idle, lambda m, b: request(prompt, m, b, n=64, json_schema=json.dumps(SCHEMA), **sampling),
                         f"json {sampling}")
        answer = json.loads(ar.text)
        assert set(answer) == {"answer", "count", "ok"} and answer["answer"] in ("yes", "no"), answer
        assert type(answer["count"]) is int and 0 <= answer["count"] <= 99 and type(answer["ok"]) is bool, answer
        assert ar.final.finish_reason == pb.FINISH_REASON_EOS


def test_json_object_after_the_thinking_block(idle, tiny_ckpt):
    """Thinking mode: a bias makes the model close its thinking block first; the JSON starts after </think>."""
    from gateway.tokenizer import KimiTokenizer

    end = KimiTokenizer.from_dir(tiny_ckpt).specials["</think>"]

    def chat(mode, budget):
        req = request("", mode, budget, n=40, json_object=True)
        req.ClearField("input")
        req.chat.messages.add(role="user", content="Give me a JSON object.")
        req.chat.thinking = True
        req.sampling.logit_bias[end] = 100.0
        return req

    ar = check_modes(idle, chat, "thinking")
    assert ar.ids[0] == end and ar.text.lstrip().startswith("{"), (ar.ids[:4], ar.text[:40])
    free = request("", n=40)  # the same chat without the format: no JSON
    free.CopyFrom(chat(pb.SPEC_MODE_AR, None))
    free.ClearField("response_format")
    assert not generate(idle.generation, free).text.lstrip().startswith("{")


BAD = {
    "schema not JSON": (dict(json_schema="{"), "response_format.json_schema"),
    "schema not an object": (dict(json_schema="[1]"), "response_format.json_schema"),
    "schema of an unknown type": (dict(json_schema='{"type": "strang"}'), "response_format.json_schema"),
    "regex unclosed": (dict(regex="(a|b"), "response_format.regex"),
    "lark unknown rule": (dict(lark="start: foo"), "response_format.lark"),
    "empty regex": (dict(regex=""), "response_format.regex"),
    "with min_new_tokens": (dict(regex="a+", min_new_tokens=2), "stopping.min_new_tokens"),
    "with ignore_eos": (dict(regex="a+", ignore_eos=True), "stopping.ignore_eos"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_format_is_invalid_argument(idle, case):
    fields, field = BAD[case]
    fields = dict(fields)
    req = request(PROMPTS[0], n=4, **{k: v for k, v in fields.items() if k in ("json_schema", "regex", "lark")})
    if "min_new_tokens" in fields:
        req.stopping.min_new_tokens = fields["min_new_tokens"]
    req.stopping.ignore_eos = fields.get("ignore_eos", False)
    with pytest.raises(grpc.RpcError) as e:
        generate(idle.generation, req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert field in e.value.details(), f"field {field!r} not named in {e.value.details()!r}"
    assert len(generate(idle.generation, gen_request(PROMPTS[0], 3)).ids) == 3, "the stack stopped serving"


def test_verifier_refuses_bad_grammars_on_its_own(idle):
    """The internal API checks what it is given too: a malformed grammar, or one with forced ids."""
    import llguidance

    ok_grammar = llguidance.LLMatcher.grammar_from_regex("a+")
    for fields, field in ((dict(grammar="{not a grammar"), "grammar"),
                          (dict(grammar=ok_grammar, forced_ids=[5]), "forced_ids"),
                          (dict(grammar=ok_grammar, grammar_after_id=-1), "grammar_after_id")):
        req = vpb.VerifierGenerateRequest(request_id="bad-grammar", prompt_ids=[5, 6], max_new_tokens=4, **fields)
        with pytest.raises(grpc.RpcError) as e:
            list(idle.verifier_stub.Generate(req, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details(), e.value
    req = vpb.VerifierGenerateRequest(request_id="good-grammar", prompt_ids=[5, 6], max_new_tokens=8,
                                      grammar=ok_grammar)
    out = [t for m in idle.verifier_stub.Generate(req, timeout=30) if m.HasField("chunk") for t in m.chunk.token_ids]
    assert out and len(out) <= 8
