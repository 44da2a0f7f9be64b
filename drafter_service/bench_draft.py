"""`ddtree bench draft --preset k26`: the drafter's Propose at full dimensions, engine only, one device.

A random DFlash drafter of the preset (synthetic.py; `k26` is Kimi's: 6 layers, hidden 7168, 64 / 8 heads of
128, intermediate 18432, block 8, vocab 163840) behind the served engine: CUDA graphs, kernels/ddtree_build for
k <= 64, the host heap above. `--sessions` sessions whose drafter caches already hold `--context` rows each;
each timed Propose brings `--new-rows` feature rows per session from the host (the previous step's accepted
path, as the verifier sends them) and drafts one tree per session. Per budget: median and p90 wall time of
`DrafterEngine.propose` (device sync included), the bandwidth floor (`drafter_bytes` of every session's
context ÷ the copy bandwidth measured in the same run) and the ratio.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from drafter_service.config import QUANTIZATIONS

PRESETS = ("k26", "k26-mini")
CHAIN = "chain"


def drafter_bytes(dcfg, vocab: int, context: int, itemsize: int = 2, weight_itemsize: int | None = None) -> float:
    """Bytes one draft round must read: every drafter weight (fc, attention and MLP of each layer; the RMSNorm
    vectors and int8 row scales left out) and the target's lm_head the block's logits multiply by, at
    `weight_itemsize` bytes a parameter (default `itemsize`; 1: `--quantization int8`), and `context` rows of
    drafter K/V (each layer, K and V, kv heads × head_dim) at `itemsize`. The embedding reads only the block's
    rows: not counted."""
    H, hd, I = dcfg.hidden_size, dcfg.head_dim, dcfg.intermediate_size
    attn = H * hd * (2 * dcfg.num_attention_heads + 2 * dcfg.num_key_value_heads)
    layers = dcfg.num_hidden_layers * (attn + 3 * H * I)
    kv = context * dcfg.num_hidden_layers * 2 * dcfg.num_key_value_heads * hd
    return (weight_itemsize or itemsize) * (dcfg.feature_width * H + layers + vocab * H) + itemsize * kv


def add_parser(bsub) -> None:
    p = bsub.add_parser("draft", help="time one drafter Propose at full dimensions (engine only, one device)")
    p.add_argument("--preset", default="k26", choices=PRESETS)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                   help="drafter weight storage, as the drafter's --quantization (drafter_service/int8.py)")
    p.add_argument("--sessions", type=int, default=1, help="sessions drafted together in each Propose")
    p.add_argument("--context", type=int, default=4096, help="rows in each session's drafter cache before timing")
    p.add_argument("--new-rows", type=int, default=4, help="feature rows each Propose brings (accepted path)")
    p.add_argument("--budgets", default="chain,8,16,32,64,128", help="tree budgets; 'chain' = the block's chain")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", help="also write the rows as JSON lines here")
    p.set_defaults(func=main)


def _engine(args):
    from drafter_service.engine import DrafterEngine, EngineOptions
    from drafter_service.kv_cache import page_bytes
    from drafter_service.synthetic import random_drafter

    model = random_drafter(args.preset, device=args.device, dtype=getattr(torch, args.dtype))
    if args.quantization == "int8":
        from drafter_service.int8 import quantize_drafter

        quantize_drafter(model)
    cfg = model.cfg
    window = 4096  # the served default (EngineOptions.window); pages behind it are freed as the session grows
    pages = args.sessions * 2 * (window // 64 + 1) + 2
    nbytes = pages * page_bytes(cfg.num_hidden_layers, 64, cfg.num_key_value_heads, cfg.head_dim, model.dtype)
    engine = DrafterEngine(model, EngineOptions(cache_bytes=nbytes, window=window), name=f"synthetic-{args.preset}")
    engine.warm_up()
    return engine


def _timed_proposes(engine, args, budget: str, position: int, gen: torch.Generator) -> tuple[list[float], int]:
    """`args.iters` Proposes (after 3 untimed) of one budget; their seconds and the sessions' next position."""
    from drafter_service.engine import DraftMode, ProposeItem

    cfg, vocab = engine.cfg, engine.model.vocab_size
    chain = budget == CHAIN
    mode, tree_budget = (DraftMode.CHAIN, 0) if chain else (DraftMode.DDTREE, int(budget))
    rows = [torch.randn(args.new_rows, cfg.feature_width, generator=gen).to(engine.dtype) for _ in range(8)]
    seconds = []
    for i in range(args.iters + 3):
        roots = torch.randint(vocab, (args.sessions,), generator=gen).tolist()
        items = [ProposeItem(f"bench{s}", position, rows[(i + s) % len(rows)], roots[s], tree_budget, mode=mode)
                 for s in range(args.sessions)]
        t0 = time.perf_counter()
        results = engine.propose(items)
        if i >= 3:
            seconds.append(time.perf_counter() - t0)
        failed = [r for r in results if not hasattr(r, "tree")]
        if failed:
            raise RuntimeError(f"Propose failed: {failed[0]}")
        position += args.new_rows
    return seconds, position


def main(args) -> int:
    from drafter_service.engine import ProposeItem
    from kernels.bench import copy_bandwidth
    from service_kit.config import limit_torch_threads

    limit_torch_threads(args.device, 0)  # the served drafter's host threads (one on a GPU): see its docstring
    gen = torch.Generator().manual_seed(0)
    engine = _engine(args)
    cfg, vocab = engine.cfg, engine.model.vocab_size
    context = torch.randn(args.context, cfg.feature_width, generator=gen).to(engine.dtype)
    for s in range(args.sessions):  # each session's prefix, injected once
        engine.propose([ProposeItem(f"bench{s}", 0, context, 0, tree_budget=8, reset=True)])
    bw = copy_bandwidth(args.device)
    attended = min(args.context, engine.options.window or args.context)
    floor_ms = 1e3 * drafter_bytes(cfg, vocab, attended * args.sessions, engine.model.dtype.itemsize,
                                   1 if args.quantization == "int8" else None) / bw
    print(f"# {args.preset} drafter ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, block {cfg.block_size}, "
          f"vocab {vocab}) on {_device_name(args.device)}, {args.dtype}, weights {args.quantization}; "
          f"{args.sessions} session(s) of {args.context} context rows ({attended} attended), {args.new_rows} new rows "
          f"each per Propose; copy {bw / 1e9:.0f} GB/s")
    print(f"{'budget':>7} {'median ms':>10} {'p90 ms':>8} {'floor ms':>9} {'median/floor':>13}")
    position, out = args.context, []
    for budget in args.budgets.split(","):
        seconds, position = _timed_proposes(engine, args, budget.strip(), position, gen)
        median, p90 = statistics.median(seconds) * 1e3, sorted(seconds)[int(0.9 * (len(seconds) - 1))] * 1e3
        out.append(dict(budget=budget.strip(), median_ms=median, p90_ms=p90, floor_ms=floor_ms, preset=args.preset,
                        device=_device_name(args.device), dtype=args.dtype, quantization=args.quantization,
                        context=args.context, sessions=args.sessions, new_rows=args.new_rows))
        print(f"{budget.strip():>7} {median:>10.3f} {p90:>8.3f} {floor_ms:>9.3f} {median / floor_ms:>13.2f}")
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in out)
    return 0


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"


if __name__ == "__main__":  # without the `ddtree` entry point (e.g. on a machine without the gRPC stubs)
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="bench_draft")
    add_parser(parser.add_subparsers(dest="command", required=True))
    sys.exit(main(parser.parse_args(["draft", *sys.argv[1:]])))
