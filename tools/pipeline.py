"""The whole recipe of the shipped tiny pair in one process, under one time plan (one GPU call):

corpus files -> tokenizer -> tokenized corpus -> target (train, INT4 export, held-out loss before/after)
-> drafters (corpus labels and target labels, trained together) -> pick the drafter with the higher
held-out greedy chain τ -> quick in-process bench -> results.json, and the model dir packed into
tar parts (≤ `--part-mb` each) for transport.

Every stage is its tools/ script's function; the stages that train are resumable (rerun with the same
`--work`), and a stage whose output already exists is skipped.

    python -m tools.pipeline --work /tmp/work --model-out /tmp/kimi-tiny --out $OUT \
        --target-s 180 --drafter-s 90 --bench-s 40
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python tools/pipeline.py`
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import io
import json
import shutil
import sys
import tarfile
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", required=True)
    p.add_argument("--model-out", required=True, help="the model dir to build (target + tokenizer + drafter/)")
    p.add_argument("--out", required=True, help="results, log and the packed model")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--tokenizer-sample-mb", type=float, default=24.0)
    p.add_argument("--max-train-mb", type=float, default=300.0)
    p.add_argument("--target-s", type=float, default=180.0)
    p.add_argument("--drafter-s", type=float, default=90.0)
    p.add_argument("--bench-s", type=float, default=40.0, help="stop starting bench modes after this")
    p.add_argument("--target-steps", type=int, default=None, help="cap (tests)")
    p.add_argument("--drafter-steps", type=int, default=None, help="cap (tests)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--drafter-batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--target-overrides", type=json.loads, default=None)
    p.add_argument("--drafter-overrides", type=json.loads, default=None)
    p.add_argument("--pick-prompts", type=int, default=4)
    p.add_argument("--bench-prompts", type=int, default=4)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--part-mb", type=float, default=15.0)
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args(argv)

    work, model, out = Path(a.work), Path(a.model_out), Path(a.out)
    for d in (work, model, out):
        d.mkdir(parents=True, exist_ok=True)
    logf = open(out / "pipeline.log", "a")
    t0 = time.monotonic()

    def log(msg: str) -> None:
        line = f"[{time.monotonic() - t0:6.1f}s] {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    try:
        return _run(a, work, model, out, log)
    except BaseException:
        import traceback
        log("FAILED:\n" + traceback.format_exc())
        if (model / "config.json").exists():  # bring back whatever was built
            parts = pack(model, work / "drafters", "", out, a.part_mb)
            log(f"packed after failure: {[q.name for q in parts]}")
        raise


def _run(a, work: Path, model: Path, out: Path, log) -> int:
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}

    def save_results() -> None:
        results_path.write_text(json.dumps(results, indent=2) + "\n")

    from tools import corpus, train_tokenizer
    from tools.bench_spec import heldout_prompts

    results["device"] = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    results["torch"] = torch.__version__
    threads = a.threads or None
    files, stats = corpus.list_files()
    log(f"listed {stats['kept']} corpus files ({stats})")

    # 1. tokenizer
    if not (model / "tiktoken.model").exists():
        t = time.monotonic()
        results["tokenizer"] = train_tokenizer.train(model, vocab=a.vocab, sample_mb=a.tokenizer_sample_mb, log=log)
        results["tokenizer"]["seconds"] = round(time.monotonic() - t, 1)
        save_results()
    # 2. corpus
    corpus_dir = work / "corpus"
    if not (corpus_dir / "corpus.json").exists():
        corpus.build(corpus_dir, model, max_train_mb=a.max_train_mb, threads=threads or 8, log=log)
    results["corpus"] = json.loads((corpus_dir / "corpus.json").read_text())
    save_results()
    # 3. target
    if not (model / "config.json").exists():
        results["target"] = _train_target(a, work, model, corpus_dir, log)
        save_results()
    # 4. drafters
    drafters = work / "drafters"
    labels = ("corpus", "target")
    if not all((drafters / k / "config.json").exists() for k in labels):
        results["drafter"] = _train_drafters(a, work, model, corpus_dir, drafters, labels, log)
        save_results()
    # 5. pick the drafter by real greedy chain τ on held-out prompts
    prompts = heldout_prompts(model, max(a.pick_prompts, a.bench_prompts), 128)
    if "pick" not in results:
        results["pick"] = _pick_drafter(a, model, drafters, labels, prompts[: a.pick_prompts], log)
        save_results()
    best = results["pick"]["chosen"]
    if (model / "drafter").exists():
        shutil.rmtree(model / "drafter")
    shutil.copytree(drafters / best, model / "drafter")
    parts = pack(model, drafters, best, out, a.part_mb)  # before the bench: the model must come back
    log(f"packed {[f'{q.name} {q.stat().st_size / 2**20:.1f} MiB' for q in parts]}")
    # 6. quick bench (greedy), within its time
    if "bench" not in results:
        results["bench"] = _quick_bench(a, model, prompts[: a.bench_prompts], log)
        save_results()
    log(f"done: {json.dumps(results.get('bench', {}).get('summary', {}))}")
    return 0


def _train_target(a, work: Path, model: Path, corpus_dir: Path, log) -> dict:
    """Train, export (INT4) into the model dir and evaluate the target; the twin is freed after."""
    from tools import train_target

    twin, info = train_target.train(corpus_dir=corpus_dir, tokenizer_dir=model, work_dir=work, device=a.device,
                                    time_budget_s=a.target_s, max_steps=a.target_steps, batch=a.batch,
                                    seq=a.seq, text_overrides=a.target_overrides, log=log)
    info["export"] = train_target.export_and_evaluate(twin, model, work, corpus_dir,
                                                      train_target.num_regular_ids(model), device=a.device,
                                                      seq=a.seq, log=log)
    del twin
    if a.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return info


def _train_drafters(a, work: Path, model: Path, corpus_dir: Path, drafters: Path, labels: tuple[str, ...],
                    log) -> dict:
    from tools import train_drafter

    info = train_drafter.train(target_dir=model, corpus_dir=corpus_dir, work_dir=work, out_dir=drafters,
                               labels=labels, device=a.device, time_budget_s=a.drafter_s,
                               max_steps=a.drafter_steps, batch=a.drafter_batch, seq=a.seq,
                               overrides=a.drafter_overrides, log=log)
    if a.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return info


def _pick_drafter(a, model: Path, drafters: Path, labels: tuple[str, ...], prompts: list[dict], log) -> dict:
    """Greedy in-process τ of CHAIN and DDTREE-16 per drafter; the higher chain τ (then tree τ) wins."""
    from tools.bench_spec import CHAIN, DDTREE, InProcessPair, mode_list, run_in_process

    pick = {}
    for k in labels:
        pair = InProcessPair(model, drafters / k, device=a.device)
        rows = run_in_process(pair, prompts, modes=mode_list([CHAIN, DDTREE], [16]),
                              temperatures=[0.0], max_new=a.max_new, seed=0, log=lambda s, k=k: log(f"[{k}] {s}"))
        pick[k] = {r["name"]: r["tau"] for r in rows}
        del pair
    best = max(labels, key=lambda k: (pick[k]["chain"], pick[k]["ddtree-16"]))
    log(f"drafter labels: {pick} -> {best}")
    return {"tau": pick, "chosen": best}


def _quick_bench(a, model: Path, prompts: list[dict], log) -> dict:
    """Greedy AR / CHAIN / DDTREE over budgets 4..64, no mode started after `--bench-s` seconds."""
    from tools.bench_spec import AR, CHAIN, DDTREE, InProcessPair, mode_list, run_in_process, summary

    pair = InProcessPair(model, model / "drafter", device=a.device)
    rows = run_in_process(pair, prompts, modes=mode_list([AR, CHAIN, DDTREE], [4, 8, 16, 32, 64]),
                          temperatures=[0.0], max_new=a.max_new, seed=0, log=log,
                          deadline=time.monotonic() + a.bench_s)
    return {"prompts": a.bench_prompts, "max_new": a.max_new, "rows": rows, "summary": summary(rows)}


def pack(model: Path, drafters: Path, best: str, out: Path, part_mb: float) -> list[Path]:
    """The model dir (and the drafter not chosen, as drafter_alt/) as one tar split into parts."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(model, arcname="kimi-tiny")
        for k in sorted(p.name for p in drafters.iterdir() if p.is_dir()) if drafters.is_dir() else []:
            if k != best:
                tar.add(drafters / k, arcname=f"drafter_alt/{k}")
    data, size = buf.getvalue(), int(part_mb * 2**20)
    parts = []
    for old in out.glob("kimi-tiny.tar.*"):
        old.unlink()
    for i in range(0, len(data), size):
        path = out / f"kimi-tiny.tar.{i // size:02d}"
        path.write_bytes(data[i:i + size])
        parts.append(path)
    return parts


if __name__ == "__main__":
    sys.exit(main())
