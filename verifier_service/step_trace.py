"""`ddtree bench verify --trace DIR`: where a served verify step's GPU time goes.

A few CUDA-graph replays run under torch.profiler (CUDA activity only): the Chrome trace goes to a file (open it
in Perfetto or chrome://tracing) and a summary per step is printed:
- span: first kernel start to last kernel end over all replays, ÷ replays. It includes the host's work between
  replays (padding the plan, the graph launch), which the profiler slows down;
- busy: the union of all kernel and copy intervals over every stream, ÷ replays: the GPU time of one step;
- per kernel name: summed duration and launches per step.

Kernels launched by programmatic dependent launch become resident before their predecessor ends and wait inside
(`griddepcontrol.wait`), so their durations include that wait: they overlap, and the sums exceed the span. The
chain of one layer is read from the trace itself: kernels in start order, each with its end.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass(frozen=True)
class StepSummary:
    replays: int
    span_us: float  # first start to last end, ÷ replays (host gaps between replays included)
    busy_us: float  # union of the GPU intervals, ÷ replays
    kernels: list[tuple[str, float, float]]  # (name, summed us per replay, launches per replay), longest first


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def summarize(events: list[dict], replays: int) -> StepSummary:
    """Chrome-trace events of `replays` back-to-back replays of one step (timestamps and durations in us)."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    if not gpu:
        return StepSummary(replays, 0.0, 0.0, [])
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu]
    span = max(end for _, end in spans) - min(start for start, _ in spans)
    per_name: dict[str, list[float]] = defaultdict(list)
    for e in gpu:
        per_name[e["name"]].append(float(e["dur"]))
    kernels = sorted(((name, sum(d) / replays, len(d) / replays) for name, d in per_name.items()),
                     key=lambda k: -k[1])
    return StepSummary(replays, span / replays, busy_time(spans) / replays, kernels)


def trace_replays(run: Callable[[], object], path: str, replays: int = 5) -> StepSummary:
    """Profile `replays` calls of `run` (after one unprofiled call), write the Chrome trace to `path`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            run()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    with open(path) as f:
        return summarize(json.load(f)["traceEvents"], replays)


def describe(s: StepSummary, top: int = 12) -> list[str]:
    """The summary as comment lines for the bench's output."""
    lines = [f"#   {s.replays} profiled replays: GPU busy {s.busy_us:.1f} us per step (span {s.span_us:.1f} us "
             f"with the host's gaps); kernels by summed time per step (PDL waits included):"]
    for name, us, n in s.kernels[:top]:
        lines.append(f"#   {us:9.1f} us  {n:6.1f}x  {name[:90]}")
    return lines
