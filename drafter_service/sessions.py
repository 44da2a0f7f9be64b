"""Per-session drafter-cache bookkeeping: pages, window, resync decisions, LRU eviction (pure Python).

The K/V rows themselves live in one pool allocated once (kv_cache.KVPool); this file only decides which
slots a session's rows go to. A session stores context rows for the positions [first_pos, length) in its
pages, in order: position p sits in pages[(p - first_pos) // P] at offset (p - first_pos) % P.
The block attends to the window [max(0, length - W), length); pages wholly before it are freed.

Resync contract (ddtree.internal.v1 ProposeItem). A propose carries rows for [start, start + n):
  * reset = false: start must equal the session's cache length (0 for an unknown or evicted session),
    else the item is answered resync_required(cache length) and nothing changes;
  * reset = true: whatever the session held is dropped and its cache restarts at `start`. The verifier
    resends its last W rows (start = max(0, s - W)), which is all the block ever attends to, so trees
    after a resync equal those of an uninterrupted session.
Rows of a request that fall before the window (n > W, e.g. a long prefill) are never injected.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Collection, Hashable


class UnknownSessionError(KeyError):
    def __str__(self) -> str:
        return f"unknown drafter session {self.args[0]!r}"


class CacheFullError(RuntimeError):
    """Not enough free pages even after evicting every session outside the current batch."""


@dataclass
class _Session:
    pages: list[int] = field(default_factory=list)
    first_pos: int = 0
    length: int = 0


@dataclass(frozen=True)
class InjectPlan:
    """What to write for one item, and what its block attends to afterwards."""
    skip: int  # leading feature rows of the request that fall before the window: not injected
    positions: range  # absolute positions of the injected rows
    slots: tuple[int, ...]  # flat pool slot per injected row (page * page_size + offset)
    pages: tuple[int, ...]  # the session's pages after injection, in position order
    first_pos: int  # position held by slot 0 of pages[0]
    visible_from: int  # first context position the block attends (window start)
    length: int  # cache length after injection = the root token's position


@dataclass(frozen=True)
class Resync:
    cache_len: int


class SessionTable:
    def __init__(self, num_pages: int, page_size: int, window: int | None):
        if page_size <= 0 or num_pages <= 0:
            raise ValueError(f"need page_size > 0 and num_pages > 0, got {page_size}, {num_pages}")
        if window is not None and window <= 0:
            raise ValueError(f"window must be > 0 or None, got {window}")
        self.num_pages, self.page_size, self.window = num_pages, page_size, window
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self._sessions: OrderedDict[Hashable, _Session] = OrderedDict()  # LRU first

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: Hashable) -> bool:
        return session_id in self._sessions

    @property
    def pages_used(self) -> int:
        return self.num_pages - len(self._free)

    def cache_len(self, session_id: Hashable) -> int:
        """Cache length of a session (0 for one never seen or evicted)."""
        s = self._sessions.get(session_id)
        return s.length if s else 0

    def release(self, session_id: Hashable) -> None:
        s = self._sessions.pop(session_id, None)
        if s is None:
            raise UnknownSessionError(session_id)
        self._free.extend(reversed(s.pages))

    def plan(self, session_id: Hashable, start: int, n: int, reset: bool,
             protected: Collection[Hashable]) -> InjectPlan | Resync:
        """Decide where rows [start, start + n) go; may evict sessions outside `protected`."""
        s = self._sessions.get(session_id)
        if not reset and start != (s.length if s else 0):
            return Resync(self.cache_len(session_id))
        if s is None or reset:
            if s is not None:
                self._free.extend(reversed(s.pages))
            s = _Session(first_pos=start, length=start)
        self._sessions[session_id] = s
        self._sessions.move_to_end(session_id)
        new_len = start + n
        lo = max(0, new_len - self.window) if self.window else 0  # window start after injection
        first_row = max(start, lo)
        while s.pages and s.first_pos + self.page_size <= lo:  # whole page before the window
            self._free.append(s.pages.pop(0))
            s.first_pos += self.page_size
        if not s.pages:
            s.first_pos = first_row
        needed = -(-(new_len - s.first_pos) // self.page_size) - len(s.pages)
        if needed > 0:
            self._take_pages(session_id, s, needed, protected)
        s.length = new_len
        return InjectPlan(
            skip=first_row - start,
            positions=range(first_row, new_len),
            slots=tuple(self._slot(s, p) for p in range(first_row, new_len)),
            pages=tuple(s.pages),
            first_pos=s.first_pos,
            visible_from=lo,
            length=new_len,
        )

    def _slot(self, s: _Session, position: int) -> int:
        page, offset = divmod(position - s.first_pos, self.page_size)
        return s.pages[page] * self.page_size + offset

    def _take_pages(self, session_id: Hashable, s: _Session, needed: int, protected: Collection[Hashable]) -> None:
        victims = (sid for sid in list(self._sessions) if sid != session_id and sid not in protected)
        while len(self._free) < needed:
            victim = next(victims, None)
            if victim is None:
                self.release(session_id)  # leave no half-planned session behind
                raise CacheFullError(
                    f"drafter KV cache full: session needs {needed} more pages of {self.page_size} rows, "
                    f"{len(self._free)} free of {self.num_pages} after evicting every session outside the batch")
            self.release(victim)  # least recently used first
        s.pages.extend(self._free.pop() for _ in range(needed))
