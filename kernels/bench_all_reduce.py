"""`ddtree bench all-reduce`: the verify step's all-reduce, T rows of 7168 bf16, NCCL against the one-shot kernel
(kernels/all_reduce.py), each as 50 calls back to back in one CUDA graph (as the served step replays them).
Run one process per GPU: `python -m torch.distributed.run --nproc-per-node N -m kernels.bench_all_reduce`."""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from kernels.cli import add_set_argument

CALLS = 50


def graph_us(fn, t: torch.Tensor, iters: int) -> float:
    """us per call of `fn(t)`, CALLS of them captured in one graph, replayed `iters` times."""
    for _ in range(3):  # warm-up outside the graph (NCCL's first call sets up its channels)
        fn(t)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn(t)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (iters * CALLS)


def main(args) -> int:
    from kernels import overrides
    from kernels.all_reduce import one_shot_all_reduce
    from verifier_service import ranks

    applied = overrides.apply(args.set)

    info = ranks.RankInfo.from_env()
    assert info is not None and info.world_size > 1, "run under torchrun with 2 or more processes"
    device = torch.device("cuda", info.local_rank)
    control = ranks.Control(info, device, 60.0)
    rows = [int(r) for r in args.rows.split(",")]
    peers = ranks.open_peers(control, device, max(rows) * args.hidden * 2 // 1024 + 1, 60.0)
    assert peers is not None, "these GPUs cannot map each other's memory"
    say = print if info.rank == 0 else (lambda *a, **k: None)
    say(f"# {torch.cuda.get_device_name()} x {info.world_size}, bf16 [rows, {args.hidden}], us per all-reduce "
        f"({CALLS} in one CUDA graph)" + "".join(f"; --set {a}" for a in applied))
    say(f"{'rows':>5} {'KiB':>7} {'NCCL us':>8} {'one-shot us':>11}")
    out = []
    for r in rows:
        t = torch.randn(r, args.hidden, device=device).to(torch.bfloat16)
        nccl = graph_us(dist.all_reduce, t, args.iters)
        one = graph_us(lambda x: one_shot_all_reduce(x, peers), t, args.iters)
        out.append(dict(rows=r, kib=t.nbytes / 1024, nccl_us=nccl, one_shot_us=one, ranks=info.world_size,
                        gpu=torch.cuda.get_device_name()))
        say(f"{r:>5} {t.nbytes / 1024:>7.0f} {nccl:>8.2f} {one:>11.2f}")
    if args.out and info.rank == 0:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(o) + "\n" for o in out)
    control.close()
    ranks.exit_process(0)
    return 0


def add_parser(bsub) -> None:
    p = bsub.add_parser("all-reduce", help="NCCL vs the one-shot all-reduce kernel (under torchrun, 2+ GPUs)")
    p.add_argument("--rows", default="1,8,16,32,64,128", help="T of the [T, hidden] bf16 inputs")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--iters", type=int, default=20, help="graph replays timed")
    add_set_argument(p)
    p.add_argument("--out", help="also write the rows as JSON lines here")
    p.set_defaults(func=main)


if __name__ == "__main__":
    import sys

    parser = argparse.ArgumentParser(prog="bench_all_reduce")
    add_parser(parser.add_subparsers(dest="command", required=True))
    sys.exit(main(parser.parse_args(["all-reduce", *sys.argv[1:]])))
