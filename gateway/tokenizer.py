"""Kimi tokenizer: tiktoken BPE ranks + 256 reserved special ids + the checkpoint's chat template.

Files read from a model directory (reference/k26.md §1.3):
  tiktoken.model         one `base64(token bytes) rank` per line, ranks exactly 0..n-1
  tokenizer_config.json  added_tokens_decoder {"id": {"content", "special"}}, bos/eos token names,
                         and (K2 layout) the chat template under "chat_template"
  chat_template.jinja    the chat template (K2.5/K2.6 layout; wins over the json key)
Special ids are n + i for i in 0..255, as in tokenization_kimi.py; unnamed slots become
`<|reserved_token_{id}|>`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

import tiktoken

from gateway.chat import ChatTemplate
from gateway.reasoning import ThinkTokens
from gateway.tool_calls import MARKERS, ToolCallTokens
from service_kit.vocab import (KIMI_PAT_STR, NUM_RESERVED_SPECIAL_TOKENS, added_tokens,  # noqa: F401 (re-exported)
                              load_tiktoken_ranks, read_json, special_names)


# tokenization_kimi.py cuts the text before tiktoken sees it (400k-char blocks, then runs of >25k
# whitespace or non-whitespace chars, tiktoken issue 195). The cuts change ids at the seam, so we repeat
# them exactly. str.isspace() is the class it uses; every such char is below U+3001.
_MAX_ENCODE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000
_SPACE_CLASS = "".join(re.escape(chr(c)) for c in range(0x3001) if chr(c).isspace())
_LONG_RUN = re.compile(f"[{_SPACE_CLASS}]{{{_MAX_RUN_CHARS + 1},}}|[^{_SPACE_CLASS}]{{{_MAX_RUN_CHARS + 1},}}")


def _byte_to_unicode() -> list[str]:
    """GPT-2's printable stand-in for each byte, the spelling HF uses for Kimi's token strings."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = [""] * 256, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b], extra = chr(256 + extra), extra + 1
    return table


_BYTE_TO_UNICODE = _byte_to_unicode()
_UNICODE_TO_BYTE = {ch: b for b, ch in enumerate(_BYTE_TO_UNICODE)}


def _split_like_kimi(text: str) -> list[str]:
    pieces = []
    for start in range(0, len(text), _MAX_ENCODE_CHARS):
        block, cut = text[start:start + _MAX_ENCODE_CHARS], 0
        for run in _LONG_RUN.finditer(block):
            for pos in range(run.start() + _MAX_RUN_CHARS, run.end(), _MAX_RUN_CHARS):
                pieces.append(block[cut:pos])
                cut = pos
        pieces.append(block[cut:])
    return pieces


def _token_name(value: Any, default: str | None) -> str | None:
    """bos_token etc. are either a string or a serialized AddedToken {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else default


def _chat_template(model_dir: Path, cfg: dict[str, Any]) -> ChatTemplate | None:
    path = model_dir / "chat_template.jinja"
    if path.exists():
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: cannot read chat template ({e})") from e
        return ChatTemplate(source, origin=str(path))
    source = cfg.get("chat_template")
    if isinstance(source, list):  # HF's named-template list: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default", next(iter(named.values()), None))
    if source is None:
        return None
    if not isinstance(source, str):
        raise ValueError(f"{model_dir / 'tokenizer_config.json'}: chat_template must be a string")
    return ChatTemplate(source, origin=f"{model_dir / 'tokenizer_config.json'} (chat_template)")


class KimiTokenizer:
    """Text <-> token ids for Kimi K2-family checkpoints (and the tiny test checkpoints in the same format)."""

    def __init__(self, ranks: dict[bytes, int], added_tokens: dict[int, str], *,
                 chat_template: ChatTemplate | None = None, bos_token: str = "[BOS]", eos_token: str = "[EOS]",
                 not_special: frozenset[int] = frozenset(), name: str = "kimi"):
        n = len(ranks)
        special_range = range(n, n + NUM_RESERVED_SPECIAL_TOKENS)
        if stray := sorted(set(added_tokens) - set(special_range)):
            raise ValueError(f"added token ids {stray[:5]} are outside the reserved range [{n}, {n + 256})")
        self.specials = special_names(n, added_tokens)
        if len(self.specials) != NUM_RESERVED_SPECIAL_TOKENS:
            raise ValueError("special token names must be unique")
        self.num_regular = n
        self.vocab_size = n + NUM_RESERVED_SPECIAL_TOKENS
        self.special_ids = frozenset(special_range) - not_special
        self._ranks = ranks
        self._enc = tiktoken.Encoding(name=name, pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                      special_tokens=self.specials)
        # Byte table for all ids: decode and the incremental detokenizer join slices of it, O(tokens).
        self._bytes: list[bytes] = [b""] * self.vocab_size
        for token, rank in ranks.items():
            self._bytes[rank] = token
        for content, i in self.specials.items():
            self._bytes[i] = content.encode("utf-8")
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_id, self.eos_id = self._special_id(bos_token), self._special_id(eos_token)
        self.im_end_id = self.specials.get("<|im_end|>")
        # K2.5 configs name [EOS], one K2.6 extraction names <|im_end|> (k26.md §1.2): stop on both.
        self.stop_ids = tuple(sorted({self.eos_id} | {self.specials[t] for t in ("[EOS]", "<|im_end|>")
                                                       if t in self.specials}))
        self.chat_template = chat_template

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> KimiTokenizer:
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise ValueError(f"{model_dir}: not a directory")
        ranks = load_tiktoken_ranks(model_dir / "tiktoken.model")
        config_path = model_dir / "tokenizer_config.json"
        cfg = read_json(config_path)
        added, not_special = added_tokens(cfg, config_path)
        template = _chat_template(model_dir, cfg)
        try:  # what the constructor rejects (token names, ids) comes from tokenizer_config.json
            return cls(ranks, added, chat_template=template,
                       bos_token=_token_name(cfg.get("bos_token"), "[BOS]"),
                       eos_token=_token_name(cfg.get("eos_token"), "[EOS]"),
                       not_special=frozenset(not_special), name=model_dir.name or "kimi")
        except ValueError as e:
            raise ValueError(f"{config_path}: {e}") from e

    def _special_id(self, token: str) -> int:
        if token not in self.specials:
            raise ValueError(f"special token {token!r} is not among the reserved special tokens")
        return self.specials[token]

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """allow_special=False encodes '<|im_end|>' in user text as plain text, never as the special id."""
        if allow_special:
            return [i for piece in _split_like_kimi(text) for i in self._enc.encode(piece, allowed_special="all")]
        return [i for piece in _split_like_kimi(text) for i in self._enc.encode_ordinary(piece)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Invalid UTF-8 (a token cut inside a character) becomes U+FFFD, like tiktoken's decode."""
        self._check_ids(ids)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return b"".join([self._bytes[i] for i in ids]).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside [0, {self.vocab_size})")
        return self._bytes[token_id]

    @property
    def think_tokens(self) -> ThinkTokens | None:
        """Kimi's <think> / </think> ids, or None for a vocabulary without them."""
        start, end = self.token_to_id("<think>"), self.token_to_id("</think>")
        return None if start is None or end is None else ThinkTokens(start, end)

    @property
    def tool_call_tokens(self) -> ToolCallTokens | None:
        """Kimi's five tool-call marker ids, or None for a vocabulary without them."""
        ids = [self.token_to_id(m) for m in MARKERS]
        return None if None in ids else ToolCallTokens(*ids)

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    def id_to_token(self, token_id: int) -> str:
        """HF's token spelling: the special's content, or the bytes in GPT-2's printable byte alphabet."""
        raw = self.token_bytes(token_id)
        if token_id >= self.num_regular:
            return raw.decode("utf-8")
        return "".join(_BYTE_TO_UNICODE[b] for b in raw)

    def token_to_id(self, token: str) -> int | None:
        if token in self.specials:
            return self.specials[token]
        if any(ch not in _UNICODE_TO_BYTE for ch in token):
            return None
        return self._ranks.get(bytes(_UNICODE_TO_BYTE[ch] for ch in token))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render the checkpoint's template. `thinking=True, preserve_thinking=False` are the defaults of
        tokenization_kimi.py's apply_chat_template, so templates that read them behave as upstream."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (chat_template.jinja or tokenizer_config.json)")
        context = {"thinking": True, "preserve_thinking": False, "bos_token": self.bos_token,
                   "eos_token": self.eos_token, **kwargs}
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **context)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        # Specials are allowed in the rendered text, as upstream: the template's role markers must become
        # special ids (and so does a marker typed inside a message, exactly as with HF's tokenizer).
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, allow_special=True)

    def _check_ids(self, ids: Sequence[int]) -> None:
        if ids and not (0 <= min(ids) and max(ids) < self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise ValueError(f"token id {bad} is outside [0, {self.vocab_size})")
