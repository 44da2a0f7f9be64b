"""Structured output: the output after `after` (the end of the thinking block), or all of it, must match an
llguidance grammar (JSON Schema, regex or Lark, compiled by the gateway into llguidance's grammar JSON).

At each output position the target's distribution becomes its restriction to the tokens the grammar allows after
the output so far (the others get -inf logits, so probabilities renormalize over the allowed ones): constrained
plain decoding. Speculation keeps that exactly. A tree row's allowed set depends on its own path, and only the rows
of the accepted path are ever read, so the walk (`stepping.accept_session`) chooses the target's token row by row
down the accepted path: one mask per emitted token, as plain decoding computes, instead of one per tree row (a mask
over a 200K vocabulary takes 50-75 us of CPU for JSON, ~1 ms for a bounded regex repeat; docs/BENCHMARKS.md). The
masks of the likeliest path are computed while the forward runs (`look_ahead`). Drafted tokens the grammar forbids are
simply never accepted.

The matcher needs each token id's bytes, so the verifier reads the checkpoint's vocabulary (tiktoken.model, through
service_kit/vocab.py); it still never sees text.
"""

from __future__ import annotations

from pathlib import Path

import llguidance
import numpy as np
import torch

from service_kit.errors import InvalidArgument
from service_kit.vocab import KIMI_PAT_STR, read_vocab


def load_vocabulary(model_dir: str, vocab_size: int, eos_ids) -> llguidance.LLTokenizer | None:
    """The checkpoint's token bytes for grammar masks (ids past the tokenizer's, up to the model's vocab_size, are
    never allowed), or None for a checkpoint without tiktoken.model (structured output is then refused)."""
    if not model_dir or not (Path(model_dir) / "tiktoken.model").exists():
        return None
    ranks, specials = read_vocab(model_dir)
    return llguidance.LLTokenizer.from_tiktoken(  # ~1 s at K2.6's vocabulary; once per process
        encoder=ranks, special_tokens=specials, pattern=KIMI_PAT_STR, eos_token=sorted(eos_ids),
        n_vocab=max(vocab_size, len(ranks) + len(specials)))


class GrammarError(RuntimeError):
    """A session's matcher failed mid-generation (e.g. one of llguidance's parser limits): that request ends with
    INVALID_ARGUMENT, the step's other sessions go on."""


LOOK_AHEAD_DEPTH = 16  # rows of the likeliest path masked while the forward runs (K2.6 accepts ~4-6 a step)


def allows(bits: bytes, token: int) -> bool:
    """Whether a grammar mask (bit i of byte b = id 8 b + i) allows `token`."""
    return token >> 3 < len(bits) and bool(bits[token >> 3] >> (token & 7) & 1)


def single_token(bits: bytes) -> int | None:
    """The one id a mask allows (the grammar forces it: a key, a bracket), or None."""
    n = int.from_bytes(bits, "little")
    return n.bit_length() - 1 if n and n & (n - 1) == 0 else None


def unpack(masks: list[bytes], v: int) -> np.ndarray:
    """Grammar masks -> [len(masks), v] bool (ids past a mask's end: False)."""
    flags = np.unpackbits(np.frombuffer(b"".join(masks), dtype=np.uint8), bitorder="little")
    flags = flags.reshape(len(masks), -1)[:, :v]
    if flags.shape[1] < v:
        flags = np.pad(flags, ((0, 0), (0, v - flags.shape[1])))
    return np.ascontiguousarray(flags).view(np.bool_)


def greedy_choice(bits: bytes, ids: list[int], values: list[float]) -> int | None:
    """The masked argmax from a row's top-k (ids by descending value), exactly as torch's argmax of the masked row
    picks it (the smallest id among equal maxima); None when the top-k cannot tell (no allowed id in it, or the best
    allowed value equals the k-th, so an equal one may lie outside)."""
    best = next((v for t, v in zip(ids, values) if allows(bits, t)), None)
    if best is None or best == values[-1]:
        return None
    return min(t for t, v in zip(ids, values) if v == best and allows(bits, t))


class Constraint:
    """One session's grammar state: a matcher that has consumed the output after the trigger (`after`)."""

    def __init__(self, vocabulary: llguidance.LLTokenizer | None, grammar: str, after: int | None):
        if vocabulary is None:
            raise InvalidArgument("grammar", "this verifier has no tokenizer vocabulary (a checkpoint without "
                                             "tiktoken.model, or synthetic weights): structured output is off")
        self.matcher = llguidance.LLMatcher(vocabulary, grammar, log_level=0)
        if self.matcher.is_error():
            raise InvalidArgument("grammar", self.matcher.get_error())
        self.after = after
        self.open = after is None  # the grammar applies from the next token on
        self._pinned: torch.Tensor | None = None  # [V] bool host staging of the allowed set, on a GPU
        self._ahead: dict[int, bytes] = {}  # this step's row -> mask, from look_ahead
        self.drawn: tuple[list[int], torch.Tensor] | None = None  # this step's (rows, [rows] device tokens)
        self._eos = frozenset(vocabulary.eos_tokens)

    def look_ahead(self, tokens: list[int], parents: list[int]) -> None:
        """While the forward runs: the masks of the rows down the tree's likeliest path (each row's first child; the
        drafter lists a tree best-first), which the walk then finds ready (`take_ahead`). On a copy of the matcher,
        so that a failure on a row the walk never reaches cannot touch the session's."""
        self._ahead = {}
        if not self.open:
            return
        first: dict[int, int] = {}
        for node, parent in enumerate(parents, 1):
            first.setdefault(parent, node)
        matcher, row, consumed = self.matcher.deep_copy(), 0, 0
        while True:
            bits = matcher.compute_bitmask()
            if matcher.is_error():  # no mask kept: the walk's own `mask()` meets the error if it gets there
                break
            self._ahead[row] = bits
            child = first.get(row)
            if child is None or consumed == LOOK_AHEAD_DEPTH:
                break
            token = tokens[child - 1]
            if token in self._eos or not allows(bits, token) or not matcher.consume_token(token):
                break
            row, consumed = child, consumed + 1

    def take_ahead(self) -> tuple[dict[int, bytes], dict[int, int]]:
        """The masks `look_ahead` left for this step's rows, and the tokens `stepping.draw_ahead` drew at some of
        them (then none: rows are numbered per step)."""
        ahead, drawn, self._ahead, self.drawn = self._ahead, self.drawn, {}, None
        return ahead, ({} if drawn is None else dict(zip(drawn[0], drawn[1].tolist())))

    def ahead_masks(self) -> dict[int, bytes]:
        return self._ahead

    def mask(self) -> bytes:
        """The allowed set after the output so far: ceil(n/32) little-endian int32 words, bit i of word w = id
        32 w + i."""
        bits = self.matcher.compute_bitmask()
        if self.matcher.is_error():
            raise GrammarError(f"grammar: {self.matcher.get_error()}")
        return bits

    def restrict(self, logits: torch.Tensor, bits: bytes | None = None) -> torch.Tensor:
        """[V] logits of the next position -> the same with every token the grammar forbids there at -inf (a new
        tensor); unchanged before the trigger. `bits`: the current state's mask, when already computed."""
        if not self.open:
            return logits
        v = logits.shape[-1]
        flags = unpack([self.mask() if bits is None else bits], v)[0]
        if logits.device.type == "cpu":
            allowed = torch.from_numpy(flags)
        else:  # one copy of a reused pinned buffer: the walk reads each row's choice (a sync) before the next mask
            if self._pinned is None or self._pinned.numel() != v:
                self._pinned = torch.empty(v, dtype=torch.bool).pin_memory()
            self._pinned.numpy()[:] = flags
            allowed = self._pinned.to(logits.device, non_blocking=True)
        return torch.where(allowed, logits, float("-inf"))

    def advance(self, token: int) -> None:
        """`token` was emitted: the matcher consumes it (after the trigger), or it opens the grammar."""
        if not self.open:
            self.open = token == self.after
        elif not self.matcher.consume_token(token):
            raise GrammarError(f"grammar: emitted token {token} is not allowed: {self.matcher.get_error()}")

