"""One drafter replica's framed Propose connection (service_kit/frames.py), as the verifier's drafter client
uses it: the same contract as ProposeStream (`send` → an Answer, one response per request, in order,
`broken`, `close`) without gRPC's per-message threads and copies.

`send` writes the request on the caller's thread (the engine's: a Propose is a few KB of feature rows,
and a resync's window, up to hundreds of MB, is rare). Whoever waits for an Answer reads the responses
itself: `result()` polls the socket without sleeping for up to `busy_poll_s` (the engine thread stays on
its CPU; see service_kit/busy_poll.py for why that matters), then blocks in select until the Answer's
timeout. A background thread also reads every 50 ms, so that answers nobody waits for (a finished
session's, whose Release waits for them) still resolve. An ended or broken connection fails every
pending Answer with StreamEnded (an RpcError, UNAVAILABLE), as a failed stream does, so the client marks
the replica down alike.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from collections import deque

from google.protobuf.message import DecodeError

from ddtree.internal.v1 import drafter_pb2 as dpb
from service_kit.frames import MAGIC, FrameError, frame_parts, take_frames
from verifier_service.propose_stream import Answer, StreamEnded

IDLE_READ_S = 0.05  # the background read's period
# A request the drafter stops reading (a hung replica) fails after this long instead of holding the engine
# thread: a resync's window of K2.6 features (336 MiB) takes ~0.3 s on loopback.
SEND_TIMEOUT_S = 30.0
_RECV_BYTES = 1 << 20


class PolledAnswer(Answer):
    """An Answer whose waiters read its connection (no reader thread to hand it over)."""

    def __init__(self, deadline: float, conn: "ProposeSocket"):
        super().__init__(deadline)
        self._conn = conn

    def done(self) -> bool:
        if not super().done():
            self._conn.read_ready()
        return super().done()

    def result(self, timeout: float | None = None):
        self._conn.wait(self, timeout)
        return super().result(0)


class ProposeSocket:
    def __init__(self, host: str, port: int, limit_bytes: int, *, busy_poll_s: float = 0.02,
                 connect_timeout_s: float = 2.0, send_timeout_s: float = SEND_TIMEOUT_S):
        """Connects (raises OSError when the port does not answer) and sends the protocol magic."""
        self.limit, self.busy_poll_s = limit_bytes, busy_poll_s
        self._sock = socket.create_connection((host, port), timeout=connect_timeout_s)
        # Blocking sends, bounded by the kernel's send timeout (a Python-level timeout would make the
        # MSG_DONTWAIT reads wait too); reads never block (MSG_DONTWAIT, select).
        self._sock.settimeout(None)
        seconds, micros = int(send_timeout_s), int(send_timeout_s % 1 * 1e6)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", seconds, micros))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.sendall(MAGIC)
        self._pending: deque[PolledAnswer] = deque()
        self._inbox = bytearray()  # received bytes not yet parsed into responses
        self._read_lock = threading.Lock()  # one reader at a time (the waiter or the background read)
        self.broken = False
        threading.Thread(target=self._idle_reads, name="propose-socket", daemon=True).start()

    def send(self, msg: dpb.ProposeRequest, deadline: float) -> PolledAnswer:
        answer = PolledAnswer(deadline, self)
        if self.broken:
            answer.set_exception(StreamEnded("the Propose connection is closed"))
            return answer
        with self._read_lock:  # a response must never meet an empty queue
            self._pending.append(answer)
        try:
            for part in frame_parts(msg.SerializeToString()):
                self._sock.sendall(part)
        except (OSError, FrameError) as e:
            self._fail(StreamEnded(f"Propose send failed: {e}"))
        return answer

    def wait(self, answer: PolledAnswer, timeout: float | None) -> None:
        """Read until `answer` is resolved or `timeout` passes (then Future.result raises TimeoutError)."""
        now = time.monotonic()
        end = float("inf") if timeout is None else now + timeout
        spin_until = min(end, now + self.busy_poll_s)
        while not Answer.done(answer) and not self.broken:
            self.read_ready()
            now = time.monotonic()
            if Answer.done(answer) or now >= end:
                return
            if now >= spin_until:
                try:
                    select.select([self._sock], [], [], min(end - now, 1.0))
                except (OSError, ValueError) as e:  # closed under us (shutdown)
                    self._fail(StreamEnded(f"Propose connection closed: {e}"))

    def read_ready(self) -> None:
        """Resolve the Answers of every complete response that has arrived; never blocks (another reader
        at work means there is nothing to do). Answers resolve outside the lock: a done-callback may send."""
        if not self._read_lock.acquire(blocking=False):
            return
        resolved: list[tuple[PolledAnswer, dpb.ProposeResponse]] = []
        error = None
        try:
            ended = self._drain_socket()
            self._parse(resolved)
            if ended:
                error = StreamEnded("the drafter closed the Propose connection")
        except StreamEnded as e:
            error = e
        except (OSError, FrameError, DecodeError) as e:
            error = StreamEnded(f"Propose connection failed: {type(e).__name__}: {e}")
        finally:
            self._read_lock.release()
        for answer, response in resolved:
            answer.set_result(response)
        if error is not None:
            self._fail(error)

    def _drain_socket(self) -> bool:
        """Everything the socket holds into the inbox; True once the drafter has closed the connection."""
        while True:
            try:
                data = self._sock.recv(_RECV_BYTES, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return False
            if not data:
                return True
            self._inbox += data

    def _parse(self, resolved: list) -> None:
        """Complete responses in the inbox -> (answer, response) pairs, in order."""
        for payload in take_frames(self._inbox, self.limit):
            response = dpb.ProposeResponse.FromString(payload)
            if not self._pending:  # an answer to nothing: the two sides disagree, stop here
                raise StreamEnded("the drafter answered a Propose that was not sent")
            resolved.append((self._pending.popleft(), response))

    def _idle_reads(self) -> None:
        """Also notices, between steps, a drafter that closed the connection or answered out of turn."""
        while not self.broken:
            time.sleep(IDLE_READ_S)
            self.read_ready()

    def _fail(self, error: StreamEnded) -> None:
        with self._read_lock:
            self.broken = True
            pending, self._pending = list(self._pending), deque()
        for answer in pending:
            if not Answer.done(answer):
                answer.set_exception(error)
        self._shutdown()

    def _shutdown(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        """Stops the connection; answers still pending fail (nobody waits for them: a late step's)."""
        self._fail(StreamEnded("the Propose connection is closed"))
        self._sock.close()
