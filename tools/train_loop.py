"""What the target and the drafter trainers share: token windows of the corpus stream, the LR
schedule, bf16 autocast, and the resumable step schedule (how many steps fit the time budget, when
to checkpoint).
"""

from __future__ import annotations

import math
import time
from typing import Callable

import numpy as np
import torch


class Windows:
    """Non-overlapping windows of `seq + 1` tokens of a stream, in a seeded order per epoch."""

    def __init__(self, stream: np.ndarray, seq: int, device: torch.device, seed: int = 0):
        self.seq, self.seed = seq, seed
        self.count = (len(stream) - 1) // seq
        self.tokens = torch.from_numpy(stream[: self.count * seq + 1].astype(np.int64)).to(device)
        self.offsets = torch.arange(seq + 1, device=device)

    def batch(self, step: int, batch: int) -> torch.Tensor:
        """Windows step*batch .. step*batch+batch-1 of the epoch order -> [batch, seq + 1]."""
        lo, hi = step * batch, (step + 1) * batch
        e0, e1 = lo // self.count, (hi - 1) // self.count
        if e0 == e1:
            idx = self._perm(e0)[lo - e0 * self.count: hi - e0 * self.count]
        else:  # the batch spans an epoch boundary
            idx = torch.stack([self._perm(k // self.count)[k % self.count] for k in range(lo, hi)])
        starts = idx * self.seq
        return self.tokens[starts[:, None] + self.offsets]

    def _perm(self, epoch: int) -> torch.Tensor:
        if getattr(self, "_perm_epoch", None) != epoch:
            gen = torch.Generator().manual_seed(self.seed * 1000 + epoch)
            self._perm_cache, self._perm_epoch = torch.randperm(self.count, generator=gen).to(self.tokens.device), epoch
        return self._perm_cache


def heldout_windows(stream: np.ndarray, seq: int, max_windows: int) -> torch.Tensor:
    """Up to max_windows windows [N, seq + 1] evenly spread over the stream (CPU, int64)."""
    n = min((len(stream) - 1) // seq, max_windows)
    starts = np.linspace(0, (len(stream) - 1) // seq - 1, n).astype(np.int64) * seq if n else np.zeros(0, np.int64)
    return torch.from_numpy(np.stack([stream[s:s + seq + 1].astype(np.int64) for s in starts]))


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up to `peak`, then cosine decay to floor · peak at step `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


def autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_cap(epoch_steps: float, max_epochs: float, max_steps: int | None) -> int:
    """The most steps a run may take: max_epochs passes over the data, and at most max_steps."""
    cap = int(max_epochs * epoch_steps)
    return cap if max_steps is None else min(cap, max_steps)


def new_train_state() -> dict:
    """The loop's part of a checkpoint: steps done, the fixed step count (None until measured),
    training seconds so far, and the logged [step, loss] curve."""
    return {"step": 0, "total_steps": None, "elapsed_s": 0.0, "losses": []}


class StepSchedule:
    """How many steps a resumable run takes and when it checkpoints; progress lives in `state`.

    total_steps is the step cap when the cap is small (≤ 30) or there is no time budget. Otherwise it is
    fixed from the speed of 20 steps after 5 warm-up steps: as many steps as fit in time_budget_s (counted
    from the run's first start, across resumes), at most the cap. It is kept in the checkpoint.
    """

    def __init__(self, state: dict, cap: int, time_budget_s: float, ckpt_every_s: float, device: torch.device):
        self.state, self.cap, self.time_budget_s, self.ckpt_every_s = state, cap, time_budget_s, ckpt_every_s
        self.device = device
        self.t_start, self.t_ckpt = time.monotonic() - state["elapsed_s"], time.monotonic()
        self.timing_from = None  # (time, step) where the speed measurement started
        if state["total_steps"] is None and (cap <= 30 or not time_budget_s):
            state["total_steps"] = cap

    def running(self) -> bool:
        return self.state["total_steps"] is None or self.state["step"] < self.state["total_steps"]

    @property
    def lr_total(self) -> int:
        """The step count the LR schedule decays over: the cap until total_steps is fixed."""
        return self.state["total_steps"] or self.cap

    def seconds(self) -> float:
        return time.monotonic() - self.t_start

    def measure(self, step: int) -> float | None:
        """Before each step. Returns the seconds per step once: at the step that fixes total_steps."""
        if self.state["total_steps"] is not None:
            return None
        if self.timing_from is None and step >= 5:
            _sync(self.device)
            self.timing_from = (time.monotonic(), step)
        elif self.timing_from is not None and step - self.timing_from[1] >= 20:
            _sync(self.device)
            per_step = (time.monotonic() - self.timing_from[0]) / (step - self.timing_from[1])
            fit = step + int((self.time_budget_s - (time.monotonic() - self.t_start)) / per_step)
            self.state["total_steps"] = max(step, min(self.cap, fit))
            return per_step
        return None

    def advance(self, step: int) -> bool:
        """After step `step`: counts it. True when its loss is to be logged (every 50 steps, and the last)."""
        self.state["step"] = step + 1
        return step % 50 == 0 or self.state["step"] == self.state["total_steps"]

    def checkpoint(self, save: Callable[[], None]) -> None:
        """After each step: the elapsed time, and `save()` every ckpt_every_s seconds."""
        self.state["elapsed_s"] = time.monotonic() - self.t_start
        if time.monotonic() - self.t_ckpt > self.ckpt_every_s:
            save()
            self.t_ckpt = time.monotonic()
