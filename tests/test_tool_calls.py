"""Kimi tool calls parsed out of a chat answer (gateway/tool_calls.py through gateway/pipeline.OutputText)
against a reference that cuts the sections out by slicing the id list and reads the calls from the decoded
section text with a regular expression; random answers, calls and chunkings."""

from __future__ import annotations

import json
import random
import re

import pytest

from ddtree.internal.v1 import verifier_pb2 as vpb
from gateway.pipeline import OutputText
from gateway.tokenizer import KimiTokenizer
from gateway.tool_calls import function_name
from gateway.validation import Job

CALL = re.compile(r"<\|tool_call_begin\|>(.*?)<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.S)


@pytest.fixture(scope="module")
def tok():
    return KimiTokenizer.from_dir("models/kimi-tiny")


def reference(tok, ids: list[int]) -> tuple[str, list[tuple[str, str, str]]]:
    t = tok.tool_call_tokens
    text, calls, i = [], [], 0
    while i < len(ids):
        if ids[i] != t.section_begin:
            text.append(ids[i])
            i += 1
            continue
        end = ids.index(t.section_end, i) if t.section_end in ids[i:] else len(ids)
        for m in CALL.finditer(tok.decode(ids[i + 1:end])):
            calls.append((m[1].strip(), function_name(m[1].strip()), m[2].strip()))
        i = end + 1
    return tok.decode(text, skip_special_tokens=True), calls


def random_answer(tok, rng: random.Random) -> list[int]:
    t = tok.tool_call_tokens
    words = lambda n: [rng.randrange(256, 4000) for _ in range(n)]  # noqa: E731
    ids = words(rng.randint(0, 12))
    for _ in range(rng.randint(0, 2)):
        ids.append(t.section_begin)
        for k in range(rng.randint(0, 3)):
            name = rng.choice(["get_weather", "search", "a:b"])
            args = json.dumps({"city": rng.choice(["Paris", "東京", "Zürich"]), "n": rng.randint(0, 9)})
            ids += [t.call_begin, *tok.encode(f"functions.{name}:{k}"), t.argument_begin, *tok.encode(args),
                    t.call_end, *tok.encode("\n") * rng.randint(0, 1)]
        ids.append(t.section_end)
        ids += words(rng.randint(0, 5))
    return ids[:rng.randint(len(ids) // 2, len(ids))] if rng.random() < 0.3 else ids  # sometimes cut short


def run(tok, ids: list[int], rng: random.Random):
    out = OutputText(tok, Job(request=vpb.VerifierGenerateRequest(prompt_ids=[5]), stops=(),
                              tools=tok.tool_call_tokens))
    text, calls, i = [], [], 0
    while i < len(ids):
        n = rng.randint(1, 7)
        _, a, c, _ = out.feed(ids[i:i + n])
        text.append(a)
        calls += [(x.id, x.name, x.arguments) for x in c]
        i += n
    text.append(out.flush()[1])
    return "".join(text), calls


@pytest.mark.parametrize("seed", range(60))
def test_calls_and_text_equal_the_reference(tok, seed):
    rng = random.Random(seed)
    ids = random_answer(tok, rng)
    assert run(tok, ids, rng) == reference(tok, ids)


def test_a_weather_call(tok):
    t = tok.tool_call_tokens
    ids = [*tok.encode("Let me check."), t.section_begin, t.call_begin, *tok.encode("functions.get_weather:0"),
           t.argument_begin, *tok.encode('{"city": "Paris"}'), t.call_end, t.section_end]
    assert run(tok, ids, random.Random(0)) == ("Let me check.",
                                               [("functions.get_weather:0", "get_weather", '{"city": "Paris"}')])


@pytest.mark.parametrize("call_id, name", [("functions.get_weather:0", "get_weather"), ("functions.a:b:12", "a:b"),
                                           ("lookup", "lookup"), ("functions.x:y", "x:y")])
def test_function_name(call_id, name):
    assert function_name(call_id) == name
