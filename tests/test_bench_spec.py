"""Smoke test of `ddtree bench spec` (tools/bench_spec.py) in-process on the make-tiny checkpoint (CPU)."""

from __future__ import annotations

import json

import pytest

from tools import bench_spec, spec_plot


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from service_kit.tools import make_tiny
    return make_tiny(tmp_path_factory.mktemp("bench_tiny"), seed=0)


@pytest.fixture(scope="module")
def pair(tiny):
    return bench_spec.InProcessPair(tiny, device="cpu")


PROMPTS = [{"key": "a", "ids": [5, 17, 300, 42, 9, 1000, 77]}, {"key": "b", "ids": [(i * 37 + 11) % 1792 for i in range(20)]}]


def test_modes_are_lossless_and_reported(pair, tmp_path):
    modes = bench_spec.mode_list(["ar", "chain", "ddtree"], [4, 16])
    rows = bench_spec.run_in_process(pair, PROMPTS, modes=modes, temperatures=[0.0, 1.0], max_new=12, seed=3,
                                     log=lambda s: None)
    assert [r["name"] for r in rows] == ["ar", "chain", "ddtree-4", "ddtree-16"] * 2
    for r in rows:
        assert r["tau"] >= 1.0 and r["tokens_per_s"] > 0 and r["speedup_vs_ar"] > 0
        assert set(r["split_ms"]) == set(bench_spec.SPLIT_KEYS)
        if r["mode"] != "ar":
            assert r["matches_ar"], r["divergences"]  # greedy and seeded T=1 alike
            assert r["split_ms"]["draft"] > 0 and r["split_ms"]["tree_build"] > 0
    assert rows[0]["tau"] == 1.0
    summary = bench_spec.summary(rows)
    assert summary["in_process T=0"]["lossless"] and "best_ddtree_tau_over_chain" in summary["in_process T=0"]
    backend = bench_spec.plot(rows, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", backend


def test_builtin_rasterizer_writes_png(tmp_path):
    rows = [{"harness": "in_process", "temperature": 0.0, "mode": "chain", "budget": 7, "tau": 2.0, "speedup_vs_ar": 1.5},
            *[{"harness": "in_process", "temperature": 0.0, "mode": "ddtree", "budget": b, "tau": 2 + b / 64,
               "speedup_vs_ar": 1.4} for b in (4, 8, 16)]]
    series = {("in_process", 0.0): {"ddtree": [(r["budget"], r["tau"], r["speedup_vs_ar"]) for r in rows[1:]],
                                    "chain": (2.0, 1.5)}}
    spec_plot._plot_raster(series, tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 1000


def test_cli_parses_and_runs(tiny, tmp_path, monkeypatch):
    from service_kit.cli import build_parser

    args = build_parser(["bench"]).parse_args(["bench", "spec", "--model", str(tiny), "--device", "cpu", "--prompts", "1",
                              "--max-new", "6", "--budgets", "4", "--temperatures", "0", "--out", str(tmp_path)])
    monkeypatch.setattr(bench_spec, "heldout_prompts", lambda *a, **k: PROMPTS[:1])
    assert args.func(args) == 0
    report = json.loads((tmp_path / "bench_spec.json").read_text())
    assert [r["name"] for r in report["rows"]] == ["ar", "chain", "ddtree-4"]
    assert (tmp_path / "bench_spec.png").exists()


CUDA = ["--device", "cuda"]


@pytest.mark.parametrize("flags, dtypes", [(["--device", "cpu"], ("float32", "float32")),
                                           (CUDA, ("bfloat16", "bfloat16")),
                                           ([*CUDA, "--dtype", "float32"], ("float32", "bfloat16")),
                                           ([*CUDA, "--drafter-device", "cpu"], ("bfloat16", "float32")),
                                           ([*CUDA, "--drafter-dtype", "float32"], ("bfloat16", "float32"))])
def test_cli_dtype_defaults(flags, dtypes, monkeypatch):
    """The target's and the drafter's dtypes: bf16 on CUDA, fp32 on CPU, each on its own device."""
    from service_kit.cli import build_parser

    seen = []
    monkeypatch.setattr(bench_spec, "run", lambda a: seen.append((a.dtype, a.drafter_dtype)) or 0)
    args = build_parser(["bench"]).parse_args(["bench", "spec", *flags])
    assert args.func(args) == 0 and seen == [dtypes]


SHIPPED = bench_spec.Path(__file__).resolve().parents[1] / "models" / "kimi-tiny"


@pytest.mark.skipif(not (SHIPPED / "config.json").exists(), reason="no shipped models/kimi-tiny")
def test_shipped_pair_drafts_well_and_losslessly():
    """The trained pair: greedy DDTree output equals AR, and the drafter is far better than chance."""
    pair = bench_spec.InProcessPair(SHIPPED, device="cpu")
    from gateway.tokenizer import KimiTokenizer

    prompt = KimiTokenizer.from_dir(SHIPPED).encode("import os\nimport sys\n\n\ndef main(argv):\n")
    ar = pair.generate(prompt, 24, "ar")
    tree = pair.generate(prompt, 24, "ddtree", budget=16)
    assert tree.tokens == ar.tokens
    assert sum(tree.committed) / tree.steps > 1.5


def test_e2e_split_takes_draft_compute_from_the_drafter_metrics():
    """The end-to-end row splits the verifier's wait for Propose into the drafter's own engine time and
    the rest (rpc), per verify step, from the two services' /metrics deltas."""
    from types import SimpleNamespace

    from tools.spec_e2e import Streamed, _row

    stats = SimpleNamespace(verify_steps=10, mean_acceptance_length=3.0)
    outs = [Streamed(list(range(31)), SimpleNamespace(spec_stats=stats), decode_s=0.05, wall_s=0.1)]
    metrics = {"ddtree_verify_step_seconds_count": 10.0, "ddtree_verify_step_seconds_sum": 0.02,
               "ddtree_draft_seconds_sum": 0.03, "ddtree_accept_commit_seconds_sum": 0.01,
               'ddtree_drafter_propose_seconds_sum{phase="draft"}': 0.012}
    row = _row(outs, metrics, "ddtree", 16, 0.0)
    assert row["split_ms"] == {"draft": 1.2, "rpc": 1.8, "verify": 2.0, "accept_commit": 1.0, "other": 4.0}
    assert row["tau"] == 3.0
