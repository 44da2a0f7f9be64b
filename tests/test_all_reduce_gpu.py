"""kernels/all_reduce (one-shot over CUDA IPC) on two GPUs against its reference, torch.distributed.all_gather
summed in fp32 in rank order: exact equality (the same fp32 sums in the same order, one rounding). Run on a
2-GPU machine (tests/run_multigpu.sh); CI has no GPU: skipped there."""

import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)

from kernels.all_reduce import one_shot_all_reduce, one_shot_all_reduce_ref  # noqa: E402
from verifier_service import ranks  # noqa: E402

WORLD, H = 2, 7168
MAX_KB = 256  # 18 rows of 7168 bf16; larger inputs go to NCCL


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup(rank: int, port: int, timeout_s: float = 60.0):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    control = ranks.Control(ranks.RankInfo(rank, WORLD, rank), device, timeout_s)
    peers = ranks.open_peers(control, device, MAX_KB, timeout_s)
    assert peers is not None, "the two GPUs cannot map each other's memory"
    return device, peers


def _inputs(rank: int, call: int, shape, dtype, device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(1000 * call + rank)
    return (torch.randn(shape, generator=g, device=device) * (1 + rank)).to(dtype)


def _check(rank: int, port: int, pdl: bool) -> None:
    import kernels.all_reduce as ar

    ar.PDL = pdl  # this spawned process's module
    device, peers = _setup(rank, port)
    shapes = [(1, H), (3, H), (17, H), (8,), (4, 4), (1, 1024)]
    call = 0
    for dtype in (torch.bfloat16, torch.float32):
        for shape in shapes:
            t = _inputs(rank, call, shape, dtype, device)
            if not peers.fits(t):
                continue
            want = one_shot_all_reduce_ref(t.clone(), peers)
            got = one_shot_all_reduce(t.clone(), peers)
            assert torch.equal(got, want), (dtype, shape)  # exact: same fp32 sums, same order
            call += 1
    # back to back without a host sync, sizes changing, rank 1 late by ~1-2 ms before some calls: the
    # waiting blocks spin, the alternating halves keep a fast rank from overwriting what a slow one sums
    ins = [_inputs(rank, 100 + i, shapes[i % 3], torch.bfloat16, device) for i in range(12)]
    outs = []
    for i, t in enumerate(ins):
        if rank == 1 and i % 4 == 0:
            torch.cuda._sleep(2_000_000)
        outs.append(one_shot_all_reduce(t.clone(), peers))
    for t, got in zip(ins, outs):
        assert torch.equal(got, one_shot_all_reduce_ref(t.clone(), peers))
    _check_graph(rank, device, peers)
    _check_fallback(rank, device, peers)


def _check_graph(rank: int, device, peers) -> None:
    """Three all-reduces captured in one CUDA graph, replayed on new inputs: each replay sums anew."""
    static = [torch.zeros(s, dtype=torch.bfloat16, device=device) for s in ((1, H), (16, H), (2, H))]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for s in static:
            ranks.all_reduce(s, peers=peers)
    for replay in range(4):
        ins = [_inputs(rank, 200 + 10 * replay + j, s.shape, s.dtype, device) for j, s in enumerate(static)]
        for s, x in zip(static, ins):
            s.copy_(x)
        graph.replay()
        for s, x in zip(static, ins):
            assert torch.equal(s, one_shot_all_reduce_ref(x.clone(), peers)), replay


def _check_fallback(rank: int, device, peers) -> None:
    """What the kernel does not take goes to NCCL (integers in fp32: every summation order is exact)."""
    for shape in ((MAX_KB * 1024 // 4 + 4,), (3,)):
        assert not peers.fits(torch.empty(shape, device=device))
        t = torch.full(shape, float(rank + 1), device=device)
        assert torch.equal(ranks.all_reduce(t, peers=peers), torch.full(shape, 3.0, device=device))


def _absent_peer(rank: int, port: int) -> None:
    """Rank 1 never calls: rank 0's kernel gives up after the timeout (a device trap), it does not hang."""
    device, peers = _setup(rank, port, timeout_s=0.5)
    if rank == 1:  # alive, its buffer mapped, until rank 0 is done
        time.sleep(5)
        ranks.exit_process(0)
    t = torch.ones(1, H, dtype=torch.bfloat16, device=device)
    try:
        one_shot_all_reduce(t, peers)
        torch.cuda.synchronize(device)
    except RuntimeError:  # the trap: the context is lost, the process must end (the verifier's ranks do)
        ranks.exit_process(0)
    ranks.exit_process(3)


@pytest.mark.parametrize("pdl", [False, True])  # all_reduce.PDL
def test_one_shot_all_reduce_equals_reference(pdl):
    mp.spawn(_check, args=(_port(), pdl), nprocs=WORLD)


def test_absent_peer_fails_instead_of_hanging():
    ctx = mp.start_processes(_absent_peer, args=(_port(),), nprocs=WORLD, join=False, start_method="spawn")
    while not ctx.join(timeout=60):
        pass
    assert [p.exitcode for p in ctx.processes] == [0, 0]
