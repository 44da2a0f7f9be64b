"""Kimi tokenizer, chat template, tiny tokenizer writer and BPE trainer, against independent references."""

import base64
import json
import random
import shutil
import time
from collections import Counter

import pytest

from gateway.tiny_tokenizer import KIMI_SPECIAL_NAMES, pretokenize, tiny_corpus, train_bpe, write_tiny_tokenizer
from gateway.tokenizer import KIMI_PAT_STR, KimiTokenizer

NUM_REGULAR = 1792


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_tok")
    info = write_tiny_tokenizer(out, num_regular=NUM_REGULAR, seed=0)
    return out, info


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return KimiTokenizer.from_dir(tiny_dir[0])


def read_ranks(path):
    """Independent parse of tiktoken.model."""
    ranks = {}
    for line in path.read_text().splitlines():
        b64, rank = line.split(" ")
        ranks[base64.b64decode(b64)] = int(rank)
    return ranks


def naive_bpe_encode(ranks, text):
    """Rank-ordered BPE per pre-tokenizer chunk, one merge at a time (what tiktoken does in Rust)."""
    ids = []
    for chunk in pretokenize(text):
        parts = [bytes([b]) for b in chunk.encode("utf-8")]
        while len(parts) > 1:
            scored = [(ranks.get(parts[i] + parts[i + 1], float("inf")), i) for i in range(len(parts) - 1)]
            best_rank, i = min(scored)
            if best_rank == float("inf"):
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        ids += [ranks[p] for p in parts]
    return ids


VARIED_TEXTS = [
    "Hello, world! It's a test: we'll see they're fine. I'M LOUD'S",
    "中文字符和English混合，还有标点。日本語のテキスト、カタカナ。한국어 텍스트",
    "emoji 🙂🚀 family 👨‍👩‍👧 flag 🇫🇷 skin 👍🏽 keycap 1️⃣",
    "def f(x):\n\treturn x ** 2  # comment\n\n\n    if a != b:\r\n        pass\n",
    "numbers 1 12 123 1234 12345 3.14159 -42 1e10 ½ ²",
    "combining e\u0301 a\u0308 \u0915\u094d\u0937 Ελληνικά Москва עברית العربية",
    "  leading and trailing spaces  \n\n  \t tabs\u00a0nbsp\u3000ideographic ",
    "control \x00\x01\x7f chars and <|im_end|> [EOS] <think> as plain text",
    "",
]


# `pat_str` of tokenization_kimi.py (K2, K2.5, K2.6), as published.
UPSTREAM_PAT_STR = (
    r"""[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def test_pattern_is_upstream():
    assert KIMI_PAT_STR == UPSTREAM_PAT_STR


def test_pretokenizer_splits_like_kimi():
    # Hand-derived from the K2 regex alternatives (Han run, cased word + contraction, 1-3 digits,
    # punctuation run, newline run, trailing-space rule).
    assert pretokenize("I'm fine") == ["I'm", " fine"]
    assert pretokenize("12345") == ["123", "45"]
    assert pretokenize("中文abc") == ["中文", "abc"]
    assert pretokenize("hello\n\nworld") == ["hello", "\n\n", "world"]
    assert pretokenize("a  b") == ["a", " ", " b"]
    assert pretokenize("x == y") == ["x", " ==", " y"]
    assert pretokenize("HTTPServer's camelCase") == ["HTTPServer's", " camel", "Case"]
    assert pretokenize("them.\n") == ["them", ".\n"]


@pytest.mark.parametrize("text", VARIED_TEXTS)
def test_encode_matches_naive_bpe_and_round_trips(tok, tiny_dir, text):
    ranks = read_ranks(tiny_dir[0] / "tiktoken.model")
    ids = tok.encode(text)
    assert ids == naive_bpe_encode(ranks, text)
    assert all(i < NUM_REGULAR for i in ids)
    assert tok.decode(ids) == text


def test_round_trip_random_unicode(tok):
    rng = random.Random(1)
    alphabet = [chr(c) for c in range(0x20, 0x3000) if not 0xD800 <= c < 0xE000] + ["🙂", "𝔘", "\n", " "]
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        assert tok.decode(tok.encode(text)) == text


def test_corpus_merges_are_used(tok):
    # A trained vocabulary compresses its own kind of text well below one token per byte.
    text = tiny_corpus(seed=7, num_paragraphs=50)
    assert len(tok.encode(text)) < 0.5 * len(text.encode("utf-8"))


def test_specials(tok, tiny_dir):
    info = tiny_dir[1]
    assert tok.vocab_size == info["vocab_size"] == NUM_REGULAR + 256
    assert (tok.bos_id, tok.eos_id, tok.im_end_id) == (info["bos_token_id"], info["eos_token_id"], info["im_end_id"])
    assert tok.specials["[UNK]"] == info["mask_token_id"] and tok.specials["[PAD]"] == info["pad_token_id"]
    assert tok.stop_ids == (NUM_REGULAR + 1, NUM_REGULAR + 2)
    for offset, name in KIMI_SPECIAL_NAMES.items():
        assert tok.encode(name, allow_special=True) == [NUM_REGULAR + offset]
        plain = tok.encode(name)
        assert all(i < NUM_REGULAR for i in plain) and tok.decode(plain) == name
    assert tok.id_to_token(NUM_REGULAR + 5) == f"<|reserved_token_{NUM_REGULAR + 5}|>"
    mixed = tok.encode("a<|im_user|>b[EOS]", allow_special=True)
    assert mixed[1] == NUM_REGULAR + 3 and mixed[-1] == NUM_REGULAR + 1
    assert tok.decode(mixed) == "a<|im_user|>b[EOS]"
    assert tok.decode(mixed, skip_special_tokens=True) == "ab"


# reference/k26.md §1.3, the real K2.6 ids (first special id 163584).
K26_SPECIAL_IDS = {
    "[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_user|>": 163587, "<|im_assistant|>": 163588,
    "<|start_header_id|>": 163590, "<|end_header_id|>": 163591, "[EOT]": 163593, "<|im_system|>": 163594,
    "<|tool_calls_section_begin|>": 163595, "<|tool_calls_section_end|>": 163596, "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598, "<|tool_call_end|>": 163599, "<|im_middle|>": 163601,
    "<|media_begin|>": 163602, "<|media_content|>": 163603, "<|media_end|>": 163604, "<|media_pad|>": 163605,
    "<think>": 163606, "</think>": 163607, "[UNK]": 163838, "[PAD]": 163839,
}


def test_special_offsets_match_k26(tok):
    for name, kimi_id in K26_SPECIAL_IDS.items():
        assert tok.specials[name] == NUM_REGULAR + kimi_id - 163584, name
    assert tok.specials[f"<|reserved_token_{NUM_REGULAR + 100}|>"] == NUM_REGULAR + 100


def test_token_lookups(tok):
    for i in [0, 32, 200, 255, 256, 1000, NUM_REGULAR - 1, NUM_REGULAR, NUM_REGULAR + 255]:
        assert tok.token_to_id(tok.id_to_token(i)) == i
    assert tok.id_to_token(ord(" ")) == "Ġ" and tok.id_to_token(ord("\n")) == "Ċ"
    assert tok.token_bytes(ord("A")) == b"A"
    assert tok.token_to_id("not a token at all, surely") is None
    with pytest.raises(ValueError):
        tok.token_bytes(tok.vocab_size)
    with pytest.raises(ValueError):
        tok.decode([-1])


TWO_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
    {"role": "user", "content": "2+2?"},
]


def test_chat_template_two_turns(tok):
    expected = ("<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
                "<|im_user|>user<|im_middle|>Hi<|im_end|>"
                "<|im_assistant|>assistant<|im_middle|><think></think>Hello!<|im_end|>"
                "<|im_user|>user<|im_middle|>2+2?<|im_end|>"
                "<|im_assistant|>assistant<|im_middle|><think>")
    assert tok.apply_chat_template(TWO_TURNS) == expected
    instant = tok.apply_chat_template(TWO_TURNS, thinking=False)
    assert instant == expected + "</think>"
    kept = tok.apply_chat_template(TWO_TURNS, preserve_thinking=True, add_generation_prompt=False)
    assert "<think>greet back</think>Hello!" in kept and kept.endswith("2+2?<|im_end|>")
    ids = tok.encode_chat(TWO_TURNS)
    assert ids[0] == tok.specials["<|im_system|>"] and ids[-1] == tok.specials["<think>"]
    assert tok.decode(ids) == expected


def test_chat_template_errors(tok):
    with pytest.raises(ValueError, match="unknown role"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])
    with pytest.raises(ValueError):
        tok.apply_chat_template([{"content": "no role"}])


def test_chat_template_inside_tokenizer_config(tiny_dir, tmp_path, tok):
    d = tmp_path / "k2"
    shutil.copytree(tiny_dir[0], d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (d / "chat_template.jinja").read_text()
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "chat_template.jinja").unlink()
    assert KimiTokenizer.from_dir(d).apply_chat_template(TWO_TURNS) == tok.apply_chat_template(TWO_TURNS)


def _naive_kimi_split(s, limit):
    """Char-by-char port of the seam rule in tokenization_kimi.py."""
    pieces, start, run, is_space = [], 0, 0, s[0].isspace() if s else False
    for i, ch in enumerate(s):
        if ch.isspace() != is_space:
            run, is_space = 1, ch.isspace()
        else:
            run += 1
            if run > limit:
                pieces.append(s[start:i])
                start, run = i, 1
    return pieces + [s[start:]]


def test_long_runs_are_cut_like_kimi(tok):
    text = "xy" + "the" * 20_000 + " " * 26_000 + "tail"  # the first cut lands inside a "the"
    pieces = _naive_kimi_split(text, 25_000)
    assert len(pieces) == 4
    expected = [i for p in pieces for i in tok.encode(p)]
    assert tok.encode(text) == expected
    assert tok._enc.encode_ordinary(text) != expected  # the seams matter, so the check can fail
    big = "t" + " the" * 125_001  # > 400k chars: cut into 400k-char blocks first, here mid-word
    assert tok.encode(big) == tok.encode(big[:400_000]) + tok.encode(big[400_000:])
    seam = big[399_990:400_010]
    assert tok.encode(seam) != tok.encode(seam[:10]) + tok.encode(seam[10:])


def _broken_copy(tiny_dir, tmp_path, edit):
    d = tmp_path / "broken"
    shutil.copytree(tiny_dir[0], d)
    edit(d)
    return d


def _set_config(d, **changes):
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.update(changes)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))


def _drop_rank(d):
    lines = (d / "tiktoken.model").read_text().splitlines()
    (d / "tiktoken.model").write_text("\n".join(lines[:300] + lines[301:]) + "\n")


def _bad_added_id(d):
    _set_config(d, added_tokens_decoder={"5000": {"content": "<|far|>", "special": True}})


@pytest.mark.parametrize("edit, message", [
    (lambda d: (d / "tiktoken.model").unlink(), r"tiktoken\.model"),
    (lambda d: (d / "tiktoken.model").write_text("AA== 0\n!!! not-base64\n"), r"tiktoken\.model:2"),
    (lambda d: (d / "tiktoken.model").write_text("AA== 0\nAQ== 1 extra\n"), r"tiktoken\.model:2"),
    (_drop_rank, r"tiktoken\.model: ranks must be exactly"),
    (lambda d: (d / "tokenizer_config.json").unlink(), r"tokenizer_config\.json"),
    (lambda d: (d / "tokenizer_config.json").write_text("{not json"), r"tokenizer_config\.json: invalid JSON"),
    (lambda d: _set_config(d, eos_token="<|nope|>"), r"tokenizer_config\.json.*<\|nope\|>"),
    (_bad_added_id, r"tokenizer_config\.json.*outside the reserved range"),
    (lambda d: (d / "chat_template.jinja").write_text("{% if %}"), r"chat_template\.jinja: invalid chat template"),
])
def test_loading_errors_name_the_file(tiny_dir, tmp_path, edit, message):
    d = _broken_copy(tiny_dir, tmp_path, edit)
    with pytest.raises(ValueError, match=message):
        KimiTokenizer.from_dir(d)


def test_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        KimiTokenizer.from_dir(tmp_path / "nope")


def _naive_merge(word, pair):
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def naive_train_bpe(chunks, num_merges):
    """Recount every pair from scratch at every step; same tie-break and duplicate rule as the spec."""
    words = Counter(tuple(bytes([b]) for b in c) for c in chunks)
    vocab, out = {bytes([b]) for b in range(256)}, []
    while len(out) < num_merges:
        pairs = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if best[0] + best[1] not in vocab:
            vocab.add(best[0] + best[1])
            out.append(best[0] + best[1])
        merged = Counter()
        for word, count in words.items():
            merged[_naive_merge(word, best)] += count
        words = merged
    return out


@pytest.mark.parametrize("seed", range(6))
def test_train_bpe_matches_brute_force_on_small_alphabet(seed):
    # Three letters make ties and a|bc-after-ab|c duplicate concatenations common.
    rng = random.Random(seed)
    chunks = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 9))).encode() for _ in range(60)]
    total_pairs = sum(len(c) - 1 for c in chunks)
    num_merges = min(40, total_pairs // 4)
    assert train_bpe(chunks, num_merges) == naive_train_bpe(chunks, num_merges)


def test_train_bpe_matches_brute_force_on_text():
    text = tiny_corpus(seed=3, num_paragraphs=15) + " aaaa aaa aa abab bcbc 中文中文 🙂🙂"
    chunks = [c.encode() for c in pretokenize(text)]
    got = train_bpe(chunks, 150)
    assert got == naive_train_bpe(chunks, 150)
    assert len(set(got)) == 150 and all(len(t) >= 2 for t in got)
    assert train_bpe(Counter(chunks), 150) == got  # counts mapping == repeated chunks


def test_train_bpe_runs_out_of_pairs():
    with pytest.raises(ValueError, match="corpus too small"):
        train_bpe([b"ab", b"ab"], 5)


def test_tiny_tokenizer_is_deterministic_and_fast(tiny_dir, tmp_path):
    start = time.perf_counter()
    info = write_tiny_tokenizer(tmp_path, num_regular=NUM_REGULAR, seed=0)
    assert time.perf_counter() - start < 5.0
    assert info == tiny_dir[1]
    for name in ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / name).read_bytes() == (tiny_dir[0] / name).read_bytes()
    other = write_tiny_tokenizer(tmp_path / "s1", num_regular=512, seed=1)
    assert other["vocab_size"] == 768 and other["mask_token_id"] == 512 + 254
    assert len((tmp_path / "s1" / "tiktoken.model").read_text().splitlines()) == 512
