"""Length-prefixed protobuf frames over TCP: the drafter's Propose fast path.

Why not gRPC for this one call: Python gRPC costs 0.29-0.31 ms per loopback round trip of a Propose-sized
message on a 2-core CPU machine and 0.75-0.88 ms on the H200 hosts we are lent, against 0.06 and
0.14-0.17 ms for the same bytes as frames between a blocking socket and an asyncio server
(2026-11-30, docs/BENCHMARKS.md). A small target's whole AR step is ~1.5 ms, and the verifier waits on
this round trip every step. The messages stay the proto's (`ProposeRequest` → `ProposeResponse`, the
same semantics as the `ProposeStream` RPC); only gRPC's framing and threads are left out.

Byte layout of one connection (client = verifier, server = drafter):
  client → server: MAGIC (17 bytes), then requests;
  each message, both ways: uint32 little-endian byte count n, then n bytes of one serialized message.
Every request gets exactly one response, in order. There is no in-band error: a server that cannot
answer (bad magic, a frame over its size limit, bytes that do not parse, a device fault) closes the
connection, and the client fails whatever it was waiting for. No TLS: the same trust as the internal
gRPC ports (a private network).
"""

from __future__ import annotations

import asyncio
import struct

MAGIC = b"DDTREE-PROPOSE/1\n"
HEADER = struct.Struct("<I")  # the byte count of the message that follows
MAX_FRAME = (1 << 32) - 1  # what the header can say
_JOIN_BELOW = 1 << 20  # smaller messages go out in one write with their header (one copy, one syscall)


class FrameError(Exception):
    """The peer broke the framing (a size over the limit, or the connection ended inside a frame)."""


def frame_parts(payload: bytes) -> list[bytes]:
    """The bytes to write for one message, as one buffer (small) or header + payload (no copy of a big one)."""
    if len(payload) > MAX_FRAME:
        raise FrameError(f"message of {len(payload)} bytes does not fit a frame")
    header = HEADER.pack(len(payload))
    return [header + payload] if len(payload) < _JOIN_BELOW else [header, payload]


def _size(header: bytes | bytearray, limit: int) -> int:
    (n,) = HEADER.unpack_from(header)
    if n > limit:
        raise FrameError(f"frame of {n} bytes is over the limit of {limit}")
    return n


def take_frames(inbox: bytearray, limit: int) -> list[bytes]:
    """Removes every complete frame from the front of `inbox` (bytes received so far) and returns their
    messages' bytes, in order; a partial frame stays for the next call. Raises FrameError on a size over
    `limit` (as soon as its header is in)."""
    out = []
    while len(inbox) >= HEADER.size:
        n = _size(inbox, limit)
        if len(inbox) < HEADER.size + n:
            break
        out.append(bytes(inbox[HEADER.size: HEADER.size + n]))
        del inbox[: HEADER.size + n]
    return out


async def read_frame_async(reader: asyncio.StreamReader, limit: int) -> bytes | None:
    """The next message's bytes from an asyncio stream; None at a clean end between frames. Raises
    FrameError on a size over `limit` or an end inside a frame."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise FrameError("connection ended inside a frame header") from None
    n = _size(header, limit)
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as e:
        raise FrameError(f"connection ended after {len(e.partial)} of {n} frame bytes") from None
