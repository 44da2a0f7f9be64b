"""Stop strings over a stream of text deltas (stop token ids are the backend's job).

Semantics, independent of how the text is chunked: generation stops at the first point of the text where
some stop string is complete, and the output is the text before that occurrence. When several stop strings
complete at that same point, the longest one (the one starting earliest) is reported. This is "stop as soon
as a stop string has been generated": a stop that would only complete later never wins, even if it starts
earlier (stops "abcd" and "bc" on "abcd" match "bc").

Text that could still turn out to be the start of a stop string is held back until it cannot.
"""

from __future__ import annotations

from typing import Iterable


class StopMatcher:
    def __init__(self, stops: Iterable[str], *, include_stop: bool = False):
        self.stops = tuple(dict.fromkeys(stops))  # de-duplicated, order kept
        if not all(isinstance(s, str) and s for s in self.stops):
            raise ValueError("stop strings must be non-empty strings")
        self.include_stop = include_stop
        # Proper prefixes of the stop strings: a held-back suffix must be one of these.
        self._prefixes = frozenset(s[:k] for s in self.stops for k in range(1, len(s)))
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1
        self._held = ""
        self.matched: str | None = None

    @property
    def held(self) -> str:
        return self._held

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Returns (text safe to emit now, the stop string if one matched). After a match the stream is
        finished: later feeds return ("", None)."""
        if self.matched is not None:
            return "", None
        text = self._held + delta
        match = self._first_match(text, len(self._held))
        if match is not None:
            start, stop = match
            self.matched, self._held = stop, ""
            return text[:start] + (stop if self.include_stop else ""), stop
        hold = self._hold_length(text)
        self._held = text[len(text) - hold:]
        return text[:len(text) - hold], None

    def flush(self) -> str:
        """End of stream without a match: the held-back text is plain output after all."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str, new_from: int) -> tuple[int, str] | None:
        # The held part holds no complete stop, so a match must end inside the new text; for one stop
        # string the earliest start is also the earliest end.
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            start = text.find(stop, max(0, new_from - len(stop) + 1))
            if start >= 0:
                key = (start + len(stop), -len(stop), stop)
                best = key if best is None or key < best else best
        if best is None:
            return None
        end, neg_len, stop = best
        return end + neg_len, stop

    def _hold_length(self, text: str) -> int:
        for k in range(min(len(text), self._max_hold), 0, -1):
            if text[-k:] in self._prefixes:
                return k
        return 0
