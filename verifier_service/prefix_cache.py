"""Prefix caching: full KV pages of earlier requests, found again by the tokens they hold.

A page is published once it is full and its tokens are known (a prompt's pages when its prefill ends, the
rest of a session's committed pages when it ends). Its key chains the page's tokens onto the key of the
page before it (blake2b of the previous key + the page's token ids), so a key names the whole prefix up to
the page's end: a new prompt whose first k full pages have published keys starts with those k pages in its
table and prefills from k · page_size. Published pages are immutable: sessions only ever write past their
length, and a published page is full.

Life of a published page: held while any session's table holds it (`refs` > 0); idle, in least recently
released order, once none does; evicted (its key forgotten, the page back to the free list) when the
free list runs dry. Idle pages count as free: `PageTable.num_free` includes them. Pure Python, like the
page table; every rank runs the same plans, so a page id names the same cached tokens on every rank.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import numpy as np


def page_keys(tokens: Sequence[int], page_size: int, pages: int, first: int = 0, key: bytes = b"") -> Iterator[bytes]:
    """The chained keys of full pages first .. pages-1 of `tokens`, computed as they are taken (a lookup stops
    hashing at its first miss); `key`: page first-1's (a page's key covers every token before its end)."""
    ids = np.asarray(tokens[first * page_size: pages * page_size], dtype=np.int64)
    for i in range(pages - first):
        key = hashlib.blake2b(key + ids[i * page_size: (i + 1) * page_size].tobytes(), digest_size=16).digest()
        yield key


class PrefixIndex:
    """Published pages by key, their holders and the idle ones (see the module docstring)."""

    def __init__(self):
        self.page_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.refs: dict[int, int] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()  # refs == 0, least recently released first

    def match(self, tokens: Sequence[int], page_size: int) -> list[int]:
        """The published pages of the longest cached prefix of `tokens`, leaving at least one token to
        prefill (its logits give the first output token); each is now held once more."""
        found = []
        for key in page_keys(tokens, page_size, (len(tokens) - 1) // page_size):
            page = self.page_of.get(key)
            if page is None:
                break
            found.append(page)
        for page in found:
            self.hold(page)
        return found

    def hold(self, page: int) -> None:
        self.idle.pop(page, None)
        self.refs[page] = self.refs.get(page, 0) + 1

    def publish(self, key: bytes, page: int) -> bool:
        """Makes a session's full private page findable under `key` (held by that session). False if the key
        already names another page (a concurrent session published the same tokens first)."""
        if key in self.page_of:
            return False
        self.page_of[key], self.key_of[page], self.refs[page] = page, key, 1
        return True

    def release(self, pages: Sequence[int]) -> None:
        """Pages a closing session held, in position order; the deepest become idle first, so a prompt's
        shared beginning is evicted last."""
        for page in reversed(pages):
            self.refs[page] -= 1
            if not self.refs[page]:
                self.idle[page] = None

    def evict(self, n: int) -> list[int]:
        """Up to n idle pages, forgotten (least recently released first)."""
        out = []
        while self.idle and len(out) < n:
            page, _ = self.idle.popitem(last=False)
            del self.page_of[self.key_of.pop(page)], self.refs[page]
            out.append(page)
        return out


class FeatureStore:
    """The drafter's feature rows of published pages, by page key, on the host, least recently used evicted past
    `budget_bytes`. A hit gives the drafter the rows of the cached pages before its first prefilled position (up
    to the feature window), as a cold prefill would have sent them: keyed by content, a row set never outlives
    the prefix it belongs to, whatever happens to the page ids."""

    def __init__(self, budget_bytes: int):
        self.budget, self.used = budget_bytes, 0
        self.rows: OrderedDict[bytes, object] = OrderedDict()  # key -> torch.Tensor [page_size, F]

    def put(self, key: bytes, rows) -> None:
        size = rows.numel() * rows.element_size()
        if key in self.rows or size > self.budget:
            return
        self.rows[key] = rows.clone()
        self.used += size
        while self.used > self.budget:
            _, old = self.rows.popitem(last=False)
            self.used -= old.numel() * old.element_size()

    def trailing(self, keys: list[bytes], limit_pages: int) -> list:
        """The stored rows of the last pages of `keys` (a prompt's cached pages, in order), as many consecutive
        ones as are stored, at most limit_pages -> their tensors, in position order."""
        out = []
        for key in reversed(keys[max(len(keys) - limit_pages, 0):]):
            rows = self.rows.get(key)
            if rows is None:
                break
            self.rows.move_to_end(key)
            out.append(rows)
        return out[::-1]
