"""service_kit/trace_context: W3C traceparent parsing (the spec's rules, written out here), spans and their log
context, and the metadata a downstream call carries."""

import asyncio
import re

import pytest
import structlog

from service_kit import trace_context as tc

TRACE, SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@pytest.mark.parametrize("value,expected", [
    (f"00-{TRACE}-{SPAN}-01", (TRACE, SPAN, "01")),  # the spec's example
    (f"00-{TRACE}-{SPAN}-00", (TRACE, SPAN, "00")),
    (f"  00-{TRACE}-{SPAN}-01 ", (TRACE, SPAN, "01")),  # surrounding whitespace (HTTP header values)
    (f"cc-{TRACE}-{SPAN}-01-what-the-future-holds", (TRACE, SPAN, "01")),  # a later version may append fields
    (f"cc-{TRACE}-{SPAN}-01", (TRACE, SPAN, "01")),
])
def test_parse_valid(value, expected):
    tp = tc.parse(value)
    assert (tp.trace_id, tp.span_id, tp.flags) == expected


@pytest.mark.parametrize("value", [
    None, "", "00", f"00-{TRACE}-{SPAN}", f"00-{TRACE}-{SPAN}-01-extra",  # version 00 has exactly 4 fields
    f"ff-{TRACE}-{SPAN}-01",  # version ff is invalid
    f"0-{TRACE}-{SPAN}-01", f"000-{TRACE}-{SPAN}-01", f"zz-{TRACE}-{SPAN}-01",
    f"00-{TRACE.upper()}-{SPAN}-01", f"00-{TRACE}-{SPAN.upper()}-01",  # lowercase hex only
    f"00-{'0' * 32}-{SPAN}-01", f"00-{TRACE}-{'0' * 16}-01",  # all-zero ids
    f"00-{TRACE[:-1]}-{SPAN}-01", f"00-{TRACE}-{SPAN}0-01", f"00-{TRACE}-{SPAN}-1", f"00-{TRACE}-{SPAN}-0g",
    f"00-{TRACE}-{SPAN[:-1]}x-01",
])
def test_parse_invalid(value):
    assert tc.parse(value) is None


def _ids(tp):
    assert re.fullmatch(r"[0-9a-f]{32}", tp.trace_id) and tp.trace_id != "0" * 32
    assert re.fullmatch(r"[0-9a-f]{16}", tp.span_id) and tp.span_id != "0" * 16


def test_span_continues_the_callers_trace_and_binds_the_log_context():
    assert tc.current() is None and tc.outgoing() is None
    with tc.span(f"00-{TRACE}-{SPAN}-01") as tp:
        _ids(tp)
        assert tp.trace_id == TRACE and tp.span_id != SPAN and tp.flags == "01"
        assert tc.current() == tp
        assert tc.outgoing() == (("traceparent", f"00-{TRACE}-{tp.span_id}-01"),)
        assert tc.parse(tc.outgoing()[0][1]) == tp  # what the next hop reads
        ctx = structlog.contextvars.get_contextvars()
        assert (ctx["trace_id"], ctx["span_id"], ctx["parent_span_id"]) == (TRACE, tp.span_id, SPAN)
    assert tc.current() is None and tc.outgoing() is None
    assert "trace_id" not in structlog.contextvars.get_contextvars()


@pytest.mark.parametrize("incoming", [None, "garbage", f"00-{'0' * 32}-{SPAN}-01"])
def test_span_starts_a_new_unsampled_trace_without_a_valid_parent(incoming):
    with tc.span(incoming) as a, tc.span(incoming) as b:
        _ids(a), _ids(b)
        assert a.trace_id != b.trace_id and a.flags == b.flags == "00"
        assert structlog.contextvars.get_contextvars()["parent_span_id"] is None


def test_nested_spans_restore_the_outer_one():
    with tc.span(None) as outer:
        with tc.span(outer.header()) as inner:
            assert inner.trace_id == outer.trace_id and tc.current() == inner
            assert structlog.contextvars.get_contextvars()["parent_span_id"] == outer.span_id
        assert tc.current() == outer
        assert structlog.contextvars.get_contextvars()["span_id"] == outer.span_id


def test_concurrent_tasks_keep_their_own_spans():
    async def one(i):
        with tc.span(f"00-{f'{i + 1:032x}'}-{SPAN}-01"):
            await asyncio.sleep(0.01 * (3 - i))
            return tc.current().trace_id, structlog.contextvars.get_contextvars()["trace_id"]

    async def main():
        return await asyncio.gather(*(one(i) for i in range(3)))

    for i, (tid, logged) in enumerate(asyncio.run(main())):
        assert tid == logged == f"{i + 1:032x}"


def test_metadata_value():
    md = (("authorization", "Bearer x"), ("traceparent", "a"), ("traceparent", "b"), ("bin-bin", b"\x00"))
    assert tc.metadata_value(md) == "a"
    assert tc.metadata_value(md, "bin-bin") is None  # binary values are not headers of ours
    assert tc.metadata_value(None) is None and tc.metadata_value(()) is None
