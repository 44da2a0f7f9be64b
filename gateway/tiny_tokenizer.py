"""A tiny Kimi-format tokenizer for `ddtree make-tiny`, and the byte-level BPE trainer behind it.

The tiny tokenizer has the real one's layout (reference/k26.md §1.3) at a small size: `num_regular`
byte-level BPE ranks (256 single bytes, then merges), then 256 reserved special ids named exactly like
Kimi's at the same offsets, a tokenizer_config.json and a Kimi-style chat_template.jinja. Training is
deterministic everywhere: the corpus is generated from `seed` and text shipped here, never read from disk.
"""

from __future__ import annotations

import base64
import heapq
import json
import random
from collections import Counter
from pathlib import Path
from typing import Iterable, Mapping

import regex

from gateway.chat import KIMI_STYLE_CHAT_TEMPLATE
from gateway.tokenizer import KIMI_PAT_STR, NUM_RESERVED_SPECIAL_TOKENS

# Named reserved tokens by offset from the first special id (Kimi: 163584 + offset).
KIMI_SPECIAL_NAMES = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
    6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>",
    18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>",
    22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]",
}

# The same regex tiktoken runs in Rust; the `regex` module needs V1 for the `&&` class intersections.
_PRETOKENIZER = regex.compile(KIMI_PAT_STR, flags=regex.V1)


def pretokenize(text: str) -> list[str]:
    """Split text into the chunks BPE works within (merges never cross a chunk boundary)."""
    return _PRETOKENIZER.findall(text)


def train_bpe(chunks: Iterable[bytes] | Mapping[bytes, int], num_merges: int) -> list[bytes]:
    """Byte-level BPE: returns `num_merges` new tokens in rank order (ranks 256, 257, ...).

    Each step merges the most frequent adjacent pair of symbols over all chunks (weighted by chunk count),
    ties broken by the smaller (left bytes, right bytes). Should a pair's concatenation already be a token
    (reached through another split), the pair is merged in the data but adds no token: tiktoken needs
    unique token bytes. Pair counts are updated incrementally: a step touches only the chunks that
    contain the pair.
    """
    counts = chunks if isinstance(chunks, Mapping) else Counter(chunks)
    words = [[bytes([b]) for b in chunk] for chunk in counts]
    weights = list(counts.values())
    pair_count: Counter[tuple[bytes, bytes]] = Counter()
    where: dict[tuple[bytes, bytes], set[int]] = {}
    for w, word in enumerate(words):
        for pair in zip(word, word[1:]):
            pair_count[pair] += weights[w]
            where.setdefault(pair, set()).add(w)
    heap = [(-c, a, b) for (a, b), c in pair_count.items()]
    heapq.heapify(heap)
    vocab = {bytes([b]) for b in range(256)}
    new_tokens: list[bytes] = []
    while len(new_tokens) < num_merges:
        if not heap:
            raise ValueError(f"corpus too small: no pairs left after {len(new_tokens)} of {num_merges} merges")
        neg, a, b = heapq.heappop(heap)
        if pair_count.get((a, b), 0) != -neg or neg == 0:
            continue  # stale heap entry: the count changed after it was pushed
        if a + b not in vocab:
            vocab.add(a + b)
            new_tokens.append(a + b)
        changed = _merge_pair(words, weights, (a, b), where, pair_count)
        for pair in changed:
            if pair_count.get(pair, 0) > 0:
                heapq.heappush(heap, (-pair_count[pair], *pair))
    return new_tokens


def _merge_pair(words: list[list[bytes]], weights: list[int], pair: tuple[bytes, bytes],
                where: dict[tuple[bytes, bytes], set[int]], pair_count: Counter) -> set[tuple[bytes, bytes]]:
    """Merge `pair` left to right in every chunk that has it; returns the pairs whose counts changed."""
    a, b = pair
    changed = set()
    for w in where.pop(pair, ()):
        word, weight = words[w], weights[w]
        for old in zip(word, word[1:]):
            pair_count[old] -= weight
            changed.add(old)
        merged, i = [], 0
        while i < len(word):
            if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                merged.append(a + b)
                i += 2
            else:
                merged.append(word[i])
                i += 1
        words[w] = merged
        for new in zip(merged, merged[1:]):
            pair_count[new] += weight
            changed.add(new)
            where.setdefault(new, set()).add(w)
    pair_count.pop(pair, None)
    return changed


# Shipped corpus material: common English words, Python-ish identifiers, and a few scripts beyond ASCII so
# the vocabulary has multi-byte merges (CJK, accents, emoji) that split characters across tokens.
_WORDS = """the of and to in is that for it as was with be by on not he this are or his from at which but
have an they you were her she there been one all we their has would when if so no will more can out up
about into than them some could its time only new two may first then do any like my now over such our
man me even most made after also did many before must through back years where much your way well down
should because each just those people how too little state good very make world still own see men work
long get here between both life being under never day same another know while last might us great old
year off come since against go came right used take three model token tree draft verify accept server
stream request batch cache layer expert router sample logits prompt reply text value error result
return def class import from self none true false yield lambda assert raise try except finally while
print range len list dict str int float print append items keys values open read write path json""".split()
_HAN = (
    "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动"
    "同工也能下过子说产种面而方后多定行学法所民得经十三之进着等部度家电力里如水化高自"
    "二理起小物现实加量都两体制机当使点从业本去把性好应开它合还因由其些然前外天政四日"
    "那社义事平形相全表间样与关各重新线内数正心反你明看原又么利比或但质气第向道命此变"
    "条只没结解问意建月公无系军很情者最立代想已通并提直题党程展五果料象员革位入常文总"
    "次品式活设及管特件长求老头基资边流路级少图山统接知较将组见计别她手角期根论运农指"
    "几九区强放决西被干做必战先回则任取据处理"
)
_OTHER = ["café", "naïve", "Größe", "über", "señor", "Ελλάδα", "Москва", "こんにちは", "カタカナ",
          "한국어", "🙂", "🚀", "👍🏽", "🇫🇷", "→", "≤", "∑", "½", "€", "—", "…", "“quoted”"]
_PUNCT = [".", ",", ";", ":", "!", "?", " -", " (", ")", " \"", "\"", "'"]


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
    words[0] = words[0].capitalize()
    for i in range(1, len(words)):
        roll = rng.random()
        if roll < 0.05:
            words[i] = str(rng.randint(0, 99999))
        elif roll < 0.10:
            words[i] = rng.choice(_OTHER)
        elif roll < 0.13:
            words[i] = "".join(rng.choice(_HAN) for _ in range(rng.randint(2, 8)))
        elif roll < 0.20:
            words[i] += rng.choice(_PUNCT)
    return " ".join(words) + rng.choice([".", ".", "?", "!", ":\n"])


def _code_line(rng: random.Random) -> str:
    name, arg = rng.choice(_WORDS), rng.choice(_WORDS)
    return rng.choice([
        f"def {name}_{arg}(self, {arg}):\n    return self.{name} + {rng.randint(0, 999)}\n",
        f"    for {arg} in range({rng.randint(1, 64)}):\n        {name}[{arg}] = {arg} * {arg}\n",
        f"if {name} is not None and len({arg}) > {rng.randint(0, 9)}:\n    print(f\"{{{name}}}: {arg}\")\n",
        f"{name} = {{\"{arg}\": [{rng.randint(0, 9)}, {rng.random():.3f}], \"ok\": true}}\n",
    ])


def tiny_corpus(seed: int = 0, num_paragraphs: int = 1200) -> str:
    """Deterministic mixed prose/code/multilingual text (same string on every machine for a seed)."""
    rng = random.Random(seed)
    paragraphs = []
    for _ in range(num_paragraphs):
        if rng.random() < 0.3:
            paragraphs.append("".join(_code_line(rng) for _ in range(rng.randint(1, 4))))
        else:
            paragraphs.append(" ".join(_sentence(rng) for _ in range(rng.randint(1, 5))) + "\n\n")
    return "".join(paragraphs)


def kimi_special_tokens(num_regular: int) -> dict[int, str]:
    """The 256 reserved special tokens: Kimi's names at Kimi's offsets, the rest `<|reserved_token_{id}|>`."""
    return {num_regular + k: KIMI_SPECIAL_NAMES.get(k, f"<|reserved_token_{num_regular + k}|>")
            for k in range(NUM_RESERVED_SPECIAL_TOKENS)}


def write_tiny_tokenizer(out_dir: str | Path, *, num_regular: int = 1792, seed: int = 0) -> dict[str, int]:
    """Train and write tiktoken.model, tokenizer_config.json and chat_template.jinja into out_dir."""
    if num_regular < 256:
        raise ValueError(f"num_regular={num_regular}: needs at least the 256 single-byte tokens")
    chunk_counts = Counter(chunk.encode("utf-8") for chunk in pretokenize(tiny_corpus(seed)))
    tokens = [bytes([b]) for b in range(256)] + train_bpe(chunk_counts, num_regular - 256)
    return _write_tokenizer(Path(out_dir), tokens)


def write_synthetic_tokenizer(out_dir: str | Path, *, num_regular: int = 163584) -> dict[str, int]:
    """A Kimi-format tokenizer of K2.6's size (163,584 regular + 256 special = 163,840 ids) without
    training (BPE on a corpus that large takes hours): the 256 bytes, then every 2-letter and then
    3-letter string over [0-9A-Za-z] in order. Still a valid BPE (each token's prefix is a token), so it
    encodes and decodes; it only stands in for the real one where ids, not text, matter (synthetic
    benchmarks: the gateway must decode any id the random target emits)."""
    alphabet = [bytes([c]) for c in b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"]
    pairs = [a + b for a in alphabet for b in alphabet]
    tokens = [bytes([b]) for b in range(256)] + pairs + [p + c for p in pairs for c in alphabet]
    if not 256 <= num_regular <= len(tokens):
        raise ValueError(f"num_regular={num_regular}: must be in [256, {len(tokens)}]")
    return _write_tokenizer(Path(out_dir), tokens[:num_regular])


def _write_tokenizer(out_dir: Path, tokens: list[bytes]) -> dict[str, int]:
    """tiktoken.model (token i = rank i), tokenizer_config.json with Kimi's specials, chat_template.jinja."""
    num_regular = len(tokens)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode('ascii')} {rank}\n" for rank, t in enumerate(tokens)))
    specials = kimi_special_tokens(num_regular)
    config = {
        "added_tokens_decoder": {str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for i, name in specials.items()},
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                                      "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"],
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "TikTokenTokenizer",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out_dir / "chat_template.jinja").write_text(KIMI_STYLE_CHAT_TEMPLATE)
    return {
        "vocab_size": num_regular + NUM_RESERVED_SPECIAL_TOKENS,
        "bos_token_id": num_regular,
        "eos_token_id": num_regular + 1,
        "im_end_id": num_regular + 2,
        "mask_token_id": num_regular + 254,
        "pad_token_id": num_regular + 255,
    }
