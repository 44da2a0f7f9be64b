"""Issue 10's full-scale harness at CPU size: `tools.fullscale_run` starts the real drafter, verifier (2
gloo ranks) and gateway with synthetic k26-mini weights, streams random token-id prompts per tree size and
forced acceptance depth, and writes the JSON and tables; the TEST ONLY --force-accept-depth K gives
τ = K + 1 (random weights alone give τ ≈ 1)."""

import json
import subprocess
import sys

import pytest

from stack import REPO, service_env

pytestmark = pytest.mark.slow

COMMAND = ["--preset", "k26-mini", "--device", "cpu", "--world-size", "2", "--budgets", "1,8", "--duration-s", "10"]


def test_fullscale_run_on_cpu(tmp_path):
    """~35 s on a 2-core machine: three service start-ups, three verifier restarts, 10 s of streams."""
    done = subprocess.run([sys.executable, "-m", "tools.fullscale_run", *COMMAND, "--out", str(tmp_path)], cwd=REPO,
                          env=service_env(), capture_output=True, text=True, timeout=180)
    logs = "\n".join((tmp_path / f"{n}.log").read_text()[-3000:] for n in ("verifier", "drafter", "gateway")
                     if (tmp_path / f"{n}.log").exists())
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}\n{logs}"
    result = json.loads((tmp_path / "fullscale.json").read_text())
    runs = {(r["tree_size"], r["force_depth"]): r for r in result["runs"]}
    assert set(runs) == {(1, 0), (8, 0), (8, 2), (8, 4), (8, 6)}
    for (size, depth), r in runs.items():
        assert r["streams"] >= 1 and r["steps"] > 0 and r["verify_ms"] > 0 and r["tok_s"] > 0, r
        assert r["tok_s_steady"] > 0 and r["client_step_steady_ms"] > 0, r  # without each stream's first step
        assert (r["draft_ms"] > 0) == (size > 1), r
        if depth:
            assert r["tau"] == pytest.approx(depth + 1, abs=0.3), r
    assert runs[(1, 0)]["tau"] == 1.0 and runs[(8, 0)]["tau"] < 1.5  # random weights: nothing accepted
    assert [m["process"] for m in result["memory"]] == ["drafter", "verifier rank 0", "verifier rank 1"]
    assert all(m["weight_bytes"] > 0 and m["kv_cache_bytes"] > 0 for m in result["memory"])
    assert set(result["floors"]) == {"1", "8"} and set(result["floors"]["8"]["tok_s"]) == {"3", "5", "7"}
    table = (tmp_path / "fullscale.md").read_text()
    assert "| 8 | ddtree-7 |" in table and "τ=7" in table and "steady step ms" in table
