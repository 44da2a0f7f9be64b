"""The thinking block split off a chat answer (gateway/reasoning.py, gateway/pipeline.OutputText) against a
brute-force reference: decode the whole id sequence once and cut it at the first </think>, for random ids
(multi-byte fragments included) in random chunkings."""

from __future__ import annotations

import random

import pytest

from ddtree.internal.v1 import verifier_pb2 as vpb
from gateway.pipeline import OutputText
from gateway.tokenizer import KimiTokenizer
from gateway.validation import Job


@pytest.fixture(scope="module")
def tok():
    return KimiTokenizer.from_dir("models/kimi-tiny")


def reference(tok, prompt: list[int], ids: list[int]) -> tuple[str, str, int]:
    """(reasoning text, answer text, reasoning tokens) from the whole output at once."""
    think = tok.think_tokens
    if not (prompt[-1] == think.start or (ids and ids[0] == think.start)):
        return "", tok.decode(ids, skip_special_tokens=True), 0
    end = ids.index(think.end) if think.end in ids else len(ids)
    return (tok.decode(ids[:end], skip_special_tokens=True), tok.decode(ids[end + 1:], skip_special_tokens=True),
            min(end + 1, len(ids)))


def run(tok, prompt: list[int], ids: list[int], rng: random.Random, stops: tuple[str, ...] = ()):
    out = OutputText(tok, Job(request=vpb.VerifierGenerateRequest(prompt_ids=prompt), stops=stops,
                              think=tok.think_tokens))
    thought, answer, i, matched = [], [], 0, None
    while i < len(ids) and matched is None:
        n = rng.randint(1, 6)
        r, a, _, matched = out.feed(ids[i:i + n])
        thought.append(r)
        answer.append(a)
        i += n
    if matched is None:
        r, a = out.flush()
        thought.append(r)
        answer.append(a)
    return "".join(thought), "".join(answer), out.reasoning_tokens, matched


@pytest.mark.parametrize("seed", range(40))
def test_split_equals_whole_decode(tok, seed):
    rng = random.Random(seed)
    think = tok.think_tokens
    words = [rng.randrange(256, 4000) for _ in range(rng.randint(0, 30))]  # bytes and merges, no specials
    if rng.random() < 0.7:
        words.insert(rng.randint(0, len(words)), think.end)
    if rng.random() < 0.2:
        words.insert(0, think.start)  # the model opens the block itself
    prompt_end = rng.choice([think.start, think.end, 17])  # thinking mode, instant mode, a plain prompt
    got = run(tok, [5, prompt_end], words, rng)
    assert got[:3] == reference(tok, [5, prompt_end], words)


def test_stop_strings_apply_to_the_answer_only(tok):
    think = tok.think_tokens
    thought, answer = tok.encode("alpha STOP beta"), tok.encode("gamma STOP delta")
    got = run(tok, [think.start], thought + [think.end] + answer, random.Random(0), stops=("STOP",))
    assert got == ("alpha STOP beta", "gamma ", len(thought) + 1, "STOP")


def test_without_think_tokens_nothing_is_split(tok):
    """Job.think is None for text and token-id input: thinking markers in the prompt change nothing."""
    ids = tok.encode("plain text")
    out = OutputText(tok, Job(request=vpb.VerifierGenerateRequest(prompt_ids=[tok.think_tokens.start]), stops=()))
    assert out.feed(ids)[:2] == ("", "plain text") and out.reasoning_tokens == 0
