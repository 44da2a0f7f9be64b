"""Faults end to end (issue 5, DESIGN §6): drafter replicas killed and restarted mid-stream, sessions
moving between replicas, the verifier killed under open gateway streams. Outputs never change."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2
from stack import (DRAFTER, GATEWAY, PROMPTS, SERVING, VERIFIER, Streaming, first_difference,  # noqa: F401
                   gen_request, generate, health_status, new_stack, pb, tiny_ckpt, wait_until)

pytestmark = pytest.mark.slow
N = 128  # long enough that a stream is still running a few steps after the kill


@pytest.fixture(scope="module")
def two(request, tiny_ckpt, tmp_path_factory):
    """Two drafter replicas behind one verifier (`--drafter` twice) and a gateway."""
    with new_stack(request, tiny_ckpt, tmp_path_factory) as st:
        st.add_drafter(wait=False)
        st.add_drafter(wait=False)
        st.add_verifier(wait=False)
        st.add_gateway()
        yield st


@pytest.fixture(scope="module")
def refs(two):
    return [generate(two.generation, gen_request(p, N, mode=pb.SPEC_MODE_AR)).ids for p in PROMPTS[:4]]


def replicas(st) -> list:
    return list(st.verifier_info().drafters)


def wait_healthy(st) -> None:
    wait_until(lambda: all(d.state == "healthy" for d in replicas(st)), 30, "every drafter replica healthy again")


def check_outputs(streams, refs) -> list:
    results = [s.result(120) for s in streams]
    for i, (r, ref) in enumerate(zip(results, refs)):
        assert r.ids == ref, f"stream {i}: {first_difference(r.ids, ref)}"
    return results


def test_sessions_spread_over_replicas_and_fail_over(two, refs):
    streams = [Streaming(two.generation, gen_request(p, N, mode=pb.SPEC_MODE_DDTREE, budget=16)) for p in PROMPTS[:4]]
    wait_until(lambda: [d.sessions for d in replicas(two)] == [2, 2], 30, "2 + 2 sessions on the two replicas")
    wait_until(lambda: [two.drafter_info(i).sessions for i in (0, 1)] == [2, 2], 10, "both drafters holding 2 caches")
    for s in streams:
        s.wait_tokens(4)
    two.drafters[1].kill()
    # The verifier notices at its next Propose and resets the moved sessions on replica 0.
    wait_until(lambda: [(d.state, d.sessions) for d in replicas(two)] == [("healthy", 4), ("down", 0)], 10,
               "replica 1 down, its sessions on replica 0")
    wait_until(lambda: two.drafter_info(0).sessions == 4, 10, "replica 0 holding the moved sessions' caches")
    info = two.generation.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    assert (info.drafter_replicas, info.drafter_replicas_healthy) == (2, 1), info
    assert not all(s.done for s in streams), "the streams ended before the failover was observed"
    results = check_outputs(streams, refs)
    assert all(r.final.spec_stats.draft_tokens > 0 for r in results)
    two.restart(two.drafters[1], DRAFTER)
    wait_healthy(two)
    wait_until(lambda: two.drafter_info(0).sessions == 0, 10, "sessions released after the streams")


def test_drafters_killed_midstream_then_restarted(two, refs):
    streams = [Streaming(two.generation, gen_request(p, N, mode=pb.SPEC_MODE_DDTREE, budget=16)) for p in PROMPTS[:2]]
    for s in streams:
        s.wait_tokens(4)
    for d in two.drafters:
        d.kill()
    results = check_outputs(streams, refs)  # finished root-only (plain AR), same tokens
    for r in results:
        s = r.final.spec_stats
        assert s.draft_unavailable_steps > 0 and s.verify_steps > s.draft_unavailable_steps, s
    for d in two.drafters:
        two.restart(d, DRAFTER)
    t0 = time.monotonic()
    wait_healthy(two)
    recovered_s = time.monotonic() - t0
    later = [generate(two.generation, gen_request(p, 32, mode=pb.SPEC_MODE_DDTREE, budget=16)) for p in PROMPTS[:2]]
    for r, ref in zip(later, refs):
        s = r.final.spec_stats
        assert r.ids == ref[:32], first_difference(r.ids, ref[:32])
        assert s.draft_tokens > 0 and s.draft_unavailable_steps <= 1, s
    assert recovered_s < 10, f"restarted drafters took {recovered_s:.1f}s to be used again"


@pytest.fixture
def lone_verifier(request, tiny_ckpt, tmp_path_factory):
    """A verifier without drafters (plain AR) and a gateway: the verifier is the process killed."""
    with new_stack(request, tiny_ckpt, tmp_path_factory) as st:
        st.add_verifier(wait=False, drafters=[])
        st.add_gateway()
        yield st


def test_verifier_killed_fails_open_streams_unavailable(lone_verifier):
    st = lone_verifier
    streams = [Streaming(st.generation, gen_request(p, 250, mode=pb.SPEC_MODE_AR)) for p in PROMPTS[:3]]
    for s in streams:
        s.wait_tokens(2)
    t0 = time.monotonic()
    st.verifier.kill()
    for s in streams:
        s.join(15)
        assert s.error is not None and s.error.code() == grpc.StatusCode.UNAVAILABLE, (s.error, len(s.ids))
        assert s.ended_at - t0 < 3.0, f"stream failed {s.ended_at - t0:.1f}s after the verifier died"
    wait_until(lambda: health_status(st.gateway.address, GATEWAY) == health_pb2.HealthCheckResponse.NOT_SERVING,
               5, "gateway health NOT_SERVING")
    with pytest.raises(grpc.RpcError) as e:
        generate(st.generation, gen_request(PROMPTS[0], 4), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
    # A verifier coming back makes the gateway serve again (a verifier without drafters has no
    # drafter layout to wait for: it serves as soon as its weights are loaded).
    t0 = time.monotonic()
    st.restart(st.verifier, VERIFIER)
    assert time.monotonic() - t0 < 20, "a verifier without drafters took long to start"
    wait_until(lambda: health_status(st.gateway.address, GATEWAY) == SERVING, 15, "gateway SERVING again")
    assert len(generate(st.generation, gen_request(PROMPTS[0], 4)).ids) == 4
