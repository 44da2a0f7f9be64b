"""One drafter replica's ProposeStream, as the verifier's drafter client uses it.

Requests go into a queue that gRPC's own thread writes to the stream; a reader thread hands each response
to the Answer (a Future) of the request it answers: one response per request, in order. A stream that
fails or ends fails every pending Answer with its RpcError and is `broken`; the client then opens a new one.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from concurrent.futures import Future

import grpc

from ddtree.internal.v1 import drafter_pb2 as dpb
from ddtree.internal.v1 import drafter_pb2_grpc as dpb_grpc


class Answer(Future):
    """A Propose answer to come (a ProposeResponse); late once time.monotonic() passes `deadline`."""

    def __init__(self, deadline: float):
        super().__init__()
        self.deadline = deadline


class StreamEnded(grpc.RpcError):
    """The drafter closed a ProposeStream (or a framed Propose connection) with requests unanswered."""

    def __init__(self, details: str = "ProposeStream ended with requests unanswered"):
        super().__init__(details)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details


_END = object()  # ends a stream's request iterator


class ProposeStream:
    """One replica's ProposeStream. `send` queues a request (gRPC's own thread writes it); a reader thread
    resolves each request's Answer with the next response, in order. A failed stream fails every pending
    Answer with its RpcError and is `broken`; the client opens a new one for the next step."""

    def __init__(self, stub: dpb_grpc.DrafterStub):
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: deque[Answer] = deque()
        self._lock = threading.Lock()
        self.broken = False
        self._call = stub.ProposeStream(iter(self._requests.get, _END))
        threading.Thread(target=self._read, name="propose-stream", daemon=True).start()

    def send(self, msg: dpb.ProposeRequest, deadline: float) -> Answer:
        answer = Answer(deadline)
        with self._lock:
            if self.broken:
                answer.set_exception(StreamEnded())
                return answer
            self._pending.append(answer)
        self._requests.put(msg)
        return answer

    def _read(self) -> None:
        error: grpc.RpcError = StreamEnded()
        try:
            for response in self._call:
                with self._lock:
                    answer = self._pending.popleft()
                answer.set_result(response)
        except grpc.RpcError as e:
            error = e
        with self._lock:
            self.broken = True
            pending, self._pending = list(self._pending), deque()
        for answer in pending:
            answer.set_exception(error)

    def close(self) -> None:
        self.broken = True
        self._requests.put(_END)
        self._call.cancel()
