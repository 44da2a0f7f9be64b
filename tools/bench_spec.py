"""`ddtree bench spec`: acceptance length, speed and step-time split of AR, CHAIN and DDTREE.

Prompts are the first lines (up to `--prompt-tokens` tokens) of held-out corpus files (tools/corpus.py
split, spread over packages). Every mode decodes every prompt for `--max-new` tokens, greedy and at
each `--temperatures` value (seeded: the same seed gives the same tokens in every mode, so T > 0 is
checked for exactness too). Two harnesses:

- in-process (`--in-process`, default on; tools/spec_inprocess.py): verifier_service's K2Model +
  PagedKVCache + plan builder + acceptance walk, and drafter_service's DrafterEngine, called directly
  (no gRPC, no protos). Per step: draft (drafter inject + block forward), tree build (top-K + heap),
  verify (plan + target forward), accept/commit (target tokens, walk, KV commit, features).
- end to end (`--e2e`; tools/spec_e2e.py): drafter, verifier and gateway as separate processes on
  loopback (as tests/stack.py starts them), token-id prompts through the public Generate stream. Split
  from the verifier's Prometheus histograms: draft (drafter RPC incl. its compute), verify,
  accept/commit, and the rest of the wall time (gateway, streaming, scheduling).

Reports per mode (tools/spec_report.py): mean acceptance length τ (tokens per verify step, bonus
included), decode tokens/s, speedup vs AR at the same temperature, the step-time split, and lossless
checks (every mode's tokens vs AR's; on a difference, the first position and AR's top-2 logit gap
there). Writes bench_spec.json and bench_spec.png (τ and speedup vs budget, tools/spec_plot.py;
matplotlib when installed, else a built-in rasterizer).

    python -m tools.bench_spec --model models/kimi-tiny --device cpu --prompts 4 --max-new 64
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python tools/bench_spec.py`
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import sys
from pathlib import Path

import torch

from drafter_service.config import QUANTIZATIONS
from tools.spec_e2e import run_e2e
from tools.spec_inprocess import InProcessPair, run_in_process
from tools.spec_plot import plot
# AR / CHAIN / DDTREE / SPLIT_KEYS too: tools/pipeline.py and the tests take the bench's names from here.
from tools.spec_report import (AR, CHAIN, DDTREE, DEFAULT_BUDGETS, SPLIT_KEYS, estimate_rpc,  # noqa: F401
                               mode_list, summary)


def heldout_prompts(tokenizer_dir: str | Path, count: int, prompt_tokens: int, *, per_mille: int = 30,
                    min_tokens: int = 16) -> list[dict]:
    """First lines of `count` held-out files (fixed hash order of their keys), each cut at a line end
    so that it holds at most `prompt_tokens` tokens (and at least `min_tokens`)."""
    from gateway.tokenizer import KimiTokenizer
    from tools import corpus

    tok = KimiTokenizer.from_dir(tokenizer_dir)
    files, _ = corpus.list_files()
    _, heldout = corpus.split(files, per_mille)
    heldout = sorted(heldout, key=lambda f: corpus.key_hash("order", f.key))
    prompts = []
    for f in heldout:
        text, ids = "", []
        for line in f.text.splitlines(keepends=True):
            cand = tok.encode(text + line)
            if len(cand) > prompt_tokens:
                break
            text, ids = text + line, cand
        if len(ids) >= min_tokens and text.strip():
            prompts.append({"key": f.key, "text": text, "ids": ids})
        if len(prompts) == count:
            break
    return prompts


def run(args) -> int:
    model = Path(args.model or _default_model())
    drafter = Path(args.drafter_model) if args.drafter_model else model / "drafter"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = heldout_prompts(model, args.prompts, args.prompt_tokens)
    if not prompts:
        print("bench spec: no held-out prompts found", file=sys.stderr)
        return 1
    modes = mode_list(args.modes.split(","), [int(b) for b in args.budgets.split(",")])
    temps = [float(t) for t in args.temperatures.split(",")]
    drafter_device = args.drafter_device or args.device
    report = {"model": str(model), "drafter": str(drafter), "device": args.device, "dtype": args.dtype,
              "drafter_device": drafter_device, "drafter_dtype": args.drafter_dtype,
              "drafter_quantization": args.drafter_quantization,
              "max_new": args.max_new, "prompt_tokens": args.prompt_tokens,
              "response_format": args.response_format, "adaptive_budget": args.adaptive_budget,
              "prompts": [{"key": p["key"], "tokens": len(p["ids"])} for p in prompts],
              "torch": torch.__version__, "rows": []}
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    log = lambda s: print(s, flush=True)  # noqa: E731
    if args.in_process:
        pair = InProcessPair(model, drafter, device=args.device, dtype=dtypes[args.dtype],
                             drafter_dtype=dtypes[args.drafter_dtype], drafter_quantization=args.drafter_quantization)
        report["block_size"] = pair.block_size
        report["rows"] += run_in_process(pair, prompts, modes=modes, temperatures=temps, max_new=args.max_new,
                                         seed=args.seed, log=log)
        del pair
    if args.e2e:
        report["rows"] += run_e2e(model, drafter, prompts, modes=modes, temperatures=temps, max_new=args.max_new,
                                  seed=args.seed, device=args.device, dtype=args.dtype,
                                  drafter_device=drafter_device, drafter_dtype=args.drafter_dtype,
                                  log_dir=out / "logs", log=log, response_format=args.response_format,
                                  adaptive_budget=args.adaptive_budget)
    estimate_rpc(report["rows"])
    report["summary"] = summary(report["rows"])
    (out / "bench_spec.json").write_text(json.dumps(report, indent=2) + "\n")
    backend = plot(report["rows"], out / "bench_spec.png")
    print(json.dumps(report["summary"], indent=2))
    print(f"bench spec: wrote {out / 'bench_spec.json'} and {out / 'bench_spec.png'} ({backend})")
    return 0


def _default_model() -> str:
    from service_kit.launcher import resolve_model
    return str(resolve_model(None))


def configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", default=None, help="target dir (default: the shipped models/kimi-tiny)")
    p.add_argument("--drafter-model", default=None, help="DFlash drafter dir (default: MODEL/drafter)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                   help="the target's; default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--drafter-dtype", default=None, choices=("float32", "bfloat16"),
                   help="default: bfloat16 on cuda, float32 on cpu. The draft never changes the output (the target "
                        "verifies every token), so an fp32 target for exact AR comparison can keep a bf16 drafter")
    p.add_argument("--drafter-quantization", default="none", choices=QUANTIZATIONS,
                   help="the drafter's weight storage, as its --quantization (in-process harness only)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--modes", default="ar,chain,ddtree")
    p.add_argument("--budgets", default=",".join(map(str, DEFAULT_BUDGETS)))
    p.add_argument("--adaptive-budget", action=argparse.BooleanOptionalAction, default=False,
                   help="--e2e: the verifier trims each step's trees to what pays (--adaptive-tree-budget); a budget "
                        "is then each step's most nodes. Off: every step verifies the whole budget")
    p.add_argument("--temperatures", default="0,1", help="0 = greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch default)")
    p.add_argument("--in-process", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--e2e", action=argparse.BooleanOptionalAction, default=False,
                   help="also run through the three gRPC services (needs the generated stubs)")
    p.add_argument("--drafter-device", default=None,
                   help="--e2e: the drafter service's device (e.g. cuda:1, its own GPU as deployed; default --device)")
    p.add_argument("--response-format", default="",
                   help="--e2e only: structured output for every request, \"json_object\" or a JSON Schema's JSON text "
                        "(GenerateRequest.response_format); requests then end at EOS once the answer is complete")
    p.add_argument("--out", default="bench-out")
    p.set_defaults(func=_run_cmd)
    return p


def _run_cmd(args) -> int:
    if args.response_format and (args.in_process or not args.e2e):
        print("bench spec: --response-format needs --e2e --no-in-process (the engine applies it)", file=sys.stderr)
        return 2
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    if args.drafter_dtype is None:
        args.drafter_dtype = "bfloat16" if (args.drafter_device or args.device).startswith("cuda") else "float32"
    return run(args)


def add_parser(bsub) -> None:
    """`ddtree bench spec`: service_kit/tools.py calls this with the `bench` subparsers."""
    configure(bsub.add_parser("spec", help="acceptance length and speed of AR / CHAIN / DDTREE"))


def main(argv: list[str] | None = None) -> int:
    args = configure(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
