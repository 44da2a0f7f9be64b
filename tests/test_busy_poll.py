"""service_kit/busy_poll.py: the selector spins only while events keep coming (CPU time tells), answers
readiness at once either way, and runs asyncio servers unchanged."""

from __future__ import annotations

import asyncio
import selectors
import socket
import time

from service_kit import busy_poll


def _cpu_during(fn) -> float:
    c0 = time.process_time()
    fn()
    return time.process_time() - c0


def test_selector_spins_after_an_event_and_blocks_once_traffic_stops():
    a, b = socket.socketpair()
    with a, b, busy_poll.BusyPollSelector(window_s=0.2) as sel:
        sel.register(a, selectors.EVENT_READ)
        idle = _cpu_during(lambda: sel.select(0.1))  # no event yet: blocks
        b.send(b"x")
        assert [key.fileobj for key, _ in sel.select(1.0)] == [a]
        a.recv(1)
        spun = _cpu_during(lambda: sel.select(0.1))  # right after an event: polls, burning its CPU
        time.sleep(0.2)
        later = _cpu_during(lambda: sel.select(0.1))  # the window has passed: blocks again
        b.send(b"y")
        t0 = time.monotonic()
        assert sel.select(5.0) and time.monotonic() - t0 < 1.0  # readiness answers at once
    assert idle < 0.01 and later < 0.01, (idle, later)  # a blocked select costs microseconds
    assert spun > 0.025, spun  # a 0.1 s spin, even when a loaded machine gives it a quarter of a core


def test_asyncio_servers_run_on_the_busy_poll_loop():
    async def echo_once() -> bytes:
        async def handle(reader, writer):
            writer.write(await reader.readexactly(5))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        writer.write(b"hello")
        got = await reader.readexactly(5)
        writer.close()
        server.close()
        await server.wait_closed()
        return got

    assert busy_poll.run(echo_once(), busy_poll_ms=20) == b"hello"
    assert busy_poll.run(echo_once(), busy_poll_ms=0) == b"hello"


def test_auto_spins_on_a_gpu_only():
    assert busy_poll.auto_ms(-1, "cuda") == busy_poll.auto_ms(-1, "cuda:3") == busy_poll.GPU_DEFAULT_MS > 0
    assert busy_poll.auto_ms(-1, "cpu") == 0.0
    assert busy_poll.auto_ms(5.0, "cpu") == 5.0 and busy_poll.auto_ms(0.0, "cuda") == 0.0
