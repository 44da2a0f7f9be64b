"""The rows of `ddtree bench spec`: modes, one row per (harness, temperature, mode), speedups, summary.

A row holds a mode's mean acceptance length τ (tokens per verify step, bonus included), decode
tokens/s, the step-time split in ms per verify step (SPLIT_KEYS), and, against AR at the same
temperature, `speedup_vs_ar` and the lossless check (`matches_ar`, `divergences`).
"""

from __future__ import annotations

AR, CHAIN, DDTREE = "ar", "chain", "ddtree"
DEFAULT_BUDGETS = (4, 8, 16, 32, 64)
SPLIT_KEYS = ("draft", "tree_build", "verify", "accept_commit", "rpc", "other")


def mode_list(modes: list[str], budgets: list[int]) -> list[tuple[str, int]]:
    """[(mode, budget)]: DDTREE once per budget, the other modes once with budget 0."""
    out = []
    for m in modes:
        if m == DDTREE:
            out += [(DDTREE, b) for b in budgets]
        else:
            out.append((m, 0))
    return out


def mode_name(mode: str, budget: int) -> str:
    return f"ddtree-{budget}" if mode == DDTREE else mode


def speed_fields(steps: int, committed: float, decode_tokens: int, decode_s: float) -> dict:
    """steps, τ, decode tokens/s and ms per verify step, as both harnesses report them."""
    return {"steps": steps, "tau": round(committed / max(steps, 1), 3),
            "tokens_per_s": round(decode_tokens / decode_s, 2) if decode_s else None,
            "step_ms": round(decode_s / max(steps, 1) * 1e3, 3)}


def add_speedups(rows: list[dict]) -> None:
    """speedup_vs_ar: tokens/s over AR's of the same harness and temperature (None without AR)."""
    base = {(r["harness"], r["temperature"]): r["tokens_per_s"] for r in rows if r["mode"] == AR}
    for r in rows:
        b = base.get((r["harness"], r["temperature"]))
        r["speedup_vs_ar"] = round(r["tokens_per_s"] / b, 3) if b and r["tokens_per_s"] else None


def format_row(r: dict) -> str:
    split = " ".join(f"{k}={v:.2f}" for k, v in r["split_ms"].items() if v)
    lossless = "" if "matches_ar" not in r else (" lossless" if r["matches_ar"] else
                                                  f" DIVERGED {r['divergences'][:2]}")
    return (f"[{r['harness']}] T={r['temperature']:g} {r['name']:>10}: tau {r['tau']:.2f}  "
            f"{r['tokens_per_s']} tok/s  step {r['step_ms']:.2f} ms ({split}){lossless}")


def estimate_rpc(rows: list[dict]) -> None:
    """e2e rows: split the verifier's draft wait into the drafter's compute (the in-process draft + tree
    build of the same mode and temperature) and `rpc` (the rest: serialization, transport, scheduling)."""
    ip = {(r["name"], r["temperature"]): r for r in rows if r["harness"] == "in_process"}
    for r in rows:
        ref = ip.get((r["name"], r["temperature"]))
        if r["harness"] != "e2e" or ref is None or r["mode"] == AR or r["split_ms"].get("rpc"):
            continue  # (rpc measured from the drafter's own metrics: keep it)
        compute = ref["split_ms"]["draft"] + ref["split_ms"]["tree_build"]
        wait = r["split_ms"]["draft"]
        r["split_ms"].update(draft=round(min(compute, wait), 3), rpc=round(max(wait - compute, 0.0), 3))


def summary(rows: list[dict]) -> dict:
    """Per "harness T=t": τ and speedup of every mode, the best DDTree τ over CHAIN's, the fastest mode,
    and whether every mode matched AR."""
    out = {}
    for (harness, temp) in sorted({(r["harness"], r["temperature"]) for r in rows}):
        rs = [r for r in rows if r["harness"] == harness and r["temperature"] == temp]
        chain = next((r for r in rs if r["mode"] == CHAIN), None)
        trees = [r for r in rs if r["mode"] == DDTREE]
        best_tau = max(trees, key=lambda r: r["tau"], default=None)
        best_speed = max(trees + ([chain] if chain else []), key=lambda r: r.get("speedup_vs_ar") or 0, default=None)
        out[f"{harness} T={temp:g}"] = {
            "tau": {r["name"]: r["tau"] for r in rs},
            "speedup_vs_ar": {r["name"]: r.get("speedup_vs_ar") for r in rs},
            "best_ddtree_tau_over_chain": round(best_tau["tau"] / chain["tau"], 3) if best_tau and chain else None,
            "fastest": best_speed["name"] if best_speed else None,
            "lossless": all(r.get("matches_ar", True) for r in rs),
        }
    return out
