"""One drafter replica's framed Propose connection (service_kit/frames.py), as the verifier's drafter client
uses it: the same contract as ProposeStream (`send` → an Answer, one response per request, in order,
`broken`, `close`) without gRPC's per-message threads and copies.

`send` writes the request on the caller's thread (the engine's: a Propose is a few KB of feature rows,
and a resync's window, up to hundreds of MB, is rare); a reader thread resolves each Answer with the
next response frame. An ended or broken connection fails every pending Answer with StreamEnded (an
RpcError, UNAVAILABLE), as a failed stream does, so the client marks the replica down alike.
"""

from __future__ import annotations

import socket
import threading
from collections import deque

from google.protobuf.message import DecodeError

from ddtree.internal.v1 import drafter_pb2 as dpb
from service_kit.frames import MAGIC, FrameError, frame_parts, read_frame
from verifier_service.propose_stream import Answer, StreamEnded


class ProposeSocket:
    def __init__(self, host: str, port: int, limit_bytes: int, connect_timeout_s: float = 2.0):
        """Connects (raises OSError when the port does not answer) and sends the protocol magic."""
        self.limit = limit_bytes
        self._sock = socket.create_connection((host, port), timeout=connect_timeout_s)
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.sendall(MAGIC)
        self._pending: deque[Answer] = deque()
        self._lock = threading.Lock()
        self.broken = False
        threading.Thread(target=self._read, name="propose-socket", daemon=True).start()

    def send(self, msg: dpb.ProposeRequest, deadline: float) -> Answer:
        answer = Answer(deadline)
        with self._lock:
            if self.broken:
                answer.set_exception(StreamEnded("the Propose connection is closed"))
                return answer
            self._pending.append(answer)
        try:
            for part in frame_parts(msg.SerializeToString()):
                self._sock.sendall(part)
        except (OSError, FrameError) as e:
            self._fail(StreamEnded(f"Propose send failed: {e}"))
        return answer

    def _read(self) -> None:
        error = StreamEnded("the drafter closed the Propose connection with requests unanswered")
        try:
            with self._sock.makefile("rb") as stream:
                while (payload := read_frame(stream, self.limit)) is not None:
                    response = dpb.ProposeResponse.FromString(payload)
                    with self._lock:
                        answer = self._pending.popleft() if self._pending else None
                    if answer is None:  # an answer to nothing: the two sides disagree, stop here
                        error = StreamEnded("the drafter answered a Propose that was not sent")
                        break
                    answer.set_result(response)
        except (OSError, ValueError, FrameError, DecodeError) as e:  # ValueError: read after close()
            if not self.broken:
                error = StreamEnded(f"Propose connection failed: {type(e).__name__}: {e}")
        self._fail(error)

    def _fail(self, error: StreamEnded) -> None:
        with self._lock:
            self.broken = True
            pending, self._pending = list(self._pending), deque()
        for answer in pending:
            if not answer.done():
                answer.set_exception(error)
        self._shutdown()

    def _shutdown(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        """Stops the connection; answers still pending fail (nobody waits for them: a late step's)."""
        self.broken = True
        self._shutdown()
        self._sock.close()
