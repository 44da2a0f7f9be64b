"""The verifier's view of its drafter replicas: sticky routing, per-step deadline, failover, resync.

Called from the engine's step thread: one Propose per replica per step, in parallel; either waited
for at once (`propose`) or sent ahead (`start`) and waited for in the next step (`collect`). Proposes
travel on one long-lived ProposeStream per replica (no per-call setup on the step's critical path).
A replica that advertises a framed Propose port (`DrafterInfo.propose_port`) gets the same requests
there instead (verifier_service/propose_socket.py: 0.7-1.0 ms less per step on an H200 host), unless
`transport` is "grpc". A session sticks to one replica; a replica that fails or is late marks its
sessions "no draft this step" (they verify root-only, i.e. plain AR — output unchanged). A failed
replica is marked down and its sessions move to a healthy one on their next step with `reset` + the
last `window` feature rows.
Down replicas are probed in the background and take new sessions again once they answer.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc
import torch
from grpc_health.v1 import health_pb2_grpc

from ddtree.internal.v1 import drafter_pb2 as dpb
from ddtree.internal.v1 import drafter_pb2_grpc as dpb_grpc
from service_kit.health import is_serving
from service_kit.logs import get_logger
from service_kit.server import channel_options
from service_kit.tensors import to_proto
from verifier_service.config import DRAFTER_TRANSPORTS as TRANSPORTS
from verifier_service.propose_socket import ProposeSocket
from verifier_service.propose_stream import ProposeStream

log = get_logger("verifier.drafter_client")
DRAFTER_SERVICE = "ddtree.internal.v1.Drafter"
PROBES_TO_DOWN = 2  # failed health checks in a row that mark a replica down


@dataclass
class DraftRequest:
    session_id: str
    start_position: int  # absolute position of features[0]
    features: torch.Tensor  # [n, F] bf16, rows start_position .. start_position+n-1
    root_token: int
    tree_budget: int
    chain: bool
    reset: bool = False


@dataclass
class Draft:
    tokens: list[int]
    parents: list[int]
    logprobs: list[float] = field(default_factory=list)  # log q of each node's token at its depth; [] if not sent


@dataclass
class Replica:
    address: str
    channel: grpc.Channel
    stub: dpb_grpc.DrafterStub
    health: health_pb2_grpc.HealthStub
    healthy: bool = True
    sessions: set[str] = field(default_factory=set)
    failed_probes: int = 0  # health checks failed in a row


def expand_targets(targets: tuple[str, ...]) -> list[str]:
    """host:port entries as given; `dns:///name:port` → every address the name resolves to."""
    out: list[str] = []
    for t in targets:
        if not t.startswith("dns:///"):
            out.append(t)
            continue
        host, _, port = t[len("dns:///"):].rpartition(":")
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except socket.gaierror as e:  # no replica up yet (compose starts them independently)
            log.warning("drafter_dns_unresolved", target=t, error=str(e))
            continue
        out.extend(sorted({f"{i[4][0]}:{port}" if ":" not in i[4][0] else f"[{i[4][0]}]:{port}" for i in infos}))
    return out


class DrafterClient:
    def __init__(self, targets: tuple[str, ...], *, deadline_s: float, max_message_mb: int = 512,
                 probe_period_s: float = 1.0, resolve_period_s: float = 10.0, transport: str = "framed",
                 busy_poll_s: float = 0.02):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport: {transport!r} is not one of {', '.join(TRANSPORTS)}")
        self.targets, self.resolve_period_s, self.transport = targets, resolve_period_s, transport
        self.busy_poll_s = busy_poll_s
        self.deadline_s = deadline_s
        self.max_message_bytes = max_message_mb * 2**20
        self.options = channel_options(max_message_mb)
        self.replicas: dict[str, Replica] = {}
        for address in expand_targets(targets):
            self._add(address)
        self.assignment: dict[str, Replica] = {}
        self.lock = threading.Lock()
        self._releasing: set[grpc.Future] = set()
        self._streams: dict[str, ProposeStream | ProposeSocket] = {}  # replica -> its open stream (engine thread)
        self._stop = threading.Event()
        self._probe = threading.Thread(target=self._probe_loop, args=(probe_period_s, targets), daemon=True)
        self._probe.start()

    def _add(self, address: str) -> None:
        channel = grpc.insecure_channel(address, options=self.options)
        self.replicas[address] = Replica(address, channel, dpb_grpc.DrafterStub(channel),
                                         health_pb2_grpc.HealthStub(channel))

    @property
    def enabled(self) -> bool:
        return bool(self.targets)

    def _resolve(self) -> None:
        """Re-resolve dns:/// targets: replicas added (or re-created with a new address) join."""
        for address in expand_targets(self.targets):
            if address not in self.replicas:
                log.info("drafter_discovered", replica=address)
                with self.lock:
                    self._add(address)

    def route(self, session_id: str) -> Replica | None:
        """Sticky replica of a session; a new or orphaned session goes to the least-loaded healthy one."""
        with self.lock:
            r = self.assignment.get(session_id)
            if r is not None and r.healthy:
                return r
            healthy = [x for x in self.replicas.values() if x.healthy]
            if not healthy:
                return None
            best = min(healthy, key=lambda x: (len(x.sessions), x.address))
            if r is not None:
                r.sessions.discard(session_id)
            best.sessions.add(session_id)
            self.assignment[session_id] = best
            return best

    def propose(self, requests: list[DraftRequest], replica_of: dict[str, Replica]) -> dict[str, object]:
        """One Propose per replica, waited for; returns session_id → Draft | ResyncRequired | ItemError.
        Sessions missing from the result got no draft this step (late, failed, or no replica)."""
        return self.collect(self.start(requests, replica_of))

    def start(self, requests: list[DraftRequest], replica_of: dict[str, Replica]) -> dict[str, Future]:
        """`propose` without the wait: one Propose per replica sent, replica address → its answer (a Future)."""
        deadline = time.monotonic() + self.deadline_s
        answers = {}
        for address, msg in self._messages(requests, replica_of).items():
            stream = self._streams.get(address)
            if stream is None or stream.broken:
                stream = self._streams[address] = self._open(self.replicas[address])
            answers[address] = stream.send(msg, deadline)
        return answers

    def _open(self, replica: Replica) -> ProposeStream | ProposeSocket:
        """A new Propose stream to `replica`: its framed port if it advertises one (asked each time: a
        restarted drafter may listen elsewhere), else (or if that fails) a gRPC ProposeStream."""
        if self.transport == "framed":
            try:
                port = replica.stub.GetInfo(dpb.GetDrafterInfoRequest(), timeout=2).propose_port
                if port:
                    return ProposeSocket(host_of(replica.address), port, self.max_message_bytes,
                                         busy_poll_s=self.busy_poll_s)
            except (grpc.RpcError, OSError) as e:
                log.warning("drafter_framed_port_unused", replica=replica.address, error=str(e))
        return ProposeStream(replica.stub)

    def collect(self, answers: dict[str, Future]) -> dict[str, object]:
        """Waits for `start`'s answers, each until its deadline; the same answers as `propose`."""
        results: dict[str, object] = {}
        for address, answer in answers.items():
            try:
                results.update(_answers(answer.result(timeout=max(0.0, answer.deadline - time.monotonic()))))
            except TimeoutError:
                log.warning("drafter_late", replica=address, deadline_s=self.deadline_s)
                stream = self._streams.pop(address, None)
                if stream is not None:  # its later answers would answer the wrong requests
                    stream.close()
            except grpc.RpcError as e:
                self._failed(address, e)
        return results

    @staticmethod
    def _messages(requests: list[DraftRequest], replica_of: dict[str, Replica]) -> dict[str, dpb.ProposeRequest]:
        by_replica: dict[str, list[DraftRequest]] = {}
        for req in requests:
            by_replica.setdefault(replica_of[req.session_id].address, []).append(req)
        messages = {}
        for address, reqs in by_replica.items():
            msg = messages[address] = dpb.ProposeRequest()
            for r in reqs:  # built in place: a constructor or repeated-field append copies the feature bytes
                _fill_item(msg.items.add(), r)
        return messages

    def _failed(self, address: str, e: grpc.RpcError) -> None:
        code = e.code()
        log.warning("drafter_down", replica=address, code=code.name, details=e.details())
        with self.lock:
            self.replicas[address].healthy = False

    def release(self, session_id: str) -> None:
        with self.lock:
            r = self.assignment.pop(session_id, None)
            if r is not None:
                r.sessions.discard(session_id)
        if r is not None and r.healthy:
            # Fire and forget, but hold the future until it is done: grpc cancels the call of a future
            # that is garbage-collected, and the drafter would keep the session's cache.
            fut = r.stub.Release.future(dpb.ReleaseRequest(session_id=session_id), timeout=5)
            self._releasing.add(fut)
            fut.add_done_callback(self._releasing.discard)

    def _probe_loop(self, period_s: float, targets: tuple[str, ...]) -> None:
        last_resolve = time.monotonic()
        while not self._stop.wait(period_s):
            if time.monotonic() - last_resolve > self.resolve_period_s:
                self._resolve()
                last_resolve = time.monotonic()
            self.probe()

    def probe(self) -> None:
        """One health check of every replica. Down only after PROBES_TO_DOWN failed checks in a row: a
        drafter busy in one long Propose misses a check while it is fine (a failed Propose marks it down
        at once anyway); up again at the first good check."""
        for r in list(self.replicas.values()):
            ok = is_serving(r.health, DRAFTER_SERVICE)
            r.failed_probes = 0 if ok else r.failed_probes + 1
            if ok != r.healthy and (ok or r.failed_probes >= PROBES_TO_DOWN):
                log.info("drafter_health_changed", replica=r.address, healthy=ok)
                r.healthy = ok

    def states(self) -> list[tuple[str, str, int]]:
        return [(r.address, "healthy" if r.healthy else "down", len(r.sessions)) for r in self.replicas.values()]

    def close(self) -> None:
        self._stop.set()
        for stream in self._streams.values():
            stream.close()
        for r in self.replicas.values():
            r.channel.close()


def host_of(address: str) -> str:
    """The host part of a `host:port` target ("[::1]:50053" -> "::1")."""
    return address.rpartition(":")[0].strip("[]")


def _answers(resp: dpb.ProposeResponse) -> dict[str, object]:
    out: dict[str, object] = {}
    for res in resp.results:
        kind = res.WhichOneof("outcome")
        out[res.session_id] = Draft(list(res.tree.tokens), list(res.tree.parents), list(res.tree.logprobs)) \
            if kind == "tree" else getattr(res, kind)
    return out


def _fill_item(item: dpb.ProposeItem, r: DraftRequest) -> None:
    item.session_id, item.start_position, item.root_token = r.session_id, r.start_position, r.root_token
    item.tree_budget, item.reset = r.tree_budget, r.reset
    item.mode = dpb.DRAFT_MODE_CHAIN if r.chain else dpb.DRAFT_MODE_DDTREE
    # The wire format of feature rows is bf16 whatever the verifier computes in (ProposeItem.features).
    to_proto(r.features.to(torch.bfloat16), out=item.features)
