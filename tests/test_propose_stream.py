"""The verifier's drafter client on a real gRPC server (the scripted drafter, in process): Proposes on one
long-lived ProposeStream per replica, a late answer dropping that stream, health probing that needs two
failed checks in a row, and the step's kept feature rows riding the next Propose before they enter the
session's ring (drafting.DraftPlanner)."""

from __future__ import annotations

import pytest
import torch
from grpc_health.v1 import health_pb2
from scripted_drafter import SERVICE_NAME, ScriptedDrafter, ScriptedDrafterServer

from ddtree.internal.v1.drafter_pb2 import ResyncRequired
from verifier_service.drafter_client import Draft, DraftRequest, DrafterClient
from verifier_service.drafting import DraftPlanner
from verifier_service.propose_socket import ProposeSocket
from verifier_service.propose_stream import ProposeStream
from verifier_service.session import DDTREE, GenParams, Session

HIDDEN, LAYERS, VOCAB = 16, [0, 1], 64
WIDTH = HIDDEN * len(LAYERS)


# (the drafter's transports, the client's choice) -> the stream class that carries the Proposes
TRANSPORTS = {"framed port": (True, "framed", ProposeSocket), "no framed port": (False, "framed", ProposeStream),
              "grpc chosen": (True, "grpc", ProposeStream)}


@pytest.fixture(params=list(TRANSPORTS))
def served(request):
    framed, transport, _ = TRANSPORTS[request.param]
    drafter = ScriptedDrafter(block_size=4, target_layer_ids=LAYERS, hidden_size=HIDDEN, vocab_size=VOCAB,
                              mask_token_id=VOCAB - 1)
    server = ScriptedDrafterServer(drafter, framed=framed).start()
    client = DrafterClient((server.address,), deadline_s=2.0, probe_period_s=3600,  # probes by hand
                           transport=transport)
    yield drafter, server, client
    client.close()
    server.stop()


def _stream_class(request) -> type:
    return TRANSPORTS[request.node.callspec.params["served"]][2]


def _request(sid: str, start: int, rows: int, reset: bool = False) -> DraftRequest:
    return DraftRequest(sid, start, torch.randn(rows, WIDTH), root_token=3, tree_budget=4, chain=False, reset=reset)


def _propose(client: DrafterClient, *requests: DraftRequest) -> dict:
    return client.propose(list(requests), {r.session_id: client.route(r.session_id) for r in requests})


def test_proposes_share_one_stream_and_answer_in_order(served, request):
    drafter, server, client = served
    first = _propose(client, _request("a", 0, 5, reset=True), _request("b", 0, 3, reset=True))
    assert isinstance(first["a"], Draft) and isinstance(first["b"], Draft)
    stream = client._streams[server.address]
    assert type(stream) is _stream_class(request)
    for step in range(5):  # each answer belongs to its own request: cache lengths follow the rows sent
        got = _propose(client, _request("a", 5 + step, 1))
        assert isinstance(got["a"], Draft), got
    assert client._streams[server.address] is stream and not stream.broken
    wrong = _propose(client, _request("a", 0, 1))  # not the drafter's cache length: resync, in order
    assert isinstance(wrong["a"], ResyncRequired) and wrong["a"].cache_length == 10


def test_late_answer_drops_the_stream_and_the_next_step_opens_one(served):
    drafter, server, client = served
    _propose(client, _request("a", 0, 2, reset=True))
    old = client._streams[server.address]
    client.deadline_s = 0.2
    drafter.faults.late_every, drafter.faults.late_s = 1, 0.6
    assert _propose(client, _request("a", 2, 1)) == {}  # late: no draft this step
    assert old.broken and server.address not in client._streams
    drafter.faults.late_every = 0
    client.deadline_s = 2.0
    again = _propose(client, _request("a", 0, 3, reset=True))
    assert isinstance(again["a"], Draft)
    assert client._streams[server.address] is not old
    assert client.replicas[server.address].healthy  # late is not down


def test_a_replica_goes_down_after_two_failed_health_checks(served):
    _, server, client = served
    replica = client.replicas[server.address]
    server.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    client.probe()
    assert replica.healthy, "one missed check (a drafter busy in a long Propose) must not drop it"
    client.probe()
    assert not replica.healthy and client.route("x") is None
    server.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    client.probe()
    assert replica.healthy and client.route("x") is replica


def _session(sid: str, ring_rows: int) -> Session:
    s = Session(sid, [1, 2, 3], GenParams(max_new_tokens=8, mode=DDTREE, tree_budget=4), lambda e: None, window=64)
    if ring_rows:
        s.features.append(0, torch.randn(ring_rows, WIDTH))
    s.pending = 7
    return s


class _Capture:
    """A DrafterClient stand-in for the planner's request building only (what `start` was given)."""

    def __init__(self, client: DrafterClient):
        self.client, self.replicas, self.sent = client, client.replicas, []

    def route(self, sid):
        return self.client.route(sid)

    def start(self, requests, replica_of):
        self.sent += requests
        return {}


def test_kept_rows_ride_the_next_propose_before_the_ring(served):
    _, server, client = served
    capture = _Capture(client)
    planner = DraftPlanner(capture, config=None, vocab_size=VOCAB)
    s = _session("s", ring_rows=6)
    s.drafter_replica, s.drafter_len = server.address, 6  # the drafter holds rows 0..5
    fresh = torch.randn(3, WIDTH)
    planner.send([s], {"s": (6, fresh)})
    (req,) = capture.sent
    assert not req.reset and req.start_position == 6 and torch.equal(req.features, fresh)
    assert s.features.end == 6, "the engine appends the kept rows after sending"
    s.drafter_len = 4  # the drafter is two rows behind (an earlier answer was lost): those rows first
    planner.send([s], {"s": (6, fresh)})
    assert capture.sent[-1].start_position == 4
    assert torch.equal(capture.sent[-1].features, torch.cat([s.features.rows[4:6], fresh]))


def test_a_reset_appends_the_kept_rows_first_and_resends_the_window(served):
    _, server, client = served
    capture = _Capture(client)
    planner = DraftPlanner(capture, config=None, vocab_size=VOCAB)
    s = _session("s", ring_rows=6)  # no replica yet: the first request is a reset
    fresh = torch.randn(3, WIDTH)
    planner.send([s], {"s": (6, fresh)})
    (req,) = capture.sent
    assert req.reset and req.start_position == 0 and req.features.shape[0] == 9
    assert s.features.end == 9 and torch.equal(req.features[6:], fresh)
    new = _session("n", ring_rows=0)  # a session whose first feature rows are this step's
    planner.send([new], {"n": (0, fresh)})
    assert capture.sent[-1].reset and torch.equal(capture.sent[-1].features, fresh) and new.features.end == 3
