"""Verifier across N ranks on CPU (gloo): expert-parallel + head-parallel SPMD gives the same logits
and the same greedy outputs as world size 1, and a dying rank takes the verifier down cleanly."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from stack import (REPO, GATEWAY, gen_request, generate, health_status, managed, new_stack, service_env,
                   tiny_ckpt, Streaming, wait_until)  # noqa: F401
from ddtree.v1 import generation_pb2 as pb

pytestmark = pytest.mark.slow


def forward_at(model: Path, world: int, out: Path, *extra: str) -> dict:
    port = str(__import__("stack").free_port())
    procs = []
    for r in range(world):
        env = service_env({"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
        if world == 1:
            for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
                env.pop(k)
        procs.append(subprocess.Popen([sys.executable, str(REPO / "tests" / "rank_forward.py"), str(model),
                                       str(world), str(out), *extra], env=env, cwd=REPO))
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0] * world, f"rank exit codes {codes}"
    return torch.load(out)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_direct_forward_equal_across_world_sizes(tiny_ckpt, tmp_path):
    ref = forward_at(tiny_ckpt, 1, tmp_path / "w1.pt")
    for world in (2, 3, 7):
        got = forward_at(tiny_ckpt, world, tmp_path / f"w{world}.pt")
        for key in ("prefill", "tree", "after_commit"):
            assert rel(got[key], ref[key]) < 1e-5, f"world {world} {key}: rel {rel(got[key], ref[key]):.2e}"


def test_split_replicated_parts_equal_world_size_1(tiny_ckpt, tmp_path):
    """Shared experts / dense MLP column-row split and vocab-parallel embedding + head (96 GB cards)."""
    ref = forward_at(tiny_ckpt, 1, tmp_path / "w1.pt")
    for world in (2, 3):
        got = forward_at(tiny_ckpt, world, tmp_path / f"split{world}.pt", "split")
        for key in ("prefill", "tree", "after_commit"):
            assert rel(got[key], ref[key]) < 1e-5, f"split world {world} {key}: rel {rel(got[key], ref[key]):.2e}"


def test_synthetic_split_replicated_equals_world_size_1(tmp_path):
    """`--synthetic` with `--split-replicated` (benchmarks of that layout): the random slices of every rank
    add up to the replicated model's logits."""
    ref = forward_at("synthetic:k26-mini", 1, tmp_path / "w1.pt")
    got = forward_at("synthetic:k26-mini", 3, tmp_path / "split3.pt", "split")
    for key in ("prefill", "tree", "after_commit"):
        assert rel(got[key], ref[key]) < 1e-5, f"synthetic split {key}: rel {rel(got[key], ref[key]):.2e}"


def test_expert_slices_equal_world_size_1(tiny_ckpt, tmp_path):
    """`--expert-slices 2`: each rank loads half of many experts' intermediate rows from the checkpoint (and the
    synthetic draw slices its experts the same way); the slices' outputs sum to world size 1's logits."""
    for model in (tiny_ckpt, "synthetic:k26-mini"):
        ref = forward_at(model, 1, tmp_path / "w1.pt")
        for world in (2, 3):
            got = forward_at(model, world, tmp_path / f"slices{world}.pt", "slices=2")
            for key in ("prefill", "tree", "after_commit"):
                assert rel(got[key], ref[key]) < 1e-5, f"{model} slices world {world} {key}: {rel(got[key], ref[key]):.2e}"


PROMPTS = [[3, 14, 15, 92, 65], "def main():\n    return", [271, 828, 1828, 459, 45, 235, 36]]


def run_stack(request, tiny_ckpt, tmp_path_factory, world: int, mode: int) -> list[list[int]]:
    with new_stack(request, tiny_ckpt, tmp_path_factory) as st:
        st.add_drafter()
        st.add_verifier("--world-size", str(world))
        st.add_gateway()
        return [generate(st.generation, gen_request(p, 24, mode=mode, budget=8)).ids for p in PROMPTS]


def test_greedy_outputs_equal_across_world_sizes(request, tiny_ckpt, tmp_path_factory):
    ref = run_stack(request, tiny_ckpt, tmp_path_factory, 1, pb.SPEC_MODE_AR)
    for world in (2, 3, 7):
        assert run_stack(request, tiny_ckpt, tmp_path_factory, world, pb.SPEC_MODE_DDTREE) == ref, f"world {world}"


def rank_pids(parent: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def test_killing_rank1_ends_streams_unavailable(request, tiny_ckpt, tmp_path_factory):
    with new_stack(request, tiny_ckpt, tmp_path_factory) as st:
        v = st.add_verifier("--world-size", "2", "--collective-timeout-s", "10")
        st.add_gateway()
        workers = rank_pids(v.popen.pid)
        assert len(workers) == 1, f"expected one spawned rank, found {workers}"
        s = Streaming(st.generation, gen_request([5, 6, 7], 250, mode=pb.SPEC_MODE_AR), timeout=60)
        s.wait_tokens(3)
        t0 = time.monotonic()
        os.kill(workers[0], signal.SIGKILL)
        s.join(timeout=30)
        assert isinstance(s.error, grpc.RpcError) and s.error.code() == grpc.StatusCode.UNAVAILABLE, s.error
        assert time.monotonic() - t0 < 10, "stream did not end within the collective timeout"
        assert v.wait(15) is not None, "rank 0 did not exit"
        wait_until(lambda: not v.group_alive(), 15, "every verifier rank to exit")
        wait_until(lambda: health_status(st.gateway.address, GATEWAY) != 1, 10, "gateway NOT_SERVING")
