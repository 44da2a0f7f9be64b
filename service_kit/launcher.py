"""`ddtree serve`: the three services as separate processes on this machine, stopped together.

Ctrl-C / SIGTERM is forwarded to every child as SIGTERM (each drains), then stragglers are killed
after their grace period. A child that dies takes the stack down, so nothing is left half-running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from drafter_service.config import QUANTIZATIONS  # torch-free, like the rest of `ddtree serve`

DEFAULT_MODEL_DIRS = ("models/kimi-tiny",)
TINY_CACHE = Path(os.environ.get("DDTREE_CACHE", Path.home() / ".cache" / "ddtree")) / "tiny"


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="run gateway, verifier and drafter locally as three processes")
    p.add_argument("--model", default=os.environ.get("DDTREE_MODEL"),
                   help="target checkpoint dir (default: the shipped tiny model, else a random tiny one)")
    p.add_argument("--drafter-model", default=os.environ.get("DDTREE_DRAFTER_MODEL"),
                   help="DFlash drafter dir (default: MODEL/drafter)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--drafter-device", default=None,
                   help="the drafter's device, e.g. cuda:7 beside a 7-GPU verifier (default: --device)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--drafter-quantization", default="none", choices=QUANTIZATIONS,
                   help="the drafter's weight storage (its --quantization)")
    p.add_argument("--host", default="127.0.0.1", help="address the services bind")
    p.add_argument("--gateway-port", type=int, default=50051)
    p.add_argument("--http-port", type=int, default=8000, help="the gateway's OpenAI-compatible HTTP port (0 = off)")
    p.add_argument("--verifier-port", type=int, default=50052)
    p.add_argument("--drafter-port", type=int, default=50053)
    p.add_argument("--metrics-base-port", type=int, default=0,
                   help="gateway/verifier/drafter metrics on BASE, BASE+1, BASE+2 (0 = off)")
    p.add_argument("--verifier-world-size", type=int, default=1)
    p.add_argument("--no-drafter", action="store_true", help="start no drafter (plain AR decoding)")
    p.add_argument("--log-format", default="console", choices=("json", "console"))
    p.add_argument("--grace-s", type=float, default=5.0)
    p.set_defaults(func=serve)


def resolve_model(model: str | None) -> Path:
    if model:
        return Path(model)
    for candidate in DEFAULT_MODEL_DIRS:
        if (Path(candidate) / "config.json").exists():
            return Path(candidate)
    if not (TINY_CACHE / "config.json").exists():
        from service_kit.tools import make_tiny
        print(f"no model given: writing a random tiny checkpoint to {TINY_CACHE}", file=sys.stderr)
        make_tiny(TINY_CACHE, seed=0)
    return TINY_CACHE


def commands(args) -> list[tuple[str, list[str]]]:
    model = resolve_model(args.model)
    drafter_model = Path(args.drafter_model) if args.drafter_model else model / "drafter"
    base = [sys.executable, "-m", "service_kit.cli"]
    common = ["--host", args.host, "--log-format", args.log_format, "--grace-s", str(args.grace_s)]

    def metrics(i: int) -> list[str]:
        return ["--metrics-port", str(args.metrics_base_port + i if args.metrics_base_port else 0)]

    verifier = [*base, "verifier", "--port", str(args.verifier_port), "--model", str(model),
                "--device", args.device, "--dtype", args.dtype,
                "--world-size", str(args.verifier_world_size), *common, *metrics(1)]
    if not args.no_drafter:
        verifier += ["--drafter", f"{args.host}:{args.drafter_port}"]
    procs = [("verifier", verifier),
             ("gateway", [*base, "gateway", "--port", str(args.gateway_port), "--http-port", str(args.http_port),
                          "--model", str(model),
                          "--verifier", f"{args.host}:{args.verifier_port}", *common, *metrics(0)])]
    if not args.no_drafter:
        procs.insert(0, ("drafter", [*base, "drafter", "--port", str(args.drafter_port),
                                     "--model", str(drafter_model), "--target-model", str(model),
                                     "--device", args.drafter_device or args.device, "--dtype", args.dtype,
                                     "--quantization", args.drafter_quantization, *common, *metrics(2)]))
    return procs


def child_env(device: str) -> dict[str, str]:
    """On CPU the three torch processes share the cores: without a thread cap their OpenMP pools
    spin against each other (a 5 ms draft became 260 ms on 2 cores)."""
    env = dict(os.environ)
    if device == "cpu" and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // 3))
    return env


def serve(args) -> int:
    env = child_env(args.device)
    children = [(name, subprocess.Popen(cmd, env=env)) for name, cmd in commands(args)]
    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    while stop["signal"] is None:
        dead = [(n, p.returncode) for n, p in children if p.poll() is not None]
        if dead:
            print(f"ddtree serve: {dead[0][0]} exited with {dead[0][1]}; stopping the stack", file=sys.stderr)
            code = 1
            break
        time.sleep(0.2)
    _stop_all(children, args.grace_s + 35.0)
    return code


def _stop_all(children, timeout: float) -> None:
    for _, p in children:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for _, p in children:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
