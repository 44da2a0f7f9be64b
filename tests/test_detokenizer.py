"""Incremental detokenizer against one-shot decoding and a strict-UTF-8 prefix reference."""

import random

import pytest

from gateway.detokenizer import IncrementalDetokenizer
from gateway.tiny_tokenizer import write_tiny_tokenizer
from gateway.tokenizer import KimiTokenizer

NUM_REGULAR = 1024


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_tok")
    write_tiny_tokenizer(out, num_regular=NUM_REGULAR, seed=0)
    return KimiTokenizer.from_dir(out)


def random_chunks(ids, rng, max_chunk=6):
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(0, max_chunk)  # empty feeds happen too (a step may emit only skipped ids)
        chunks.append(ids[i:i + n])
        i += n
    return chunks


def stream(tok, chunks, skip):
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas = [detok.feed(c) for c in chunks]
    return deltas, detok.flush()


def longest_complete_prefix(data: bytes) -> str:
    """Reference for valid UTF-8 streams: drop an incomplete trailing character, decode strictly."""
    for cut in range(0, 4):
        try:
            return data[:len(data) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    raise AssertionError("not a valid UTF-8 prefix")


TEXTS = [
    "中文字符串和日本語のテキスト、한국어도 있어요。",
    "emoji 🙂🚀👨‍👩‍👧🇫🇷👍🏽 and math ∑≤½ and “quotes” — done…",
    "plain ascii code: def f(x):\n    return x + 1\n",
    "Ελληνικά Москва café naïve Größe e\u0301",
]


@pytest.mark.parametrize("text", TEXTS)
def test_text_streams_emit_complete_characters_as_soon_as_possible(tok, text):
    ids = tok.encode(text)
    # The vocabulary must actually cut characters for this test to mean anything.
    assert any(not _is_utf8(tok.token_bytes(i)) for i in ids) or text.isascii()
    rng = random.Random(0)
    for _ in range(20):
        detok = IncrementalDetokenizer(tok)
        emitted, fed = "", []
        for chunk in random_chunks(ids, rng):
            fed += chunk
            delta = detok.feed(chunk)
            assert "\ufffd" not in delta
            emitted += delta
            assert emitted == longest_complete_prefix(b"".join(tok.token_bytes(i) for i in fed))
        assert emitted + detok.flush() == text


def _is_utf8(data):
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_match_full_decode_for_any_chunking(tok, skip):
    rng = random.Random(1)
    # Bias towards lone bytes 0x80-0xFF (continuation/lead bytes) and specials: the hard cases.
    pool = list(range(tok.vocab_size)) + list(range(0x80, 0x100)) * 4 + list(range(NUM_REGULAR, NUM_REGULAR + 24)) * 4
    for _ in range(300):
        ids = [rng.choice(pool) for _ in range(rng.randint(0, 30))]
        full = tok.decode(ids, skip_special_tokens=skip)
        for _ in range(3):  # several chunkings of the same ids, each must give the full decode
            deltas, tail = stream(tok, random_chunks(ids, rng), skip)
            assert "".join(deltas) + tail == full
            pos = 0
            for delta in deltas + [tail]:
                for j, ch in enumerate(delta):
                    if ch == "\ufffd":  # a replacement only where the full decode has one
                        assert full[pos + j] == "\ufffd"
                pos += len(delta)
        whole, tail = stream(tok, [ids], skip)
        assert "".join(whole) + tail == full


def test_specials_inside_a_character(tok):
    zhong = "中".encode("utf-8")  # 3 bytes, fed as three single-byte tokens around special ids
    ids = [zhong[0], tok.im_end_id, zhong[1], tok.bos_id, zhong[2], ord("!")]
    assert stream(tok, [[i] for i in ids], skip=True) == (["", "", "", "", "中", "!"], "")
    deltas, tail = stream(tok, [[i] for i in ids], skip=False)
    assert "".join(deltas) + tail == tok.decode(ids) == "\ufffd<|im_end|>\ufffd[BOS]\ufffd!"


def test_incomplete_tail_is_replaced_only_at_flush(tok):
    emoji = "🙂".encode("utf-8")
    detok = IncrementalDetokenizer(tok)
    assert detok.feed([ord("a"), emoji[0], emoji[1]]) == "a"
    assert detok.flush() == "\ufffd" == tok.decode([emoji[0], emoji[1]])
    assert detok.num_tokens == 3


def test_bad_ids_raise(tok):
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tok).feed([tok.vocab_size])
