"""Foundation acceptance (issue 2): `ddtree serve` starts the three services, each reports SERVING on
grpc.health.v1, the gateway answers GetServerInfo, malformed requests get INVALID_ARGUMENT without
hurting the service, and SIGTERM drains and stops every process within the grace period.

The module's tests share one `ddtree serve`; the SIGTERM test stops it, so it runs last (file order).
"""

from __future__ import annotations

import signal
import socket
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from stack import (DRAFTER, GATEWAY, HOST, SERVING, VERIFIER, Proc, Streaming,  # noqa: F401
                   first_difference, free_port, gen_request, generate, health_status, managed, pb, service_env,
                   tiny_ckpt, wait_until)

from ddtree.internal.v1 import drafter_pb2 as dpb
from ddtree.internal.v1 import drafter_pb2_grpc as dpb_grpc
from ddtree.internal.v1 import verifier_pb2 as vpb
from ddtree.internal.v1 import verifier_pb2_grpc as vpb_grpc
from ddtree.v1 import generation_pb2_grpc as pb_grpc
from service_kit.frames import MAGIC, frame_parts
from service_kit.tensors import to_proto
from verifier_service.propose_socket import ProposeSocket

GRACE_S = 5.0


class Served:
    def __init__(self, proc: Proc, ports: dict[str, int]):
        self.proc, self.ports = proc, ports
        self.address = {name: f"{HOST}:{port}" for name, port in ports.items()}
        self.channels = {name: grpc.insecure_channel(a) for name, a in self.address.items() if name != "http"}
        self.generation = pb_grpc.GenerationStub(self.channels["gateway"])
        self.verifier = vpb_grpc.VerifierStub(self.channels["verifier"])
        self.drafter = dpb_grpc.DrafterStub(self.channels["drafter"])

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()


@pytest.fixture(scope="module")
def served(request, tiny_ckpt, tmp_path_factory):
    ports = {name: free_port() for name in ("gateway", "verifier", "drafter", "http")}
    ddtree = Path(sys.executable).with_name("ddtree")
    cmd = [str(ddtree)] if ddtree.exists() else [sys.executable, "-m", "service_kit.cli"]
    cmd += ["serve", "--model", str(tiny_ckpt), "--host", HOST, "--grace-s", str(GRACE_S),
            "--gateway-port", str(ports["gateway"]), "--verifier-port", str(ports["verifier"]),
            "--drafter-port", str(ports["drafter"]), "--http-port", str(ports["http"])]
    env = service_env({"DDTREE_VERIFIER_KV_CACHE_MB": "8", "DDTREE_DRAFTER_CACHE_MB": "8",
                       "DDTREE_DRAFTER_WINDOW": "1024"})
    proc = Proc("ddtree-serve", cmd, tmp_path_factory.mktemp("serve") / "serve.log", env=env)
    s = Served(proc, ports)
    with managed(request, lambda: [proc]):
        proc.start()
        try:
            yield s
        finally:
            s.close()


def test_all_three_report_serving_and_server_info(served, tiny_ckpt):
    for name, service in (("drafter", DRAFTER), ("verifier", VERIFIER), ("gateway", GATEWAY)):
        wait_until(lambda: health_status(served.address[name], service) == SERVING, 90,
                   f"{service} SERVING", period=0.2, procs=[served.proc])
        assert health_status(served.address[name], "") == SERVING
    info = served.generation.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    assert info.model_name == tiny_ckpt.name and info.vocab_size == 2048 and info.version
    assert info.drafter_block_size == 8 and info.drafter_replicas == 1 and info.drafter_replicas_healthy == 1
    assert list(info.eos_token_ids) == [1793, 1794] and info.verifier_world_size == 1
    assert {"ar", "chain", "ddtree", "sampling"} <= set(info.supported_features)
    assert "openai_http" in info.supported_features  # `ddtree serve` opens the HTTP port (8000 or --http-port)
    with urllib.request.urlopen(f"http://{HOST}:{served.ports['http']}/health", timeout=5) as r:
        assert r.status == 200
    assert 1 <= info.default_tree_budget <= info.max_tree_budget and info.max_new_tokens_limit > 0
    assert info.max_context_length > 0 and info.max_concurrent_requests > 0
    assert info.default_mode == pb.SPEC_MODE_DDTREE


def _invalid(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    return e.value


def test_malformed_requests_get_invalid_argument(served):
    info = served.drafter.GetInfo(dpb.GetDrafterInfoRequest(), timeout=5)
    width = len(info.target_layer_ids) * info.target_hidden_size

    def item(sid: str, rows: torch.Tensor) -> dpb.ProposeItem:
        return dpb.ProposeItem(session_id=sid, start_position=0, features=to_proto(rows), root_token=5,
                               tree_budget=8, mode=dpb.DRAFT_MODE_DDTREE)

    good = item("foundation-good", torch.randn(3, width, dtype=torch.bfloat16))
    truncated = item("foundation-bad", torch.randn(3, width, dtype=torch.bfloat16))
    truncated.features.data = truncated.features.data[:-2]
    wrong_width = item("foundation-narrow", torch.randn(3, width - 1, dtype=torch.bfloat16))
    resp = served.drafter.Propose(dpb.ProposeRequest(items=[truncated, good, wrong_width]), timeout=10)
    outcomes = [r.WhichOneof("outcome") for r in resp.results]
    assert outcomes == ["error", "tree", "error"], resp
    assert resp.results[0].error.field == "features" and resp.results[2].error.field == "features"
    tree = resp.results[1].tree
    assert len(tree.tokens) == 8 and len(tree.logprobs) == 8 and all(lp <= 0.0 for lp in tree.logprobs)
    # a node's path score never beats its parent's: the best-first order of log-prob sums
    score = [0.0]
    for p, lp in zip(tree.parents, tree.logprobs):
        score.append(score[p] + lp)
    assert all(score[i + 1] <= score[p] for i, p in enumerate(tree.parents))
    served.drafter.Release(dpb.ReleaseRequest(session_id="foundation-good"), timeout=5)
    # The same items on one ProposeStream: per-item errors, and the stream goes on answering.
    good_stream = item("foundation-stream", torch.randn(3, width, dtype=torch.bfloat16))
    answers = served.drafter.ProposeStream(iter([dpb.ProposeRequest(items=[truncated, good_stream, wrong_width]),
                                                 dpb.ProposeRequest(items=[good])]), timeout=10)
    first, second = list(answers)
    assert [r.WhichOneof("outcome") for r in first.results] == ["error", "tree", "error"], first
    assert first.results[0].error.field == "features" and first.results[2].error.field == "features"
    assert second.results[0].WhichOneof("outcome") == "tree" and len(second.results[0].tree.tokens) == 8
    # The same items on the drafter's framed Propose port (the verifier's default transport): the same
    # answers; a peer whose bytes are no ProposeRequest is closed, and the port and gRPC serve on.
    port = served.drafter.GetInfo(dpb.GetDrafterInfoRequest(), timeout=5).propose_port
    assert port > 0
    with socket.create_connection((HOST, port), timeout=10) as bad:
        bad.sendall(MAGIC + b"".join(frame_parts(b"\xff" * 5)))
        assert bad.recv(1) == b""
    framed = ProposeSocket(HOST, port, 64 << 20)
    good_framed = item("foundation-framed", torch.randn(3, width, dtype=torch.bfloat16))
    third = framed.send(dpb.ProposeRequest(items=[truncated, good_framed, wrong_width]), deadline=0).result(10)
    framed.close()
    assert [r.WhichOneof("outcome") for r in third.results] == ["error", "tree", "error"], third
    assert third.results[0].error.field == "features" and len(third.results[1].tree.tokens) == 8
    for sid in ("foundation-stream", "foundation-good", "foundation-framed"):
        served.drafter.Release(dpb.ReleaseRequest(session_id=sid), timeout=5)
    e = _invalid(lambda: served.drafter.Release(dpb.ReleaseRequest(session_id="no-such-session"), timeout=5))
    assert "session_id" in e.details()
    assert served.drafter.GetInfo(dpb.GetDrafterInfoRequest(), timeout=5).sessions == 0

    e = _invalid(lambda: list(served.verifier.Generate(
        vpb.VerifierGenerateRequest(request_id="foundation-empty", prompt_ids=[]), timeout=10)))
    assert "prompt_ids" in e.details()
    for top, with_logprobs in ((21, True), (3, False)):  # the verifier checks top_logprobs itself too
        e = _invalid(lambda: list(served.verifier.Generate(vpb.VerifierGenerateRequest(
            request_id="foundation-top", prompt_ids=[5], return_logprobs=with_logprobs, top_logprobs=top),
            timeout=10)))
        assert "top_logprobs" in e.details()
    for field, bad in (("forced_ids", dict(forced_ids=[5, 10**6])), ("forced_after_id", dict(forced_after_id=-1)),
                       ("forced_ids", dict(forced_ids=[5] * 257)), ("min_new_tokens", dict(min_new_tokens=9)),
                       ("sampling.logit_bias[-3]", dict(sampling=pb.SamplingParams(logit_bias={-3: 1.0})))):
        e = _invalid(lambda: list(served.verifier.Generate(vpb.VerifierGenerateRequest(
            request_id="foundation-forced", prompt_ids=[5], max_new_tokens=4, **bad), timeout=10)))
        assert field in e.details(), (field, e.details())
    ok = list(served.verifier.Generate(vpb.VerifierGenerateRequest(request_id="foundation-ok", prompt_ids=[5, 6],
                                                                   max_new_tokens=3), timeout=30))
    assert ok[-1].final.completion_tokens == 3

    e = _invalid(lambda: generate(served.generation, pb.GenerateRequest(), timeout=10))
    assert "input" in e.details()
    assert len(generate(served.generation, gen_request("hello", 3)).ids) == 3


def test_sigterm_drains_and_stops_everything_within_grace(served):
    """SIGTERM to `ddtree serve` reaches every service: health goes NOT_SERVING, the in-flight stream
    finishes unchanged (the draining drafter refuses Propose: the verifier falls back to root-only
    steps), then every process exits within the grace period."""
    ref = generate(served.generation, gen_request([5, 6, 7], 120, mode=pb.SPEC_MODE_AR)).ids
    stream = Streaming(served.generation, gen_request([5, 6, 7], 120, mode=pb.SPEC_MODE_DDTREE, budget=8))
    stream.wait_tokens(2)
    t0 = time.monotonic()
    served.proc.signal(signal.SIGTERM)
    wait_until(lambda: health_status(served.address["gateway"], GATEWAY) != SERVING, 3,
               "gateway NOT_SERVING while draining", period=0.02)
    code = served.proc.wait(GRACE_S + 40)
    stopped = time.monotonic()
    assert code == 0, served.proc.log_tail()
    assert not served.proc.group_alive(), "a service process outlived `ddtree serve`"
    r = stream.result(10)  # drained, not cut
    assert r.ids == ref and r.final.finish_reason == pb.FINISH_REASON_LENGTH, first_difference(r.ids, ref)
    drained = stream.ended_at - t0
    assert stopped - max(stream.ended_at, t0) < GRACE_S, \
        f"the stack stopped {stopped - t0:.1f}s after SIGTERM, the stream ended after {drained:.1f}s (grace {GRACE_S}s)"
    for name, service in (("gateway", GATEWAY), ("verifier", VERIFIER), ("drafter", DRAFTER)):
        assert health_status(served.address[name], service) is None, f"{name} still answers"
