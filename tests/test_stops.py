"""Streaming stop-string matching against a brute-force scan of the whole text."""

import random

import pytest

from gateway.stops import StopMatcher


def reference(text, stops):
    """Scan end positions left to right; the first end where a stop is complete wins (longest on ties)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return text[:end - len(stop)], stop
    return text, None


def run_stream(chunks, stops, include_stop=False):
    matcher = StopMatcher(stops, include_stop=include_stop)
    out = []
    for chunk in chunks:
        emitted, matched = matcher.feed(chunk)
        out.append(emitted)
        if matched is not None:
            assert matcher.feed("more text") == ("", None)  # finished: nothing after the match
            return "".join(out), matched
    return "".join(out) + matcher.flush(), None


def random_chunking(text, rng):
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 8))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]  # includes empty chunks


def test_streaming_equals_brute_force():
    rng = random.Random(0)
    for _ in range(3000):
        alphabet = rng.choice(["ab", "abc", "ab ", "a€🙂"])
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 25)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 4))]
        assert run_stream(random_chunking(text, rng), stops) == reference(text, stops), (text, stops)


def test_held_text_is_only_a_possible_stop_prefix():
    matcher = StopMatcher(["<end>", "STOP"])
    assert matcher.feed("hello <e") == ("hello ", None)
    assert matcher.held == "<e"
    assert matcher.feed("x ST") == ("<ex ", None)
    assert matcher.held == "ST"
    assert matcher.flush() == "ST"


def test_stop_spanning_chunks():
    assert run_stream(["answer: 4</", "s", ">ignored"], ["</s>"]) == ("answer: 4", "</s>")
    assert run_stream(["a", "b", "c", "d"], ["bcd"]) == ("a", "bcd")


def test_overlapping_stops():
    # "bc" completes before "abcd" could: generation stops at the first completed stop.
    assert run_stream(["xxabcd"], ["abcd", "bc"]) == ("xxa", "bc")
    assert run_stream(["xxab", "cd"], ["abcd", "bc"]) == ("xxa", "bc")
    # Same end: the longer (earlier-starting) stop is reported.
    assert run_stream(["xab"], ["b", "ab"]) == ("x", "ab")
    # Self-overlapping stop: "aab" inside "aaab" after one-char chunks.
    assert run_stream(list("aaab"), ["aab"]) == ("a", "aab")


def test_include_stop_and_no_stops():
    assert run_stream(["say END now"], ["END"], include_stop=True) == ("say END", "END")
    assert run_stream(["pass ", "through"], []) == ("pass through", None)


def test_empty_stop_rejected():
    with pytest.raises(ValueError):
        StopMatcher(["ok", ""])
