"""Spin-then-block waiting, for the few waits on the decode step's critical path.

Why: on the virtualized GPU hosts we measure on (KVM guests), a thread that sleeps even 3 ms runs the next
few hundred microseconds of host code 3-8x slower than one that kept its CPU busy: after a 3 ms sleep a
17-row `build_plan` took 236-252 us against 53-57 back to back and 85-111 after a 3 ms spin; a 4 KB
`torch.empty` 29 us against 1.7 (H200 host, 2026-11-30, docs/BENCHMARKS.md). A speculative step waits
twice per round (the verifier for the drafter's answer, the drafter for the verifier's next request), so
each service spins for a bounded time while traffic is flowing and blocks once it stops.

`BusyPollSelector` is that for an asyncio loop: while an event came in the last `window_s`, a select first
polls without blocking (each poll releases the GIL) before it blocks for the rest of its timeout.
"""

from __future__ import annotations

import asyncio
import selectors
import time


class BusyPollSelector(selectors.DefaultSelector):
    def __init__(self, window_s: float):
        super().__init__()
        self.window_s = window_s
        self._last_event = float("-inf")  # time.monotonic() of the last select that returned events

    def select(self, timeout: float | None = None):
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        spin_until = self._last_event + self.window_s
        if deadline is not None:
            spin_until = min(spin_until, deadline)
        while time.monotonic() < spin_until:
            ready = super().select(0)
            if ready:
                self._last_event = time.monotonic()
                return ready
        if deadline is not None:
            timeout = max(0.0, deadline - time.monotonic())
        ready = super().select(timeout)
        if ready:
            self._last_event = time.monotonic()
        return ready


GPU_DEFAULT_MS = 20.0  # a step is a few ms: a loop that saw a request spins until the next one comes


def check_ms(busy_poll_ms: float) -> None:
    """A service config's validation of its `busy_poll_ms` setting (>= 0, or -1 for auto_ms's default)."""
    if busy_poll_ms < 0 and busy_poll_ms != -1:
        raise ValueError("busy_poll_ms: must be >= 0, or -1 (auto)")


def auto_ms(busy_poll_ms: float, device: str) -> float:
    """A service's `busy_poll_ms` setting -> milliseconds: -1 (auto) is GPU_DEFAULT_MS on a GPU and 0 on
    the CPU, where the services' compute needs every core."""
    if busy_poll_ms >= 0:
        return busy_poll_ms
    return 0.0 if device == "cpu" else GPU_DEFAULT_MS


def event_loop_factory(busy_poll_ms: float):
    """An asyncio loop factory (for asyncio.Runner): a busy-polling selector loop, or the default loop at 0."""
    if busy_poll_ms <= 0:
        return asyncio.new_event_loop
    return lambda: asyncio.SelectorEventLoop(BusyPollSelector(busy_poll_ms / 1000))


def run(coro, busy_poll_ms: float):
    """asyncio.run(coro) on `event_loop_factory(busy_poll_ms)`'s loop."""
    with asyncio.Runner(loop_factory=event_loop_factory(busy_poll_ms)) as runner:
        return runner.run(coro)
