"""Incremental detokenization: token ids in, text deltas out, never a partial UTF-8 character.

Byte-level BPE tokens may end inside a multi-byte character, so the work is done on token bytes: each
feed appends the new tokens' bytes to an incremental UTF-8 decoder that holds back an incomplete tail
(at most 3 bytes) until a later token completes it. Cost per feed is O(new tokens).

Contract: feed(c1) + feed(c2) + ... + flush() == tokenizer.decode(c1 + c2 + ..., skip_special_tokens),
for any chunking, because both sides are Python's UTF-8 decoder with errors="replace" and its
incremental form is defined to agree with the one-shot form.
"""

from __future__ import annotations

import codecs
from typing import Iterable

from gateway.tokenizer import KimiTokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: KimiTokenizer, *, skip_special_tokens: bool = True):
        self._token_bytes = tokenizer.token_bytes
        self._skip = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.num_tokens = 0

    def feed(self, token_ids: Iterable[int]) -> str:
        """Text completed by these tokens; a trailing incomplete character waits for the next feed."""
        ids = list(token_ids)
        self.num_tokens += len(ids)
        data = b"".join([self._token_bytes(i) for i in ids if i not in self._skip])
        return self._decoder.decode(data)

    def flush(self) -> str:
        """End of stream: bytes still held are an incomplete character and become U+FFFD, as in decode."""
        return self._decoder.decode(b"", final=True)
