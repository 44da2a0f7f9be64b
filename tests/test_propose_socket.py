"""The framed Propose port (service_kit/frames.py): the frame codec, the drafter's server against bad
peers (each connection that breaks the protocol is closed, the port and gRPC go on serving), and the
verifier's client when the port goes away (the step gets no draft, the replica goes down, and the next
stream falls back to gRPC)."""

from __future__ import annotations

import socket
import time

import pytest
import torch
from scripted_drafter import ScriptedDrafter, ScriptedDrafterServer

from ddtree.internal.v1 import drafter_pb2 as dpb
from service_kit.frames import HEADER, MAGIC, FrameError, frame_parts, take_frames
from verifier_service.drafter_client import Draft, DraftRequest, DrafterClient, host_of
from verifier_service.propose_socket import ProposeSocket
from verifier_service.propose_stream import ProposeStream, StreamEnded

HIDDEN, LAYERS, VOCAB = 16, [0, 1], 64


def test_frames_round_trip_and_refuse_what_the_header_does_not_cover():
    small, big = b"abc", bytes(range(256)) * 8192  # 2 MiB: header and payload go out apart
    assert b"".join(frame_parts(small)) == HEADER.pack(3) + small and len(frame_parts(small)) == 1
    assert frame_parts(big)[1] is big
    wire = b"".join([*frame_parts(small), *frame_parts(b""), *frame_parts(big)])
    inbox = bytearray()
    got = []
    for at in range(0, len(wire), 100_000):  # as it arrives: partial frames wait for their rest
        inbox += wire[at: at + 100_000]
        got += take_frames(inbox, len(big))
    assert got == [small, b"", big] and inbox == bytearray()
    partial = bytearray(HEADER.pack(5) + b"ab")
    assert take_frames(partial, 10) == [] and partial == HEADER.pack(5) + b"ab"
    with pytest.raises(FrameError, match="over the limit"):
        take_frames(bytearray(HEADER.pack(11)), 10)  # refused from its header alone
    assert host_of("127.0.0.1:50053") == "127.0.0.1" and host_of("[::1]:7") == "::1" and host_of("a:1") == "a"


@pytest.fixture
def served():
    drafter = ScriptedDrafter(block_size=4, target_layer_ids=LAYERS, hidden_size=HIDDEN, vocab_size=VOCAB,
                              mask_token_id=VOCAB - 1)
    server = ScriptedDrafterServer(drafter).start()
    client = DrafterClient((server.address,), deadline_s=2.0, probe_period_s=3600)
    yield drafter, server, client
    client.close()
    server.stop()


def _propose(client: DrafterClient, sid: str, start: int, rows: int, reset: bool = False) -> dict:
    req = DraftRequest(sid, start, torch.randn(rows, HIDDEN * len(LAYERS)), root_token=3, tree_budget=4,
                       chain=False, reset=reset)
    return client.propose([req], {sid: client.route(sid)})


def _closed_by_peer(conn: socket.socket) -> bool:
    conn.settimeout(5)
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("sent", ["bad magic", "frame over the limit", "bytes that are no ProposeRequest",
                                  "an end inside a frame"])
def test_a_peer_that_breaks_the_protocol_is_closed_and_the_port_serves_on(served, sent):
    drafter, server, client = served
    bad = {"bad magic": b"HELLO-PROPOSE/1\n\n",
           "frame over the limit": MAGIC + HEADER.pack((64 << 20) + 1),
           "bytes that are no ProposeRequest": MAGIC + b"".join(frame_parts(b"\x0a\xff\x01")),
           "an end inside a frame": MAGIC + HEADER.pack(100) + b"partial"}[sent]
    with socket.create_connection(("127.0.0.1", drafter.propose_port), timeout=5) as conn:
        conn.sendall(bad)
        if sent == "an end inside a frame":
            conn.shutdown(socket.SHUT_WR)
        assert _closed_by_peer(conn), sent
    got = _propose(client, "a", 0, 2, reset=True)  # a new connection is answered
    assert isinstance(got["a"], Draft) and isinstance(client._streams[server.address], ProposeSocket)
    assert drafter.record.trees == 1


def test_a_failed_propose_closes_the_connection_and_the_client_falls_back_to_grpc(served):
    drafter, server, client = served
    assert isinstance(_propose(client, "a", 0, 2, reset=True)["a"], Draft)
    replica = client.replicas[server.address]

    def device_fault(request):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    server.framed.propose = device_fault  # the drafter logs it and closes the connection
    assert _propose(client, "a", 2, 1) == {} and not replica.healthy  # failed, not late: the replica is down
    server.stop_framed()
    replica.healthy = True  # as the next good health check would
    again = _propose(client, "a", 0, 3, reset=True)  # GetInfo still names the port, which refuses: gRPC
    assert isinstance(again["a"], Draft) and isinstance(client._streams[server.address], ProposeStream)


def test_a_response_to_nothing_breaks_the_connection():
    """A drafter that answers more than it was asked (a protocol bug) stops the connection: every answer
    after that point could belong to the wrong request."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        conn = ProposeSocket("127.0.0.1", listener.getsockname()[1], 1 << 20)
        peer, _ = listener.accept()
        with peer:
            assert peer.recv(len(MAGIC)) == MAGIC
            peer.sendall(b"".join(frame_parts(dpb.ProposeResponse().SerializeToString())))
            deadline = time.monotonic() + 5
            while not conn.broken and time.monotonic() < deadline:
                time.sleep(0.01)
            assert conn.broken
            with pytest.raises(StreamEnded, match="closed"):
                conn.send(dpb.ProposeRequest(), deadline=0).result(1)


def test_an_answer_nobody_waits_for_still_resolves(served):
    """A finished session's last Propose: its Release waits for that answer (drafting.release), and no
    step waits for it, so the connection's idle reads resolve it."""
    drafter, server, client = served
    assert isinstance(_propose(client, "a", 0, 2, reset=True)["a"], Draft)
    stream = client._streams[server.address]
    fired = []
    answer = stream.send(dpb.ProposeRequest(), deadline=0)
    answer.add_done_callback(lambda a: fired.append(a.exception()))
    deadline = time.monotonic() + 5
    while not fired and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fired == [None]


def test_a_drafter_that_stops_reading_fails_the_send_instead_of_holding_the_engine():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        conn = ProposeSocket("127.0.0.1", listener.getsockname()[1], 1 << 30, send_timeout_s=0.3)
        peer, _ = listener.accept()  # accepts, never reads
        with peer:
            big = dpb.ProposeRequest(items=[dpb.ProposeItem(session_id="s")])
            big.items[0].features.data = bytes(64 << 20)  # far more than the socket buffers hold
            t0 = time.monotonic()
            answer = conn.send(big, deadline=0)
            assert time.monotonic() - t0 < 10 and conn.broken
            with pytest.raises(StreamEnded, match="send failed"):
                answer.result(1)
