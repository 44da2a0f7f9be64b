"""Paged latent KV cache of the target: one tensor allocated once, plus pure-Python page bookkeeping.

Byte layout of `PagedKVCache.kv` (contiguous, allocated once, never resized):

    kv: [num_layers, num_pages, page_size, width]   width = kv_lora_rank + qk_rope_head_dim (576)

- A slot is `page * page_size + offset`; `kv[l].view(-1, width)[slot]` is that token's row in layer l.
  Byte offset of (layer l, slot s, value i) = ((l * num_pages * page_size + s) * width + i) * itemsize.
  A page is therefore `page_size * width * itemsize` contiguous bytes per layer (pages of one layer
  are adjacent; the same page id addresses the same tokens in every layer).
- Row content: values [0, kv_lora_rank) = the RMSNorm'ed latent ĉ; values [kv_lora_rank, width) = the
  shared rope key, rotated at the token's absolute position, interleaved-pair layout (DeepSeek / vLLM
  convention; HF's cache holds the same numbers de-interleaved).
- bf16 K2.6: 576 · 2 B = 1,152 B per token-layer, 61 layers → 70,272 B per token.

Per session: an ordered page list (its committed tokens: position p lives in page pages[p // page_size]
at offset p % page_size) and a length. Tree rows of a verify go to the session's scratch pages;
`commit` copies the accepted path's rows to the session's next positions and frees the scratch.
Every rank runs the same bookkeeping on the same broadcast plan, so page ids agree across ranks.
With a prefix cache (verifier_service/prefix_cache.py) a session's table may begin with published pages that
other sessions hold too: read only, never written (a session writes past its length, and they are full).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from verifier_service.prefix_cache import PrefixIndex, page_keys


class OutOfPages(RuntimeError):
    """The cache has no free page left for the request."""


@dataclass
class _Session:
    pages: list[int] = field(default_factory=list)  # committed tokens, in position order
    length: int = 0  # committed tokens
    scratch_pages: list[int] = field(default_factory=list)
    scratch_rows: int = 0
    shared: int = 0  # leading pages that are published in the prefix cache (held, read only)


class PageTable:
    """Free list + per-session page tables. Pure Python: no tensors, unit-testable anywhere."""

    def __init__(self, num_pages: int, page_size: int, prefix_cache: bool = False):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages={num_pages} and page_size={page_size} must be positive")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low page ids first
        self._sessions: dict[Hashable, _Session] = {}
        self.prefix = PrefixIndex() if prefix_cache else None

    @property
    def num_free(self) -> int:
        """Free pages, idle cached ones included (they are evicted when needed)."""
        return len(self._free) + (len(self.prefix.idle) if self.prefix is not None else 0)

    def open(self, sid: Hashable, prompt: Sequence[int] | None = None) -> int:
        """A new session; with a prefix cache and its prompt, its table starts with the published pages of the
        prompt's longest cached prefix -> that prefix's length (tokens already in the cache)."""
        if sid in self._sessions:
            raise KeyError(f"session {sid!r} is already open")
        s = self._sessions[sid] = _Session()
        if self.prefix is not None and prompt is not None:
            s.pages = self.prefix.match(prompt, self.page_size)
            s.shared, s.length = len(s.pages), len(s.pages) * self.page_size
        return s.length

    def publish(self, sid: Hashable, tokens: Sequence[int]) -> list[tuple[int, bytes]]:
        """Publish the session's full committed pages, whose tokens begin `tokens` (prompt, then output), in
        the prefix cache; stops at a page whose tokens another page already holds -> (page index in the session,
        key) of each page published now."""
        s = self._session(sid)
        full = min(len(tokens), s.length) // self.page_size
        if self.prefix is None or full <= s.shared:
            return []
        published = []  # the pages already shared are keyed: hashing resumes after them
        before = self.prefix.key_of[s.pages[s.shared - 1]] if s.shared else b""
        for key in page_keys(tokens, self.page_size, full, s.shared, before):
            if not self.prefix.publish(key, s.pages[s.shared]):
                break
            published.append((s.shared, key))
            s.shared += 1
        return published

    def shared_keys(self, sid: Hashable) -> list[bytes]:
        """The prefix-cache keys of the session's leading published pages, in order."""
        s = self._session(sid)
        return [self.prefix.key_of[p] for p in s.pages[:s.shared]] if self.prefix is not None else []

    def close(self, sid: Hashable) -> None:
        """Free every page of the session (committed and scratch); published ones stay cached."""
        s = self._session(sid)
        if s.shared:
            self.prefix.release(s.pages[:s.shared])
        self._release(s.pages[s.shared:] + s.scratch_pages)
        del self._sessions[sid]

    def withhold(self, n: int) -> list[int]:
        """n pages taken out of the table for good (no session's, not counted in num_pages): the CUDA graphs'
        pad page, so that an idle verifier reports no page used."""
        pages = self._take(n)
        self.num_pages -= n
        return pages

    def sessions(self) -> list[Hashable]:
        return list(self._sessions)

    def length(self, sid: Hashable) -> int:
        return self._session(sid).length

    def pages(self, sid: Hashable) -> list[int]:
        return list(self._session(sid).pages)

    def slots(self, sid: Hashable, start: int, stop: int) -> list[int]:
        """Slots of committed-or-reserved positions [start, stop) of the session."""
        pages, ps = self._session(sid).pages, self.page_size
        if stop > len(pages) * ps:
            raise IndexError(f"positions up to {stop} exceed session {sid!r}'s {len(pages)} pages")
        return [pages[p // ps] * ps + p % ps for p in range(start, stop)]

    def extend(self, sid: Hashable, n: int) -> list[int]:
        """Append n positions to the session (allocating pages as needed) -> their slots.
        All-or-nothing: on OutOfPages the session is unchanged."""
        s = self._session(sid)
        need = math.ceil((s.length + n) / self.page_size) - len(s.pages)
        s.pages += self._take(need)
        start, s.length = s.length, s.length + n
        return self.slots(sid, start, s.length)

    def scratch(self, sid: Hashable, n: int) -> list[int]:
        """Fresh scratch slots for n tree rows (any previous scratch of the session is freed first)."""
        self.release_scratch(sid)
        s = self._session(sid)
        s.scratch_pages, s.scratch_rows = self._take(math.ceil(n / self.page_size)), n
        return self.scratch_slots(sid)

    def scratch_slots(self, sid: Hashable) -> list[int]:
        s, ps = self._session(sid), self.page_size
        return [s.scratch_pages[r // ps] * ps + r % ps for r in range(s.scratch_rows)]

    def release_scratch(self, sid: Hashable) -> None:
        s = self._session(sid)
        self._release(s.scratch_pages)
        s.scratch_pages, s.scratch_rows = [], 0

    def plan_commit(self, sid: Hashable, accepted_rows: Sequence[int]) -> tuple[list[int], list[int]]:
        """Bookkeeping half of `PagedKVCache.commit`: -> (source scratch slots, destination slots).
        The caller copies, then calls `release_scratch`."""
        s = self._session(sid)
        if any(not 0 <= r < s.scratch_rows for r in accepted_rows):
            raise IndexError(f"accepted rows {list(accepted_rows)} outside the {s.scratch_rows} scratch rows")
        scratch = self.scratch_slots(sid)
        src = [scratch[r] for r in accepted_rows]
        return src, self.extend(sid, len(accepted_rows))

    def _session(self, sid: Hashable) -> _Session:
        try:
            return self._sessions[sid]
        except KeyError:
            raise KeyError(f"unknown session {sid!r}") from None

    def _take(self, n: int) -> list[int]:
        if n > len(self._free) and self.prefix is not None:
            self._free[:0] = self.prefix.evict(n - len(self._free))  # taken last: fresh pages first
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} of {self.num_pages} free")
        return [self._free.pop() for _ in range(max(n, 0))]

    def _release(self, pages: Sequence[int]) -> None:
        self._free.extend(reversed(pages))


class PagedKVCache:
    """The cache tensor (see module docstring for the byte layout) + its `PageTable`."""

    def __init__(self, *, num_layers: int, width: int, num_pages: int, page_size: int,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu", prefix_cache: bool = False):
        self.table = PageTable(num_pages, page_size, prefix_cache)
        self.kv = torch.zeros(num_layers, num_pages, page_size, width, dtype=dtype, device=device)
        # Multi-rank: rank 0 forwards each commit's copy to the other ranks' replicated caches.
        self.on_copy: Callable[[list[int], list[int]], None] | None = None
        # kernels/kv_commit on CUDA (rows must be whole 16-byte pieces); set by the runner's flag.
        self.use_kernel = False
        self._staging: tuple[torch.Tensor, torch.Tensor, torch.cuda.Event] | None = None  # copy_rows' indices

    @classmethod
    def from_budget(cls, budget_bytes: int, *, num_layers: int, width: int, page_size: int,
                    dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                    prefix_cache: bool = False) -> PagedKVCache:
        """As many pages as `budget_bytes` holds (a page spans all layers)."""
        page_bytes = num_layers * page_size * width * torch.finfo(dtype).bits // 8
        num_pages = budget_bytes // page_bytes
        if num_pages < 1:
            raise ValueError(f"budget {budget_bytes} B is below one page ({page_bytes} B)")
        return cls(num_layers=num_layers, width=width, num_pages=num_pages, page_size=page_size,
                   dtype=dtype, device=device, prefix_cache=prefix_cache)

    @property
    def page_size(self) -> int:
        return self.table.page_size

    def rows(self, slots: Sequence[int]) -> torch.Tensor:
        """-> [num_layers, len(slots), width] copy of the given slots' rows."""
        flat = self.kv.view(self.kv.shape[0], -1, self.kv.shape[-1])
        return flat[:, torch.as_tensor(list(slots), dtype=torch.int64, device=self.kv.device)]

    def commit(self, sid: Hashable, accepted_rows: Sequence[int]) -> list[int]:
        """Copy the accepted scratch rows (path order, root first) into the session's next positions,
        free the scratch -> destination slots. Scratch pages never alias session pages, so the copy
        cannot overwrite a source row."""
        return self.commit_many([(sid, accepted_rows)])[0]

    def commit_many(self, items: Sequence[tuple[Hashable, Sequence[int]]]) -> list[list[int]]:
        """`commit` for several sessions with ONE copy (one index transfer, one kernel or gather): every
        session's destinations are allocated before any scratch is freed, so no destination of one
        session can be another's (not yet copied) source -> destination slots per session."""
        src: list[int] = []
        dsts = []
        for sid, rows in items:
            s, d = self.table.plan_commit(sid, rows)
            src += s
            dsts.append(d)
        if src:
            dst = [x for d in dsts for x in d]
            if self.on_copy is not None:
                self.on_copy(src, dst)
            self.copy_rows(src, dst)
        for sid, _ in items:
            self.table.release_scratch(sid)
        return dsts

    def copy_rows(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """kv[:, dst[i]] = kv[:, src[i]] in every layer (sources never alias destinations)."""
        if self.kv.device.type == "cpu":
            idx = torch.tensor([list(src), list(dst)], dtype=torch.int64)
        else:
            idx = self._upload_indices(src, dst)
        if self.use_kernel:
            from kernels.kv_commit import kv_commit

            kv_commit(self.kv, idx[0], idx[1])  # one launch over all layers
            return
        flat = self.kv.view(self.kv.shape[0], -1, self.kv.shape[-1])  # [L, slots, width]
        flat[:, idx[1]] = flat[:, idx[0]]

    def _upload_indices(self, src: Sequence[int], dst: Sequence[int]) -> torch.Tensor:
        """[2, n] int64 on the device: one non-blocking copy from a pinned staging buffer, reused once its
        previous copy is done (an event; steps sync anyway). A fresh pinned tensor per commit cost
        ~90 us of host time per step (H200 host, py-spy 2026-11-30). The staging is flat, src then dst
        side by side: a [2, cap] buffer's [:, :n] is not contiguous, and torch copies a non-contiguous
        host tensor through a pageable temporary (~80 us per step, py-spy 2026-11-30)."""
        n = len(src)
        if self._staging is None or self._staging[0].shape[0] < 2 * n:
            cap = 2 * max(64, 1 << max(n - 1, 0).bit_length())
            self._staging = (torch.empty(cap, dtype=torch.int64, pin_memory=True),
                             torch.empty(cap, dtype=torch.int64, device=self.kv.device), torch.cuda.Event())
        host, dev, copied = self._staging
        copied.synchronize()  # returns at once if never recorded
        view = host.numpy()
        view[:n], view[n: 2 * n] = src, dst
        out = dev[: 2 * n]
        out.copy_(host[: 2 * n], non_blocking=True)
        copied.record()
        return out.view(2, n)
