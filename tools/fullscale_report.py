"""Floors and tables of `tools.fullscale_run` (issue 10), and merging of several of its JSON files.

Floors as in reference/perf.md §3: bytes a step must read ÷ the copy bandwidth measured in the same run
(read + write bytes per second of a large device-to-device copy). Verify: the slowest verifier rank's
bytes for a tree of N rows (`bench_verify.floor_bytes_world`: its heads, the expected maximum of
touched experts per layer over the ranks, its share of the shared / dense MLPs and lm_head, or all of
them with --split-replicated false, its latent KV). Draft: every drafter
weight, the target's lm_head the drafter multiplies by, and the drafter KV of the context. Tokens/s
floor for τ: τ / (draft + verify floor); AR: 1 / verify floor.

    python -m tools.fullscale_report a/fullscale.json b/fullscale.json [--out merged.json] > table.md
"""

from __future__ import annotations

import argparse
import json
import sys

# reference/perf.md §3.3, scheme (b1) on 7×H200 at 8k context (weights + KV, attention, all-reduces),
# for the layout the design targets (shared expert, dense MLP and lm_head split /7): a reference column.
PERF_MD_B1_MS = {1: 2.87, 8: 6.70, 16: 9.68, 32: 14.2, 64: 20.0, 128: 26.5}
TAUS = (3, 5, 7)


def floors(cfg, dcfg, world: int, sizes: list[int], prefix: int, bandwidth: float,
           split: bool = True) -> dict[str, dict]:
    """str(tree size N) (JSON keys) -> verify / draft floor ms and tokens/s floors (AR for N = 1, else
    for each τ in TAUS up to N). `split`: the verifier ran --split-replicated (its default)."""
    from drafter_service.bench_draft import drafter_bytes
    from verifier_service.bench_verify import floor_bytes_world

    draft_ms = 1e3 * drafter_bytes(dcfg, cfg.vocab_size, min(prefix, 4096)) / bandwidth
    out = {}
    for n in sizes:
        verify_ms = 1e3 * floor_bytes_world(cfg, world, n, prefix, split) / bandwidth
        row = {"verify_ms": round(verify_ms, 3), "draft_ms": round(draft_ms if n > 1 else 0.0, 3)}
        if n == 1:
            row["tok_s"] = {"1": round(1e3 / verify_ms, 1)}
        else:
            row["tok_s"] = {str(t): round(t * 1e3 / (verify_ms + draft_ms), 1) for t in TAUS if t <= n}
        out[str(n)] = row
    return out


def _fmt(x, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def verify_table(result: dict) -> list[str]:
    """One line per tree size: the runs without forced acceptance (depth 0) next to their floors."""
    fl, gpu = result["floors"], result["meta"]["device"].startswith("cuda")
    head = ("| N (rows) | mode | verify ms | floor ms | ÷ floor | " + ("perf.md (b1) ms | " if gpu else "")
            + "draft ms | draft floor ms | accept ms | engine step ms | client step ms | steady step ms | τ | tok/s |")
    lines = [head, "|" + "---:|" * (head.count("|") - 1)]
    for r in sorted((r for r in result["runs"] if r["force_depth"] == 0), key=lambda r: r["tree_size"]):
        f = fl[str(r["tree_size"])]
        ratio = r["verify_ms"] / f["verify_ms"] if r["verify_ms"] else None
        ref = [_fmt(PERF_MD_B1_MS.get(r["tree_size"]))] if gpu else []
        cells = [str(r["tree_size"]), r["name"], _fmt(r["verify_ms"], 3), _fmt(f["verify_ms"], 3), _fmt(ratio), *ref,
                 _fmt(r["draft_ms"], 3), _fmt(f["draft_ms"], 3), _fmt(r["accept_ms"], 3), _fmt(r["engine_step_ms"], 3),
                 _fmt(r["client_step_ms"], 3), _fmt(r.get("client_step_steady_ms"), 3), _fmt(r["tau"]),
                 _fmt(r["tok_s"], 1)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def tau_table(result: dict) -> list[str]:
    """Forced acceptance: per tree size, per τ = depth + 1: measured τ, client step ms (steady: without each
    stream's first decode step, which also ships the prompt's feature rows; the whole stream's where a run
    has none), tokens/s at that τ (τ ÷ step time: the step time hardly depends on τ, the measured τ may fall
    short of it when a tree has no node that deep) next to its floor."""
    runs = {(r["tree_size"], r["force_depth"]): r for r in result["runs"]}
    depths = sorted({d for _, d in runs if d})
    head = "| N (rows) | " + " | ".join(f"τ={d + 1}: τ meas. | step ms | tok/s | floor tok/s" for d in depths) + " |"
    lines = [head, "|" + "---:|" * (head.count("|") - 1)]
    for n in sorted({n for n, _ in runs if n > 1}):
        cells = [str(n)]
        for d in depths:
            r, f = runs.get((n, d)), result["floors"][str(n)]["tok_s"].get(str(d + 1))
            step = (r.get("client_step_steady_ms") or r["client_step_ms"]) if r else None
            cells += [_fmt(r and r["tau"]), _fmt(step), _fmt(step and (d + 1) * 1e3 / step, 1), _fmt(f, 1)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def memory_table(result: dict) -> list[str]:
    lines = ["| process | device | weights GB | KV cache GB | device memory used GB |", "|---|---|---:|---:|---:|"]
    used = {g["index"]: g["used_mib"] * 2**20 / 1e9 for g in result.get("gpu_memory") or []}
    for m in result["memory"]:
        gpu = int(m["device"].split(":")[1]) if m["device"].startswith("cuda:") else None
        lines.append(f"| {m['process']} | {m['device']} | {m['weight_bytes'] / 1e9:.2f} | "
                     f"{m['kv_cache_bytes'] / 1e9:.2f} | {_fmt(used.get(gpu))} |")
    return lines


def markdown(result: dict) -> str:
    m = result["meta"]
    intro = (f"{m['date']}, {m['hardware']}, command `{m['command']}`. Synthetic {m['preset']} "
             f"({m['layers']} layers), verifier world size {m['world_size']}, {m['dtype']}, prompts of "
             f"{m['prompt_len']} random token ids, {m['max_new']} new tokens, {m['concurrency']} stream(s) at a "
             f"time; copy bandwidth {m['copy_gb_s']:.0f} GB/s; floors at context {m['floor_context']}.")
    return "\n".join([intro, "", "Memory per process (GetInfo; device memory from nvidia-smi at the end):", "",
                      *memory_table(result), "", "Step times without forced acceptance (random weights: τ ≈ 1):",
                      "", *verify_table(result), "", "Forced acceptance (--force-accept-depth τ-1, TEST ONLY):", "",
                      *tau_table(result), ""])


def merge(results: list[dict]) -> dict:
    """Runs of several invocations (e.g. one per depth group) under the first one's meta and floors."""
    out = dict(results[0])
    out["runs"] = [r for res in results for r in res["runs"]]
    out["floors"] = {k: v for res in results for k, v in res["floors"].items()}
    out["meta"] = {**results[0]["meta"], "command": " ; ".join(res["meta"]["command"] for res in results)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools.fullscale_report", description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="+", help="fullscale.json files of tools.fullscale_run")
    p.add_argument("--out", help="also write the merged JSON here")
    args = p.parse_args(argv)
    merged = merge([json.loads(open(f).read()) for f in args.json])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(merged, f, indent=1)
    sys.stdout.write(markdown(merged))
    return 0


if __name__ == "__main__":
    sys.exit(main())
