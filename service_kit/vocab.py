"""The Kimi vocabulary files of a checkpoint directory (reference/k26.md §1.3): `tiktoken.model` (BPE ranks) and
`tokenizer_config.json` (the reserved special ids' names). Read by the gateway's tokenizer (gateway/tokenizer.py)
and by the verifier, whose structured-output masks need each id's bytes (verifier_service/grammar.py)."""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path
from typing import Any

# The K2-family pre-tokenizer, alternative by alternative as `pat_str` in tokenization_kimi.py: Han runs;
# words (optional leading non-letter, cased letters with Han excluded, optional English contraction);
# 1-3 digits; punctuation runs with trailing newlines; newline runs; spaces not before a non-space; spaces.
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_PAT_STR = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?" + _UPPER + "*" + _LOWER + "+" + _CONTRACTION,
    r"[^\r\n\p{L}\p{N}]?" + _UPPER + "+" + _LOWER + "*" + _CONTRACTION,
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
NUM_RESERVED_SPECIAL_TOKENS = 256


def load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Parse a tiktoken.model file; ranks must be exactly 0..n-1 because special ids start at n."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise ValueError(f"{path}: cannot read BPE ranks ({e.strerror})") from e
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            token_b64, rank_str = line.split()
            token, rank = base64.b64decode(token_b64, validate=True), int(rank_str)
        except (ValueError, binascii.Error) as e:
            raise ValueError(f"{path}:{lineno}: expected 'base64token rank', got {line[:80]!r}") from e
        if token in ranks:
            raise ValueError(f"{path}:{lineno}: duplicate token {token!r}")
        ranks[token] = rank
    if not ranks:
        raise ValueError(f"{path}: no BPE ranks")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be exactly 0..{len(ranks) - 1} (got duplicates or gaps)")
    if any(bytes([b]) not in ranks for b in range(256)):
        raise ValueError(f"{path}: every single byte must have a rank (byte-level BPE)")
    return ranks


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror})") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def added_tokens(cfg: dict[str, Any], path: Path) -> tuple[dict[int, str], set[int]]:
    names, not_special = {}, set()
    for key, entry in (cfg.get("added_tokens_decoder") or {}).items():
        if not (isinstance(entry, dict) and isinstance(entry.get("content"), str) and key.isdigit()):
            raise ValueError(f"{path}: added_tokens_decoder[{key!r}] needs an integer id and a 'content' string")
        names[int(key)] = entry["content"]
        if entry.get("special") is False:
            not_special.add(int(key))
    return names, not_special


def special_names(n: int, added: dict[int, str]) -> dict[str, int]:
    """The 256 reserved special ids after n BPE ranks by name; unnamed slots are `<|reserved_token_{id}|>`."""
    return {added.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + NUM_RESERVED_SPECIAL_TOKENS)}


def read_vocab(model_dir: str | Path) -> tuple[dict[bytes, int], dict[str, int]]:
    """A checkpoint directory -> (BPE ranks, special ids by name)."""
    model_dir = Path(model_dir)
    ranks = load_tiktoken_ranks(model_dir / "tiktoken.model")
    config = model_dir / "tokenizer_config.json"
    added = added_tokens(read_json(config), config)[0] if config.exists() else {}
    return ranks, special_names(len(ranks), added)
