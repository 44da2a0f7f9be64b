"""Real service processes on loopback for the end-to-end tests: start, wait for health, kill, logs.

Every service runs as `python -m service_kit.cli <service> ...` (or `ddtree serve`) in its own process
group, with its log in a file. Nothing outlives the tests: fixtures kill whole process groups in their
finalizers, an atexit hook kills whatever is still registered, and each child gets PR_SET_PDEATHSIG so
a killed pytest takes its services along (start processes from the main thread: the signal follows
the *thread* that forked). When a test of a module failed, the module's stack prints its logs' tails.

Test modules import the fixtures they use (`from stack import tiny_ckpt, ...`); there is no conftest.py.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddtree.internal.v1 import drafter_pb2 as dpb
from ddtree.internal.v1 import drafter_pb2_grpc as dpb_grpc
from ddtree.internal.v1 import verifier_pb2 as vpb
from ddtree.internal.v1 import verifier_pb2_grpc as vpb_grpc
from ddtree.v1 import generation_pb2 as pb
from ddtree.v1 import generation_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
GATEWAY, VERIFIER, DRAFTER = "ddtree.v1.Generation", "ddtree.internal.v1.Verifier", "ddtree.internal.v1.Drafter"
STARTUP_S = 90.0  # a cold start on a busy 2-core box (torch import + weights) takes ~5-10 s
SERVING = health_pb2.HealthCheckResponse.SERVING

# Exec'd in the child before the service: die with the parent (pytest), even on SIGKILL.
_PDEATHSIG = ("import ctypes, os, signal, sys; ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL); "
              "os.execv(sys.argv[1], sys.argv[1:])")


def prometheus_samples(text: str) -> dict[str, float]:
    """A /metrics page as {'name{labels}': value}."""
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines()
                                    if line and not line.startswith("#"))}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def service_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """One intra-op thread per service: three torch processes spin-waiting on 2 cores are 10-100x slower."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDTREE_")}  # only the flags we pass
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


# ---------------------------------------------------------------- processes

_LIVE: set["Proc"] = set()
_LIVE_LOCK = threading.Lock()


class Proc:
    """One child process group with its log file."""

    def __init__(self, name: str, cmd: Sequence[str], log_path: Path, *, env: dict[str, str] | None = None,
                 port: int | None = None):
        self.name, self.cmd, self.log_path, self.port = name, list(cmd), log_path, port
        self.env = env or service_env()
        self.popen: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def start(self) -> "Proc":
        assert threading.current_thread() is threading.main_thread(), "PDEATHSIG follows the forking thread"
        log = open(self.log_path, "ab")
        log.write(f"\n===== start {time.strftime('%X')}: {' '.join(self.cmd)}\n".encode())
        log.flush()
        self.popen = subprocess.Popen([sys.executable, "-c", _PDEATHSIG, *self.cmd], cwd=REPO, env=self.env,
                                      stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        log.close()
        with _LIVE_LOCK:
            _LIVE.add(self)
        return self

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        """Signal the process itself (SIGTERM for a graceful drain)."""
        if self.alive:
            self.popen.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL the whole process group (a crash, as far as peers can tell) and reap it."""
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)
        with _LIVE_LOCK:
            _LIVE.discard(self)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def group_alive(self) -> bool:
        """Whether any process of the group (e.g. `ddtree serve`'s children) still exists."""
        try:
            os.killpg(self.popen.pid, 0)
            return True
        except ProcessLookupError:
            return False

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"<no log: {e}>"
        return "\n".join(text.splitlines()[-lines:])


@atexit.register
def _kill_leftovers() -> None:
    for p in list(_LIVE):
        p.kill()


def health_status(address: str, service: str, timeout: float = 1.0) -> int | None:
    """grpc.health.v1 status of `service` at `address`, or None when it does not answer."""
    with grpc.insecure_channel(address) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                        timeout=timeout).status
        except grpc.RpcError:
            return None


def wait_until(predicate, timeout: float, what: str, period: float = 0.1, procs: Sequence[Proc] = ()):
    """Polls `predicate` until it returns a truthy value (returned) or `timeout` passes (AssertionError).
    A dead process among `procs` fails at once, with its log."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        for p in procs:
            if p.popen is not None and p.popen.poll() is not None:
                raise AssertionError(f"{p.name} exited with {p.popen.returncode} while waiting for {what}:\n"
                                     f"{p.log_tail()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(period)


def wait_serving(proc: Proc, service: str, timeout: float = STARTUP_S, watch: Sequence[Proc] = ()) -> None:
    """Until `proc` reports `service` SERVING; any process in `watch` (and proc) dying fails at once."""
    wait_until(lambda: health_status(proc.address, service) == SERVING, timeout,
               f"{proc.name} {service} SERVING", period=0.2, procs=[proc, *watch])


# ---------------------------------------------------------------- the stack

@dataclass
class Stack:
    """Drafters, a verifier and a gateway started one by one; each keeps its Proc for fault tests."""

    model: Path
    log_dir: Path
    drafters: list[Proc] = field(default_factory=list)
    verifier: Proc | None = None
    gateway: Proc | None = None
    _channels: dict[str, grpc.Channel] = field(default_factory=dict)

    def _proc(self, name: str, service: str, args: Sequence[str], port: int | None = None) -> Proc:
        port = port or free_port()
        cmd = [sys.executable, "-m", "service_kit.cli", service, "--host", HOST, "--port", str(port),
               "--log-format", "console",
               "--grace-s", "1", "--drain-timeout-s", "5", *args]
        return Proc(name, cmd, self.log_dir / f"{name}.log", port=port)

    def add_drafter(self, *extra: str, port: int | None = None, wait: bool = True) -> Proc:
        p = self._proc(f"drafter{len(self.drafters)}", "drafter",
                       ["--model", str(self.model / "drafter"), "--target-model", str(self.model),
                        "--cache-mb", "8", "--window", "1024", *extra], port).start()
        self.drafters.append(p)
        if wait:
            wait_serving(p, DRAFTER, watch=self.live_procs)
        return p

    def restart(self, p: Proc, service: str) -> None:
        """Start `p` again on its port (after a kill) and wait until it serves."""
        p.kill()
        p.start()
        wait_serving(p, service, watch=self.live_procs)

    def add_verifier(self, *extra: str, drafters: Sequence[str] | None = None, wait: bool = True,
                     adaptive: bool = False) -> Proc:
        """adaptive: the verifier's --adaptive-tree-budget. Off unless asked for: the test checkpoint's random drafter
        is of no use, so the budget would cut its trees to nothing, and the suites check that trees are verified."""
        addrs = [d.address for d in self.drafters] if drafters is None else list(drafters)
        # DDTREE_TEST_DEVICE=cuda runs the stacks' verifiers on the GPU (the end-to-end suites on a GPU machine)
        device = ["--device", os.environ["DDTREE_TEST_DEVICE"]] if os.environ.get("DDTREE_TEST_DEVICE") else []
        args = ["--model", str(self.model), "--kv-cache-mb", "8", "--max-context", "512", "--page-size", "16",
                "--max-new-tokens-limit", "256", "--adaptive-tree-budget", str(adaptive).lower(), *device,
                *[a for d in addrs for a in ("--drafter", d)], *extra]
        self.verifier = self._proc("verifier", "verifier", args).start()
        if wait:
            wait_serving(self.verifier, VERIFIER, watch=self.live_procs)
        return self.verifier

    def add_gateway(self, *extra: str, name: str = "gateway", wait: bool = True) -> Proc:
        http = [] if "--http-port" in extra else ["--http-port", "0"]  # tests that use HTTP pick a free port
        args = ["--model", str(self.model), "--verifier", self.verifier.address, *http, *extra]
        p = self._proc(name, "gateway", args)
        p.start()
        if name == "gateway":
            self.gateway = p
        if wait:
            wait_serving(p, GATEWAY, watch=self.live_procs)
        return p

    @property
    def procs(self) -> list[Proc]:
        return [p for p in (*self.drafters, self.verifier, self.gateway) if p is not None]

    @property
    def live_procs(self) -> list[Proc]:
        return [p for p in self.procs if p.alive]

    def channel(self, address: str) -> grpc.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.insecure_channel(address)
        return self._channels[address]

    @property
    def generation(self) -> pb_grpc.GenerationStub:
        return pb_grpc.GenerationStub(self.channel(self.gateway.address))

    @property
    def verifier_stub(self) -> vpb_grpc.VerifierStub:
        return vpb_grpc.VerifierStub(self.channel(self.verifier.address))

    def drafter_stub(self, i: int = 0) -> dpb_grpc.DrafterStub:
        return dpb_grpc.DrafterStub(self.channel(self.drafters[i].address))

    def verifier_info(self) -> vpb.VerifierInfo:
        return self.verifier_stub.GetInfo(vpb.GetVerifierInfoRequest(), timeout=5)

    def drafter_info(self, i: int = 0) -> dpb.DrafterInfo:
        return self.drafter_stub(i).GetInfo(dpb.GetDrafterInfoRequest(), timeout=5)

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()
        for p in self.procs:
            p.kill()


def dump_logs(request, procs: Sequence[Proc], title: str) -> None:
    """Print the tail of every log straight to the terminal (around pytest's capture)."""
    text = "\n".join(f"----- {p.name} ({p.log_path}) -----\n{p.log_tail()}" for p in procs)
    capman = request.config.pluginmanager.getplugin("capturemanager")
    ctx = capman.global_and_fixture_disabled() if capman else contextlib.nullcontext()
    with ctx:
        print(f"\n===== service logs: {title} =====\n{text}", file=sys.stderr)


@contextlib.contextmanager
def managed(request, procs_of) -> Iterator[None]:
    """Around a fixture's yield: on teardown, logs if any test failed meanwhile, then kill everything."""
    failed_before = request.session.testsfailed
    try:
        yield
    finally:
        if request.session.testsfailed > failed_before:
            dump_logs(request, procs_of(), request.node.name)
        for p in procs_of():
            p.kill()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """The `ddtree make-tiny` checkpoint (target + tokenizer + DFlash drafter), written once per session."""
    from service_kit.tools import make_tiny
    return make_tiny(tmp_path_factory.mktemp("tiny_ckpt"), seed=0)


@contextlib.contextmanager
def new_stack(request, tiny_ckpt: Path, tmp_path_factory) -> Iterator[Stack]:
    st = Stack(tiny_ckpt, tmp_path_factory.mktemp("logs"))
    with managed(request, lambda: st.procs):
        try:
            yield st
        finally:
            st.close()


# ---------------------------------------------------------------- requests

@dataclass
class Result:
    ids: list[int]
    text: str
    final: pb.Final
    chunks: int
    reasoning: str = ""  # chat input: the thinking block's text (Chunk.reasoning_text)


def gen_request(prompt: Sequence[int] | str, max_new: int = 64, *, mode: int = pb.SPEC_MODE_AR,
            budget: int | None = None, temperature: float | None = None, top_k: int | None = None,
            top_p: float | None = None, seed: int | None = None, request_id: str | None = None,
            ignore_eos: bool = True, min_p: float | None = None) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=request_id or uuid.uuid4().hex)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    req.stopping.max_new_tokens = max_new
    req.stopping.ignore_eos = ignore_eos
    req.speculation.mode = mode
    if budget is not None:
        req.speculation.tree_budget = budget
    for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seed", seed),
                        ("min_p", min_p)):
        if value is not None:
            setattr(req.sampling, name, value)
    return req


def collect(stream) -> Result:
    ids, text, reasoning, final, chunks = [], [], [], None, 0
    for msg in stream:
        if msg.HasField("chunk"):
            ids += msg.chunk.token_ids
            text.append(msg.chunk.text)
            reasoning.append(msg.chunk.reasoning_text)
            chunks += 1
        else:
            assert final is None, "two final messages"
            final = msg.final
    assert final is not None, "stream ended without a final message"
    return Result(ids, "".join(text), final, chunks, "".join(reasoning))


def generate(stub: pb_grpc.GenerationStub, req: pb.GenerateRequest, timeout: float = 120.0) -> Result:
    return collect(stub.Generate(req, timeout=timeout))


def generate_many(stub: pb_grpc.GenerationStub, reqs: Sequence[pb.GenerateRequest],
                  timeout: float = 180.0) -> list[Result | grpc.RpcError]:
    """All requests as concurrent streams (released together); an RpcError in place of a failed one."""
    start = threading.Barrier(len(reqs))

    def one(req):
        start.wait(30)
        try:
            return generate(stub, req, timeout)
        except grpc.RpcError as e:
            return e

    with ThreadPoolExecutor(len(reqs)) as pool:
        return list(pool.map(one, reqs))


def ok(results: Sequence[Result | grpc.RpcError]) -> list[Result]:
    bad = [f"{r.code().name}: {r.details()}" for r in results if isinstance(r, grpc.RpcError)]
    assert not bad, f"streams failed: {bad}"
    return list(results)


# Five prompts: token ids of several lengths (one chunked by --prefill-chunk, several pages long) and text.
PROMPTS: list[list[int] | str] = [
    [17],
    [(i * 37 + 11) % 1792 for i in range(7)],
    [(i * 53 + 5) % 1792 for i in range(45)],
    "def fibonacci(n):\n    if n < 2:",
    "The quick brown fox jumps over the lazy dog. " * 2,
]


def first_difference(a: Sequence[int], b: Sequence[int]) -> str:
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"first difference at {i}: {list(a[i:i + 5])} vs {list(b[i:i + 5])} (lengths {len(a)}, {len(b)})"


class Streaming:
    """One Generate stream consumed by a background thread, its progress visible while it runs."""

    def __init__(self, stub, req: pb.GenerateRequest, timeout: float = 120.0):
        self.req = req
        self.ids: list[int] = []
        self.final: pb.Final | None = None
        self.error: grpc.RpcError | None = None
        self.ended_at: float | None = None
        self.call = stub.Generate(req, timeout=timeout)
        self.thread = threading.Thread(target=self._consume, daemon=True)
        self.thread.start()

    def _consume(self) -> None:
        try:
            for msg in self.call:
                if msg.HasField("chunk"):
                    self.ids += msg.chunk.token_ids
                else:
                    self.final = msg.final
        except grpc.RpcError as e:
            self.error = e
        finally:
            self.ended_at = time.monotonic()

    @property
    def done(self) -> bool:
        return self.ended_at is not None

    def wait_tokens(self, n: int, timeout: float = 60.0) -> None:
        wait_until(lambda: len(self.ids) >= n or self.done, timeout, f"{n} tokens of {self.req.request_id}")
        assert not self.done, f"stream {self.req.request_id} ended after {len(self.ids)} tokens, before the test acted"

    def join(self, timeout: float = 120.0) -> "Streaming":
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"stream {self.req.request_id} still running after {timeout}s"
        return self

    def result(self, timeout: float = 120.0) -> Result:
        self.join(timeout)
        if self.error is not None:
            e = self.error
            raise AssertionError(f"stream {self.req.request_id} failed: {e.code().name}: {e.details()}")
        assert self.final is not None, "stream ended without a final message"
        return Result(list(self.ids), "", self.final, 0)
