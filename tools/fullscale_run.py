"""Issue 10: full-dimension Kimi K2.6 + DDTree through the real services on one 8-GPU host, no checkpoint.

Starts `ddtree drafter --synthetic k26` (random Kimi DFlash drafter, GPU 0), `ddtree verifier --synthetic
k26 --world-size 7` (random 61-layer K2.6, 384 INT4 experts over GPUs 1-7, kernels + CUDA graphs) and
`ddtree gateway` with a synthetic 163,840-id Kimi-format tokenizer, then streams random token-id prompts
through the gateway for each tree size N (`--budgets`: rows verified per step, root included, as perf.md's
N; N = 1 is AR, N > 1 is DDTree with tree_budget N - 1) and each forced acceptance depth K (`--depths`: the
verifier's TEST ONLY --force-accept-depth, τ = K + 1; 0 = the random target's own acceptance, τ ≈ 1). The
switch is a start-up flag, so verifier and gateway restart once per depth; the drafter stays up. Per run:
means of the decode steps' verify / draft / accept times from the verifier's /metrics, τ, client-side
step time and tokens/s; memory per rank from GetInfo and nvidia-smi; bandwidth floors as in
reference/perf.md (tools/fullscale_report.py). Writes fullscale.json, fullscale.md (tables for
docs/BENCHMARKS.md) and the service logs under --out. A stream's first decode step also ships the
prompt's feature rows to the drafter (a per-request cost, 86 KB a row, inside the draft and step means):
keep --max-new large against --prompt-len.

On nvidia-h200-x8. The device tool carries the working tree; the image lacks structlog,
grpcio-health-checking and grpcio-reflection and has grpcio 1.84, so the cp312 wheels in the gitignored
`.whl/` (grpcio 1.85.3, structlog, grpc health/reflection, cuda-core/bindings) and the gitignored
generated stubs in protos/ddtree must travel: run with carry [".whl", "protos/ddtree"], timeout_s 600,
kind nvidia-h200-x8, and the command

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site:.:protos PYTHONUNBUFFERED=1 &&
    python3 -m tools.fullscale_run --depths 0,2 --duration-s 180 --out $OUT/a

then at once (a machine stays warm 30 s) the same with `--depths 4,6 --out $OUT/b`: one command may run
10 minutes; each of these should take ~6-7 (two verifier start-ups of ~1 min, 10-11 runs with warm-ups,
180 s of streams; a run ends its last stream, at N = 128 without acceptance one 512-token stream may
outlast its share). If the first command runs long, give the second less --duration-s. Back here: `python -m tools.fullscale_report <files_at>/a/fullscale.json
<files_at>/b/fullscale.json --out models/reports/fullscale_h200x8.json` prints the tables for
docs/BENCHMARKS.md. Services run in their own sessions with PR_SET_PDEATHSIG: they end with this script.

A dry run on `nvidia-h200-x2` (full-dimension drafter on GPU 0, an 8-layer K2.6 with all 384 experts on GPU 1;
90 s, 2026-11-30): `--gpus 0,1 --world-size 1 --layers 8 --budgets 1,16 --depths 0,4 --duration-s 40
--prompt-len 256 --max-new 256`. The steady columns leave out each stream's first decode step, which also
ships the prompt's feature rows (86 KB a row) to the drafter.

On CPU, small (tests/test_fullscale_smoke.py):
    python -m tools.fullscale_run --preset k26-mini --device cpu --world-size 2 --budgets 1,8 --duration-s 10
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from drafter_service.bench_draft import drafter_bytes
from kernels import bench
from tools import fullscale_report as report
# Process and /metrics helpers shared with `ddtree bench spec --e2e`.
from tools.spec_e2e import REPO, _free_port, _generate, _metric_sums, _service_env, _wait_serving
from tools.spec_report import AR, DDTREE

REGULAR_IDS = 163584  # random prompts use K2.6's regular (non-special) token ids
BLOCK_WAIT_S = 120.0
STOP_WAIT_S = 60.0  # drain, then the verifier's ranks stop (NCCL teardown)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tools.fullscale_run", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="k26", choices=("k26", "k26-mini"))
    p.add_argument("--layers", type=int, default=0, help="target layers (0 = the preset's: 61 for k26)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--gpus", default="0,1,2,3,4,5,6,7", help="the first runs the drafter, the next --world-size "
                   "the verifier ranks")
    p.add_argument("--world-size", type=int, default=7)
    p.add_argument("--budgets", default="1,8,16,32,64,128", help="tree sizes N, rows per verify incl. the root "
                   "(1 = AR; N > 1 = DDTree with tree_budget N - 1)")
    p.add_argument("--depths", default="0,2,4,6", help="forced acceptance depths, τ = depth + 1 (0 = off)")
    p.add_argument("--duration-s", type=float, default=300.0,
                   help="seconds of measured streaming in all, split evenly over the (tree size, depth) runs")
    p.add_argument("--prompt-len", type=int, help="random prompt tokens (default: 512 on cuda, 32 on cpu)")
    p.add_argument("--max-new", type=int, help="tokens per stream (default: 512 on cuda, 24 on cpu)")
    p.add_argument("--concurrency", type=int, default=1, help="streams in flight at once")
    p.add_argument("--kv-cache-mb", type=int, help="verifier latent KV per rank (default: 8192 on cuda, 64 on cpu)")
    p.add_argument("--split-replicated", default="true", choices=("true", "false"),
                   help="the verifier's --split-replicated (default true, as the verifier's default)")
    p.add_argument("--adaptive-budget", default="false", choices=("true", "false"),
                   help="the verifier's --adaptive-tree-budget (default false: each tree size N verifies N rows a "
                        "step; true: N is each step's most)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=".out/fullscale", help="directory for fullscale.json/.md and service logs")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    args.prompt_len = args.prompt_len or (512 if cuda else 32)
    args.max_new = args.max_new or (512 if cuda else 24)
    args.kv_cache_mb = args.kv_cache_mb or (8192 if cuda else 64)
    args.sizes = [int(x) for x in args.budgets.split(",")]
    args.depth_list = [int(x) for x in args.depths.split(",")]
    args.gpu_list = [int(x) for x in args.gpus.split(",")]
    if cuda and len(args.gpu_list) < args.world_size + 1:
        p.error(f"--gpus: {len(args.gpu_list)} given, need 1 for the drafter + {args.world_size} verifier ranks")
    return args


def runs_per_depth(sizes: list[int], depths: list[int]) -> dict[int, list[int]]:
    """depth -> the tree sizes measured with it: AR (N = 1) only unforced; a forced depth needs N > depth."""
    out = {d: [n for n in sizes if (n == 1 and d == 0) or (n > 1 and d < n)] for d in depths}
    return {d: ns for d, ns in out.items() if ns}


def service_commands(args, ports: dict[str, int], tokenizer: Path) -> dict[str, list[str]]:
    base = [sys.executable, "-m", "service_kit.cli"]
    common = ["--host", "127.0.0.1", "--log-format", "json", "--grace-s", "1"]
    cuda = args.device == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    synthetic = ["--synthetic", args.preset, "--synthetic-layers", str(args.layers)]
    gpus = [a for g in args.gpu_list[1:1 + args.world_size] for a in ("--gpus", str(g))] if cuda else []
    return {
        "drafter": [*base, "drafter", "--port", str(ports["drafter"]), *synthetic, "--dtype", dtype,
                    "--device", f"cuda:{args.gpu_list[0]}" if cuda else "cpu", "--cache-mb", "16384" if cuda else "32",
                    "--max-tree-budget", str(max(*args.sizes, 16)), *common],
        "verifier": [*base, "verifier", "--port", str(ports["verifier"]), *synthetic, "--device", args.device,
                     "--dtype", dtype, "--world-size", str(args.world_size), *gpus,
                     "--split-replicated", args.split_replicated,
                     "--drafter", f"127.0.0.1:{ports['drafter']}", "--kv-cache-mb", str(args.kv_cache_mb),
                     "--max-tree-budget", str(max(*args.sizes, 16)), "--max-batch", str(max(args.concurrency, 8)),
                     "--max-context", str(max(8192, args.prompt_len + args.max_new + 256)),
                     "--prefix-cache", "false",  # each tree size's streams start cold, as the floors assume
                     "--adaptive-tree-budget", args.adaptive_budget,  # false: every step verifies N rows
                     "--metrics-port", str(ports["metrics"]), *common],
        "gateway": [*base, "gateway", "--port", str(ports["gateway"]), "--http-port", "0", "--model", str(tokenizer),
                    "--verifier", f"127.0.0.1:{ports['verifier']}", *common],
    }


def service_env(device: str) -> dict[str, str]:
    env = _service_env(device)
    if device == "cuda":  # NVLink multicast stays off on shared hosts; nvidia-smi and CUDA agree on indices
        env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
                   CUDA_DEVICE_ORDER="PCI_BUS_ID")
    return env


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Services:
    """The three service processes; verifier and gateway restart for each forced acceptance depth."""

    def __init__(self, cmds: dict[str, list[str]], env: dict[str, str], ports: dict[str, int], log_dir: Path):
        self.cmds, self.env, self.ports, self.log_dir = cmds, env, ports, log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *extra: str) -> None:
        with open(self.log_dir / f"{name}.log", "ab") as log:  # own session: _stop signals the whole group
            self.procs[name] = subprocess.Popen([*self.cmds[name], *extra], cwd=REPO, env=self.env, stdout=log,
                                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                start_new_session=True, preexec_fn=_die_with_parent)

    def wait(self, name: str) -> None:
        _wait_serving(name, self.procs[name], self.ports[name], self.log_dir)

    def verifier_with(self, depth: int) -> None:
        """(Re)start verifier then gateway: a gateway started after the verifier connects at once (one
        that saw it go away may sit in gRPC reconnect backoff for tens of seconds)."""
        self.stop("gateway", "verifier")
        self.start("verifier", "--force-accept-depth", str(depth))
        if "drafter" not in self.procs:
            self.start("drafter")
            self.wait("drafter")
        self.wait("verifier")
        wait_drafter_layout(self.ports["verifier"])
        self.start("gateway")
        self.wait("gateway")

    def stop(self, *names: str) -> None:
        """SIGTERM to each service process itself, so that it drains (verifier rank 0 then stops its
        ranks: signalling the whole group would kill them under its feet), then SIGKILL to its group."""
        procs = [self.procs.pop(n) for n in names or list(self.procs) if n in self.procs]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_WAIT_S
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(deadline - time.monotonic(), 0.1))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def wait_drafter_layout(port: int) -> None:
    """Sessions admitted before the verifier knows the drafter's layout decode AR: wait for it."""
    import grpc

    from ddtree.internal.v1 import verifier_pb2 as vpb
    from ddtree.internal.v1 import verifier_pb2_grpc as vpb_grpc

    deadline = time.monotonic() + BLOCK_WAIT_S
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        while vpb_grpc.VerifierStub(ch).GetInfo(vpb.GetVerifierInfoRequest(), timeout=10).drafter_block_size == 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the verifier got no drafter layout in {BLOCK_WAIT_S:.0f} s")
            time.sleep(0.5)


def prompts(rng: random.Random, n: int):
    while True:
        yield [rng.randrange(REGULAR_IDS) for _ in range(n)]


def stream_for(stub, args, size: int, seconds: float, seed: str) -> tuple[list, float]:
    """Streams back to back on `--concurrency` threads until `seconds` pass (at least one per thread)
    -> (streams, wall seconds)."""
    mode, budget = (AR, 0) if size == 1 else (DDTREE, size - 1)
    t0 = time.monotonic()
    deadline = t0 + seconds

    def worker(i: int) -> list:
        source, done = prompts(random.Random(f"{seed}/{i}"), args.prompt_len), []
        while not done or time.monotonic() < deadline:
            done.append(_generate(stub, next(source), mode, budget, 0.0, 0, args.max_new))
        return done

    with ThreadPoolExecutor(args.concurrency) as pool:
        outs = [o for part in pool.map(worker, range(args.concurrency)) for o in part]
    return outs, time.monotonic() - t0


def _mean_ms(delta: dict[str, float], name: str, labels: str = "") -> float | None:
    count = delta.get(f"{name}_count{labels}", 0.0)
    return round(delta[f"{name}_sum{labels}"] / count * 1e3, 3) if count else None


def run_row(size: int, depth: int, outs: list, wall_s: float, delta: dict[str, float]) -> dict:
    """One run: the verifier's decode-step means (metric deltas) and the client's view of its streams."""
    decode = '{phase="decode"}'
    verify = _mean_ms(delta, "ddtree_verify_step_seconds", decode)
    accept = _mean_ms(delta, "ddtree_accept_commit_seconds", decode)
    draft = _mean_ms(delta, "ddtree_draft_seconds") if size > 1 else 0.0
    drafts = delta.get("ddtree_spec_decode_num_drafts_total", 0.0)
    accepted = delta.get("ddtree_spec_decode_num_accepted_tokens_total", 0.0)
    steps = sum(o.final.spec_stats.verify_steps for o in outs)
    tokens = sum(len(o.ids) - 1 for o in outs)  # the first token comes from the prefill step
    decode_s, steady_s = sum(o.decode_s for o in outs), sum(o.steady_s for o in outs)
    return {
        "tree_size": size, "tree_budget": size - 1, "name": "ar" if size == 1 else f"ddtree-{size - 1}",
        "force_depth": depth, "streams": len(outs), "tokens": tokens, "steps": steps,
        "tau": round(1 + accepted / drafts, 3) if drafts else None,
        # the adaptive budget: steps that did not wait for a tree, and the nodes a step verified
        "skipped": round(delta.get("ddtree_draft_skipped_steps_total", 0.0) / steps, 3) if steps else None,
        "nodes": round(delta.get("ddtree_spec_decode_num_draft_tokens_total", 0.0) / steps, 2) if steps else None,
        "verify_ms": verify, "draft_ms": draft, "accept_ms": accept,
        "engine_step_ms": round(sum(x or 0.0 for x in (verify, draft, accept)), 3),
        "client_step_ms": round(decode_s / steps * 1e3, 3) if steps else None,
        "tok_s": round(tokens / decode_s, 2) if decode_s else None,  # per stream
        # without each stream's first decode step (it also ships the prompt's feature rows to the drafter)
        "client_step_steady_ms": round(steady_s / (steps - len(outs)) * 1e3, 3) if steps > len(outs) else None,
        "tok_s_steady": round(sum(o.steady_tokens for o in outs) / steady_s, 2) if steady_s else None,
        "tok_s_total": round(tokens / wall_s, 2),  # all streams together (differs at --concurrency > 1)
    }


def measure(stub, args, ports: dict[str, int], size: int, depth: int, seconds: float) -> dict:
    mode, budget = (AR, 0) if size == 1 else (DDTREE, size - 1)
    warm = next(prompts(random.Random(f"{args.seed}/warm"), args.prompt_len))
    _generate(stub, warm, mode, budget, 0.0, 0, min(args.max_new, 16))  # captures this row bucket's CUDA graph
    before = _metric_sums(ports["metrics"])
    outs, wall_s = stream_for(stub, args, size, seconds, f"{args.seed}/{size}/{depth}")
    after = _metric_sums(ports["metrics"])
    row = run_row(size, depth, outs, wall_s, {k: v - before.get(k, 0.0) for k, v in after.items()})
    print(f"N={size:>4} depth={depth}: τ {row['tau']}  nodes {row['nodes']}  skipped {row['skipped']}  "
          f"verify {row['verify_ms']} ms  draft {row['draft_ms']} ms  "
          f"accept {row['accept_ms']} ms  client step {row['client_step_ms']} ms  {row['tok_s']} tok/s  "
          f"(steady {row['client_step_steady_ms']} ms, {row['tok_s_steady']} tok/s; {row['streams']} streams)",
          flush=True)
    return row


def gpu_memory() -> list[dict] | None:
    """Per GPU memory in use (nvidia-smi), or None without nvidia-smi."""
    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,"
                               "nounits"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [line.split(",") for line in text.strip().splitlines()]
    return [{"index": int(i), "used_mib": float(u), "total_mib": float(t)} for i, u, t in rows]


def process_memory(args, ports: dict[str, int]) -> list[dict]:
    """Verifier ranks from GetInfo; the drafter's weights from its preset, its KV budget from GetInfo."""
    import grpc

    from ddtree.internal.v1 import drafter_pb2 as dpb
    from ddtree.internal.v1 import drafter_pb2_grpc as dpb_grpc
    from ddtree.internal.v1 import verifier_pb2 as vpb
    from ddtree.internal.v1 import verifier_pb2_grpc as vpb_grpc
    from drafter_service.synthetic import preset_config

    with grpc.insecure_channel(f"127.0.0.1:{ports['verifier']}") as ch:
        info = vpb_grpc.VerifierStub(ch).GetInfo(vpb.GetVerifierInfoRequest(), timeout=10)
    with grpc.insecure_channel(f"127.0.0.1:{ports['drafter']}") as ch:
        dinfo = dpb_grpc.DrafterStub(ch).GetInfo(dpb.GetDrafterInfoRequest(), timeout=10)
    dcfg, item = preset_config(args.preset, args.layers), 2 if args.device == "cuda" else 4
    weights = drafter_bytes(dcfg, dinfo.vocab_size, 0, item) + item * dinfo.vocab_size * dcfg.hidden_size
    drafter = {"process": "drafter", "device": f"cuda:{args.gpu_list[0]}" if args.device == "cuda" else "cpu",
               "weight_bytes": weights, "kv_cache_bytes": dinfo.cache_bytes_budget}
    ranks = [{"process": f"verifier rank {m.rank}", "device": m.device, "weight_bytes": m.weight_bytes,
              "kv_cache_bytes": m.kv_cache_bytes} for m in info.memory]
    return [drafter, *ranks]


def copy_bandwidth(args) -> float:
    """Measured on a verifier GPU in a child process, before the services take the memory."""
    if args.device == "cpu":
        return bench.copy_bandwidth("cpu")
    code = "from kernels.bench import copy_bandwidth; print(copy_bandwidth('cuda'))"
    env = {**service_env("cuda"), "CUDA_VISIBLE_DEVICES": str(args.gpu_list[1])}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, check=True)
    return float(done.stdout.split()[-1])


def hardware(args) -> str:
    if args.device == "cpu":
        return f"CPU ({os.cpu_count()} cores)"
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        names = []
    if not names:
        return "unknown GPUs"
    name, _, driver = names[0].partition(", ")
    return f"{len(names)}× {name} (driver {driver})"


def measure_all(args, services: Services, ports: dict[str, int]) -> tuple[list[dict], list[dict], list | None]:
    """-> (rows of every run, memory per process, GPU memory) with the services running; stops them."""
    import grpc

    from ddtree.v1 import generation_pb2_grpc as pb_grpc

    plan = runs_per_depth(args.sizes, args.depth_list)
    seconds = args.duration_s / sum(len(sizes) for sizes in plan.values())
    rows, memory, gpus = [], [], None
    try:
        for depth, sizes in plan.items():
            services.verifier_with(depth)
            with grpc.insecure_channel(f"127.0.0.1:{ports['gateway']}") as ch:
                stub = pb_grpc.GenerationStub(ch)
                rows += [measure(stub, args, ports, n, depth, seconds) for n in sizes]
            if not memory:  # after the first depth's runs: every bucket's CUDA graph is captured by then
                memory, gpus = process_memory(args, ports), gpu_memory()
    finally:
        services.stop()
    return rows, memory, gpus


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the finally that stops services
    from gateway.tiny_tokenizer import write_synthetic_tokenizer
    from drafter_service.synthetic import preset_config as drafter_preset
    from verifier_service.synthetic import preset_config

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg, dcfg = preset_config(args.preset, args.layers), drafter_preset(args.preset, args.layers)
    bandwidth = copy_bandwidth(args)
    ports = {k: _free_port() for k in ("drafter", "verifier", "gateway", "metrics")}
    with tempfile.TemporaryDirectory() as tok_dir:  # not under --out: only results and logs come back
        write_synthetic_tokenizer(tok_dir)
        services = Services(service_commands(args, ports, Path(tok_dir)), service_env(args.device), ports, out)
        rows, memory, gpus = measure_all(args, services, ports)
    context = args.prompt_len + args.max_new // 2
    world = args.world_size
    result = {
        "meta": {"date": datetime.date.today().isoformat(), "hardware": hardware(args), "device": args.device,
                 "command": "python -m tools.fullscale_run " + " ".join(argv), "preset": args.preset,
                 "layers": cfg.num_hidden_layers, "world_size": world,
                 "dtype": "bfloat16" if args.device == "cuda" else "float32", "prompt_len": args.prompt_len,
                 "max_new": args.max_new, "concurrency": args.concurrency, "copy_gb_s": round(bandwidth / 1e9, 1),
                 "floor_context": context},
        "memory": memory, "gpu_memory": gpus, "runs": rows,
        "floors": report.floors(cfg, dcfg, world, args.sizes, context, bandwidth, args.split_replicated == "true"),
    }
    (out / "fullscale.json").write_text(json.dumps(result, indent=1) + "\n")
    text = report.markdown(result)
    (out / "fullscale.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
