"""verifier_service/step_trace's summary of a profiler trace, against brute force on synthetic events."""

import random

from verifier_service.step_trace import busy_time, describe, summarize


def covered_brute_force(intervals, step=0.5):
    """Length covered by the intervals, counted on a grid (the endpoints here are multiples of `step`)."""
    lo, hi = min(s for s, _ in intervals), max(e for _, e in intervals)
    n = int((hi - lo) / step)
    return step * sum(any(s <= lo + (i + 0.5) * step < e for s, e in intervals) for i in range(n))


def test_busy_time_is_the_union_of_the_intervals():
    rng = random.Random(0)
    for _ in range(50):
        intervals = []
        for _ in range(rng.randint(1, 12)):
            s = rng.randint(0, 80) / 2
            intervals.append((s, s + rng.randint(1, 30) / 2))
        assert busy_time(intervals) == covered_brute_force(intervals)
    assert busy_time([]) == 0.0


def kernel(name, ts, dur, stream=7, cat="kernel"):
    return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, args=dict(stream=stream))


def test_summary_per_step():
    # two replays of a step: a -> b (b overlaps a on another stream), then c after an idle gap; CPU events ignored
    events = []
    for t0 in (1000.0, 1100.0):
        events += [kernel("a", t0, 10), kernel("b", t0 + 5, 20, stream=9), kernel("c", t0 + 40, 5),
                   kernel("Memcpy HtoD", t0 - 3, 2, cat="gpu_memcpy"),
                   dict(ph="X", cat="cpu_op", name="aten::copy_", ts=t0, dur=500)]
    s = summarize(events, replays=2)
    assert s.span_us == (1145.0 - 997.0) / 2
    assert s.busy_us == (2 + 25 + 5) * 2 / 2  # per replay: copy 2, a|b 25, c 5
    assert s.kernels[0] == ("b", 20.0, 1.0) and s.kernels[1] == ("a", 10.0, 1.0)
    assert {k[0] for k in s.kernels} == {"a", "b", "c", "Memcpy HtoD"}
    lines = describe(s, top=2)
    assert len(lines) == 3 and "span 74.0 us" in lines[0] and "busy 32.0 us" in lines[0]
    assert lines[1].split()[1] == "20.0"


def test_summary_of_no_gpu_events():
    s = summarize([dict(ph="X", cat="cpu_op", name="x", ts=0, dur=1)], replays=3)
    assert (s.span_us, s.busy_us, s.kernels) == (0.0, 0.0, [])
