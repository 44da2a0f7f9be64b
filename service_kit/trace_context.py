"""W3C Trace Context (https://www.w3.org/TR/trace-context/) across the services' logs.

Each RPC or HTTP request continues its caller's trace, given by the `traceparent` header (gRPC metadata or HTTP),
or starts a new one. It gets a span id of its own, and every log line it causes carries `trace_id`, `span_id` and
`parent_span_id`. Calls it makes downstream (gateway -> verifier) send `traceparent` with its span as their parent.
One request's lines can then be found in every service's log and joined to the client's own trace.

    traceparent: 00-<trace_id: 32 hex>-<parent span id: 16 hex>-<flags: 2 hex, bit 0 = sampled>

Spans are not recorded or exported: the services hold no tracing SDK. The flags are passed on unchanged, and a trace
started here is marked unsampled (00).
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import secrets
from dataclasses import dataclass

import structlog

HEADER = "traceparent"
_HEX = re.compile(r"[0-9a-f]+")


@dataclass(frozen=True)
class TraceParent:
    trace_id: str  # 32 lowercase hex digits, not all zero
    span_id: str  # 16 lowercase hex digits, not all zero
    flags: str  # 2 lowercase hex digits

    def header(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{self.flags}"


_CURRENT: contextvars.ContextVar[TraceParent | None] = contextvars.ContextVar("trace_span", default=None)


def _id(text: str, n: int) -> bool:
    return len(text) == n and _HEX.fullmatch(text) is not None and text != "0" * n


def parse(value: str | None) -> TraceParent | None:
    """The header's (trace id, parent span id, flags), or None where it is absent or invalid (then a new trace
    starts, as the spec says). Versions other than 00 are read by the 00 layout; ff is invalid."""
    if not value:
        return None
    value = value.strip()
    parts = value.split("-")
    if len(parts) < 4:
        return None
    version, trace_id, span_id, flags = parts[:4]
    if len(version) != 2 or not _HEX.fullmatch(version) or version == "ff":
        return None
    if version == "00" and len(parts) != 4:  # a later version may append fields; 00 may not
        return None
    if not (_id(trace_id, 32) and _id(span_id, 16) and len(flags) == 2 and _HEX.fullmatch(flags)):
        return None
    return TraceParent(trace_id, span_id, flags)


def _new_id(n_bytes: int) -> str:
    while (v := secrets.token_hex(n_bytes)) == "0" * (2 * n_bytes):
        pass
    return v


def current() -> TraceParent | None:
    """This request's span (None outside one)."""
    return _CURRENT.get()


@contextlib.contextmanager
def span(incoming: str | None):
    """A span for the request whose `traceparent` is `incoming`: the current one for outgoing calls until the
    block ends, and trace_id / span_id / parent_span_id in the log context."""
    parent = parse(incoming)
    tp = TraceParent(parent.trace_id if parent else _new_id(16), _new_id(8), parent.flags if parent else "00")
    token = _CURRENT.set(tp)
    try:
        with structlog.contextvars.bound_contextvars(trace_id=tp.trace_id, span_id=tp.span_id,
                                                     parent_span_id=parent.span_id if parent else None):
            yield tp
    finally:
        _CURRENT.reset(token)


def outgoing() -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata for a downstream call: the current span as its parent (None outside a span)."""
    tp = _CURRENT.get()
    return None if tp is None else ((HEADER, tp.header()),)


def metadata_value(metadata, key: str = HEADER) -> str | None:
    """The first value of `key` in gRPC invocation metadata (None when absent)."""
    for item in metadata or ():
        if item[0] == key:
            return item[1] if isinstance(item[1], str) else None
    return None
