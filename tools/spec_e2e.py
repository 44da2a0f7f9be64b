"""End-to-end harness of `ddtree bench spec`: drafter, verifier and gateway as separate processes.

The three services run on loopback (as tests/stack.py starts them); every prompt goes as token ids
through the public Generate stream. The step-time split comes from the services' Prometheus
histograms: draft (the drafter's engine time), rpc (the rest of the verifier's wait for Propose),
verify, accept/commit, and the rest of the wall time (gateway, streaming, scheduling). Needs the generated gRPC stubs (imported only here).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import NamedTuple

from tools.spec_report import AR, CHAIN, DDTREE, add_speedups, format_row, mode_name, speed_fields

REPO = Path(__file__).resolve().parents[1]
# grpc.health.v1 service name of each process, in start order (the verifier needs the drafter up, etc.)
SERVICES = {"drafter": "ddtree.internal.v1.Drafter", "verifier": "ddtree.internal.v1.Verifier",
            "gateway": "ddtree.v1.Generation"}
STARTUP_TIMEOUT_S = 180


class Streamed(NamedTuple):
    """One Generate stream: its token ids and final message, seconds from the first chunk to the end
    (decode) and from the request to the end (wall); steady: seconds from the second chunk (the end of the
    first decode step, which also ships the prompt's feature rows to the drafter) to the end, and the
    tokens that came in that time."""
    ids: list[int]
    final: object  # the stream's `final` message (spec_stats)
    decode_s: float
    wall_s: float
    steady_s: float = 0.0
    steady_tokens: int = 0


def run_e2e(model_dir: str | Path, drafter_dir: str | Path, prompts: list[dict], *, modes: list[tuple[str, int]],
            temperatures: list[float], max_new: int, seed: int, device: str, dtype: str, log_dir: Path,
            drafter_device: str | None = None, drafter_dtype: str | None = None, log=print,
            response_format: str = "", adaptive_budget: bool = False) -> list[dict]:
    """Three service processes on loopback; one Generate stream per prompt and mode. The drafter runs on
    `drafter_device` (default `device`): its own GPU, as deployed, or the verifier's; in `drafter_dtype`
    (default `dtype`). `response_format`: "json_object" or a JSON Schema's text, for every request. adaptive_budget:
    the verifier's --adaptive-tree-budget (off: every mode verifies its whole budget, the sweep's fixed sizes)."""
    import grpc

    from ddtree.v1 import generation_pb2_grpc as pb_grpc

    ports = {k: _free_port() for k in ("drafter", "verifier", "gateway", "verifier_metrics", "drafter_metrics")}
    cmds = _service_commands(model_dir, drafter_dir, (drafter_device or device, device),
                             (drafter_dtype or dtype, dtype), ports, max([b for _, b in modes] + [16]), adaptive_budget)
    env = _service_env(device)
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = {}
    try:
        for name in SERVICES:
            procs[name] = _start(name, cmds[name], env, log_dir)
            _wait_serving(name, procs[name], ports[name], log_dir)
        rows = []
        with grpc.insecure_channel(f"127.0.0.1:{ports['gateway']}") as ch:
            stub = pb_grpc.GenerationStub(ch)
            gen = functools.partial(_generate, fmt=response_format)
            gen(stub, prompts[0]["ids"], DDTREE, 4, 0.0, seed, max_new)  # warm-up
            for temp in temperatures:
                ar_ids = None
                for mode, budget in modes:
                    before = _metric_sums(ports["verifier_metrics"]) | _metric_sums(ports["drafter_metrics"])
                    outs = [gen(stub, p["ids"], mode, budget, temp, seed + i, max_new)
                            for i, p in enumerate(prompts)]
                    after = _metric_sums(ports["verifier_metrics"]) | _metric_sums(ports["drafter_metrics"])
                    row = _row(outs, {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}, mode, budget, temp)
                    ids = [o.ids for o in outs]
                    if mode == AR:
                        ar_ids = ids
                    elif ar_ids is not None:
                        row.update(_divergences(ar_ids, ids))
                    rows.append(row)
                    log(format_row(row))
        add_speedups(rows)
        return rows
    finally:
        _stop(procs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _service_commands(model_dir: str | Path, drafter_dir: str | Path, devices: tuple[str, str],
                      dtypes: tuple[str, str], ports: dict[str, int], max_budget: int,
                      adaptive_budget: bool = False) -> dict[str, list[str]]:
    """devices, dtypes: (the drafter's, the verifier's)."""
    base = [sys.executable, "-m", "service_kit.cli"]
    common = ["--host", "127.0.0.1", "--log-format", "json", "--grace-s", "1"]
    return {
        "drafter": [*base, "drafter", "--port", str(ports["drafter"]), "--model", str(drafter_dir),
                    "--target-model", str(model_dir), "--device", devices[0], "--dtype", dtypes[0],
                    "--cache-mb", "32", "--max-tree-budget", str(max(max_budget, 64)),
                    "--metrics-port", str(ports["drafter_metrics"]), *common],
        "verifier": [*base, "verifier", "--port", str(ports["verifier"]), "--model", str(model_dir),
                     "--device", devices[1], "--dtype", dtypes[1], "--drafter", f"127.0.0.1:{ports['drafter']}",
                     "--kv-cache-mb", "64", "--max-tree-budget", str(max(max_budget, 64)),
                     # every mode runs the same prompts: without this the later modes would find them cached, and
                     # their drafter would see only the rows after the cached pages (docs/BENCHMARKS.md, session 23)
                     "--prefix-cache", "false", "--adaptive-tree-budget", str(adaptive_budget).lower(),
                     "--metrics-port", str(ports["verifier_metrics"]), *common],
        "gateway": [*base, "gateway", "--port", str(ports["gateway"]), "--http-port", "0", "--model", str(model_dir),
                    "--verifier", f"127.0.0.1:{ports['verifier']}", *common],
    }


def _service_env(device: str) -> dict[str, str]:
    """This environment without DDTREE_* settings (the flags decide); one thread per service on CPU."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDTREE_")}
    env.update(PYTHONUNBUFFERED="1")
    if device == "cpu":
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def _start(name: str, cmd: list[str], env: dict[str, str], log_dir: Path) -> subprocess.Popen:
    """Its own session (process group), so that _stop can signal the service and its children."""
    logf = open(log_dir / f"{name}.log", "ab")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=logf,
                            stderr=subprocess.STDOUT, start_new_session=True)
    logf.close()
    return proc


def _wait_serving(name: str, proc: subprocess.Popen, port: int, log_dir: Path) -> None:
    from service_kit.health import wait_serving

    try:
        wait_serving(f"127.0.0.1:{port}", SERVICES[name], STARTUP_TIMEOUT_S, alive=lambda: proc.poll() is None)
    except RuntimeError:
        raise RuntimeError(f"{name} exited ({proc.returncode}); see {log_dir / name}.log") from None


def _stop(procs: dict[str, subprocess.Popen]) -> None:
    """SIGTERM to every process group, then SIGKILL to any still there after 15 s."""
    for p in procs.values():
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    for p in procs.values():
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)


def _generate(stub, prompt: list[int], mode: str, budget: int, temp: float, seed: int, max_new: int,
              fmt: str = "") -> Streamed:
    """One Generate stream of exactly max_new tokens (EOS ignored), or with a response format `fmt` up to the
    complete answer's EOS; seeded sampling when temp > 0."""
    from ddtree.v1 import generation_pb2 as pb

    req = pb.GenerateRequest(request_id=uuid.uuid4().hex)
    req.token_ids.ids.extend(prompt)
    req.stopping.max_new_tokens = max_new
    req.stopping.ignore_eos = not fmt
    if fmt == "json_object":
        req.response_format.json_object = True
    elif fmt:
        req.response_format.json_schema = fmt
    req.speculation.mode = {AR: pb.SPEC_MODE_AR, CHAIN: pb.SPEC_MODE_CHAIN, DDTREE: pb.SPEC_MODE_DDTREE}[mode]
    if mode == DDTREE:
        req.speculation.tree_budget = budget
    if temp > 0:
        req.sampling.temperature = temp
        req.sampling.seed = seed
    ids, final, t0, arrivals, at_second = [], None, time.perf_counter(), [], 0
    for msg in stub.Generate(req, timeout=600):
        if msg.HasField("chunk"):
            arrivals.append(time.perf_counter())
            ids += msg.chunk.token_ids
            if len(arrivals) == 2:
                at_second = len(ids)
        else:
            final = msg.final
    end = time.perf_counter()
    steady = (end - arrivals[1], len(ids) - at_second) if len(arrivals) > 2 else (0.0, 0)
    return Streamed(ids, final, end - (arrivals[0] if arrivals else t0), end - t0, *steady)


def _metric_sums(port: int) -> dict[str, float]:
    """The ddtree_* histogram sums/counts and counter totals of one /metrics endpoint, each summed over
    its labels (e.g. both phases of ddtree_verify_step_seconds) and also kept per label set."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        name = series.split("{")[0]
        if line.startswith("ddtree_") and name.endswith(("_sum", "_count", "_total")):
            out[name] = out.get(name, 0.0) + float(value)
            if name != series:
                out[series] = float(value)
    return out


def _row(outs: list[Streamed], metrics: dict[str, float], mode: str, budget: int, temp: float) -> dict:
    """metrics: the verifier's and the drafter's /metrics change over this mode's streams."""
    steps = sum(o.final.spec_stats.verify_steps for o in outs)
    committed = sum(o.final.spec_stats.verify_steps * o.final.spec_stats.mean_acceptance_length for o in outs)
    decode_s = sum(o.decode_s for o in outs)
    decode_tokens = sum(len(o.ids) - 1 for o in outs)
    n_steps = max(metrics.get("ddtree_verify_step_seconds_count", 0.0), 1.0)
    wait = metrics.get("ddtree_draft_seconds_sum", 0.0)  # the verifier waiting for Propose
    compute = min(metrics.get('ddtree_drafter_propose_seconds_sum{phase="draft"}', 0.0), wait)
    split = {"draft": compute, "rpc": wait - compute,
             "verify": metrics.get("ddtree_verify_step_seconds_sum", 0.0),
             "accept_commit": metrics.get("ddtree_accept_commit_seconds_sum", 0.0)}
    wall = sum(o.wall_s for o in outs)
    split["other"] = max(wall - sum(split.values()), 0.0)
    return {"harness": "e2e", "mode": mode, "name": mode_name(mode, budget),
            "budget": budget if mode == DDTREE else 0, "temperature": temp, "prompts": len(outs),
            **speed_fields(steps, committed, decode_tokens, decode_s),
            "split_ms": {k: round(v / n_steps * 1e3, 3) for k, v in split.items()},
            "split_note": "draft + rpc = the verifier's wait for Propose in a step; draft = the drafter's "
                          "engine time per Propose (inject, block forward, tree build, device sync; its "
                          "ddtree_drafter_propose_seconds) up to that wait, rpc = the rest (serialization, "
                          "transport, scheduling). Propose is sent before the previous step's KV commit and "
                          "streaming, so part of the drafting overlaps accept_commit. other = wall time "
                          "outside verifier steps (gateway, streaming, prefill)"}


def _divergences(ar_ids: list[list[int]], ids: list[list[int]]) -> dict:
    """Streams that differ from AR's: the first differing position (or the shorter length)."""
    bad = [{"prompt": i, "position": next((k for k in range(min(len(a), len(b))) if a[k] != b[k]),
                                          min(len(a), len(b)))}
           for i, (a, b) in enumerate(zip(ar_ids, ids)) if a != b]
    return {"matches_ar": not bad, "divergences": bad}
