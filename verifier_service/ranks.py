"""SPMD ranks of the verifier: process-group setup, spawning, and the control channel.

Rank 0 is the only network endpoint (gRPC server, scheduler, drafter client). Every target forward
and every KV copy is an op that rank 0 broadcasts over a gloo "control" group before running it
itself; ranks 1..N-1 loop on those ops, so all ranks run the same collectives in the same order
and their replicated latent caches stay identical. Accept/sampling decisions exist only on rank 0.

Launch: `ddtree verifier --world-size N` spawns ranks 1..N-1 itself (torchrun-style environment:
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); under torchrun nothing is spawned.
Collectives time out after `collective_timeout_s`, so a dead rank takes the verifier down instead
of hanging it; spawned ranks also die with their parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import os
import signal
import socket
import subprocess
import sys

import torch
import torch.distributed as dist

from service_kit.logs import get_logger

log = get_logger("verifier.ranks")
STOP = "stop"


@dataclasses.dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_env(cls) -> RankInfo | None:
        if "RANK" not in os.environ:
            return None
        return cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                   int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))


# The replicated parts' splits (vocab rows, shared-expert and dense-MLP intermediate) go in units of this
# many elements where n allows: 16 bytes of bf16, so every rank's GEMMs keep 16-byte-aligned widths. With
# K2.6's 2048/7 = 292.57 shared-expert columns, cuBLAS fell back to sm_75 / WMMA kernels at ~20 % of copy.
SPLIT_ALIGN = 8


def split_range(n: int, rank: int, size: int, align: int = 1) -> range:
    """Contiguous, as even as possible, the first ranks one larger (384/7 → 55×6 + 54). align: in units of
    that many elements when n is a multiple of it and every rank gets at least one unit (2048/7 → 296×4 + 288×3)."""
    if n % align or n // align < size:
        align = 1
    base, extra = divmod(n // align, size)
    start = (rank * base + min(rank, extra)) * align
    return range(start, start + (base + (rank < extra)) * align)


def split_rows(n: int, rank: int, size: int) -> range:
    """A replicated part's share (split_range in SPLIT_ALIGN units)."""
    return split_range(n, rank, size, SPLIT_ALIGN)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def spawn_workers(world_size: int, argv: list[str]) -> list[subprocess.Popen]:
    """Start ranks 1..N-1 running the same `ddtree verifier` command; sets rank 0's env in place."""
    port = _free_port()
    base = {**os.environ, "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    procs = []
    for r in range(1, world_size):
        env = {**base, "RANK": str(r), "LOCAL_RANK": str(r)}
        procs.append(subprocess.Popen([sys.executable, "-m", "service_kit.cli", *argv], env=env,
                                      preexec_fn=_die_with_parent))
    return procs


class Control:
    """The op channel: rank 0 `send`s, the others `recv`. Ops are small pickled tuples of CPU tensors."""

    def __init__(self, info: RankInfo, device: torch.device, timeout_s: float):
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, rank=info.rank, world_size=info.world_size, timeout=timeout)
        # Control ops always travel over gloo (CPU objects), whatever carries the activations.
        self.group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
        self.info = info

    def send(self, op: tuple) -> None:
        dist.broadcast_object_list([op], src=0, group=self.group)

    def recv(self) -> tuple:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank (a collective: all ranks must call it)."""
        out = [None] * self.info.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def close(self) -> None:
        """Leave the group. NCCL is not torn down: destroy_process_group flushes the communicators and
        never returns once collectives were captured in CUDA graphs (pytorch#115388; both ranks hung
        there on 2 H200s, and with an abort instead they still did not exit). The ranks meet at a gloo
        barrier, so none leaves while another still waits for an op; the process then ends through
        `exit_process`."""
        if not dist.is_initialized():
            return
        if self.group is None:
            dist.destroy_process_group()
            return
        dist.barrier(group=self.group)


def exit_process(code: int) -> None:
    """End a rank's process now: flush output, skip interpreter teardown (NCCL and CUDA graph
    destructors can block at exit, see Control.close); the OS reclaims the GPU."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def all_reduce(t: torch.Tensor, peers=None) -> torch.Tensor:
    """Sum over ranks (partial o_proj outputs, partial expert outputs). fp32 on CPU gloo for bf16.
    peers: the ranks' kernels/all_reduce PeerBuffers (`open_peers`); inputs it fits take the one-shot kernel."""
    if peers is not None and peers.fits(t):
        from kernels.all_reduce import one_shot_all_reduce

        return one_shot_all_reduce(t, peers)
    if t.device.type == "cpu" and t.dtype == torch.bfloat16:
        f = t.float()
        dist.all_reduce(f)
        return f.to(t.dtype)
    dist.all_reduce(t)
    return t


def open_peers(control: Control, device: torch.device, max_kb: int, timeout_s: float):
    """The one-shot all-reduce's IPC buffers (kernels/all_reduce.py) for inputs up to `max_kb` KiB, or None: on
    CPU, with max_kb 0, or where the GPUs cannot map each other's memory (NCCL then carries every sum). Every
    rank must call it (a collective)."""
    if device.type != "cuda" or max_kb <= 0:
        return None
    from kernels.all_reduce import PeerBuffers

    info = control.info
    try:
        peers = PeerBuffers.open(info.rank, info.world_size, device, control.gather, max_kb * 1024, timeout_s)
    except RuntimeError as e:  # e.g. no peer access between these GPUs
        log.warning("one_shot_all_reduce_off", rank=info.rank, error=str(e))
        peers = None
    if not all(control.gather(peers is not None)):  # all ranks one way, or a sum would wait forever
        return None
    log.info("one_shot_all_reduce_on", rank=info.rank, max_kb=max_kb)
    return peers


def all_gather_columns(sizes: list[int]):
    """-> f(t [R, sizes[rank]]) = [R, sum(sizes)]: each rank's column block, in rank order (vocab-
    parallel logits). Blocks are padded to the largest for the collective, then trimmed."""
    width = max(sizes)

    def gather(t: torch.Tensor) -> torch.Tensor:
        padded = torch.nn.functional.pad(t, (0, width - t.shape[1])).contiguous()
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded)
        return torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1)

    return gather


def worker_loop(runner, control: Control) -> None:
    """Ranks 1..N-1: run rank 0's ops until it says stop (or a collective fails)."""
    log.info("worker_ready", rank=control.info.rank)
    while True:
        op = control.recv()
        if op[0] == STOP:
            return
        runner.apply(op)


def start_ranks(config, argv: list[str]) -> tuple[RankInfo | None, list[subprocess.Popen]]:
    """-> (this process's rank, the workers it spawned). World size 1: (None, [])."""
    info = RankInfo.from_env()
    if info is None and config.world_size > 1:
        workers = spawn_workers(config.world_size, argv)
        return RankInfo.from_env(), workers
    if info is not None and info.world_size != config.world_size:
        raise ValueError(f"world_size: --world-size {config.world_size} but WORLD_SIZE={info.world_size}")
    return info, []


def watch_workers(workers: list[subprocess.Popen], on_death, period_s: float = 0.5) -> None:
    """Rank 0: a worker that exits takes the verifier down at once (no waiting for a collective timeout)."""
    import threading
    import time

    def loop() -> None:
        while True:
            dead = [(i + 1, p.returncode) for i, p in enumerate(workers) if p.poll() is not None]
            if dead:
                on_death(f"verifier rank {dead[0][0]} exited with {dead[0][1]}")
                return
            time.sleep(period_s)

    if workers:
        threading.Thread(target=loop, name="rank-watch", daemon=True).start()


def run_worker(config, info: RankInfo) -> int:
    """Ranks 1..N-1: load this rank's slice, then replay rank 0's ops until stop or failure."""
    from verifier_service.runner import Runner

    runner = Runner(config, info)
    try:
        worker_loop(runner, runner.control)
    except Exception as e:  # rank 0 died or a collective timed out: leave (no barrier with it), never hang
        log.error("worker_failed", rank=info.rank, error=repr(e))
        return 1
    runner.control.close()
    return 0
