"""The drafter's framed Propose port: `ProposeRequest` → `ProposeResponse` frames (service_kit/frames.py) on
the service's event loop, next to its gRPC server. Same answers as the `ProposeStream` RPC (the same
`propose` function); the port is advertised in `GetInfo.propose_port`, and the verifier prefers it.

A connection that breaks the protocol (bad magic, a frame over the size limit, bytes that are not a
ProposeRequest) is logged and closed; so is one whose Propose raised (a device fault), like the gRPC
stream that fails with INTERNAL. Other connections and the gRPC service go on serving.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from google.protobuf.message import DecodeError

from ddtree.internal.v1 import drafter_pb2 as dpb
from service_kit.frames import MAGIC, FrameError, frame_parts, read_frame_async
from service_kit.logs import get_logger

log = get_logger("drafter.propose_socket")
MAGIC_TIMEOUT_S = 10.0  # a connection that sends no magic by then is closed


class ProposeSocketServer:
    """`propose` runs inline on the event loop, as the gRPC servicer's does (a draft is the verifier's
    critical path; a thread hand-off costs more than it saves)."""

    def __init__(self, propose: Callable[[dpb.ProposeRequest], dpb.ProposeResponse], limit_bytes: int):
        self.propose, self.limit = propose, limit_bytes
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self, host: str, port: int) -> int:
        """Listens on host:port (0 = any free port) and returns the bound port."""
        self._server = await asyncio.start_server(self._serve, host, port, limit=1 << 20)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for w in list(self._writers):
            w.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        sock = writer.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._writers.add(writer)
        try:
            await self._answer_all(reader, writer, peer)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _answer_all(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer) -> None:
        try:
            magic = await asyncio.wait_for(reader.readexactly(len(MAGIC)), MAGIC_TIMEOUT_S)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError):
            magic = b""
        if magic != MAGIC:
            log.warning("propose_socket_refused", peer=peer, reason="no protocol magic")
            return
        log.info("propose_socket_open", peer=peer)
        while True:
            try:
                payload = await read_frame_async(reader, self.limit)
                if payload is None:
                    log.info("propose_socket_closed", peer=peer)
                    return
                request = dpb.ProposeRequest.FromString(payload)
            except (FrameError, DecodeError) as e:
                log.warning("propose_socket_refused", peer=peer, reason=f"{type(e).__name__}: {e}")
                return
            try:
                response = self.propose(request)
            except Exception:
                log.exception("propose_failed", peer=peer, transport="socket")
                return
            writer.writelines(frame_parts(response.SerializeToString()))
            await writer.drain()  # returns at once unless the verifier stopped reading
