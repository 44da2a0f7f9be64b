"""`ddtree bench draft`: its floor counts the bytes the drafter really holds, and the CPU run drafts trees."""

import json
import subprocess
import sys

import pytest
import torch

from drafter_service.bench_draft import drafter_bytes
from drafter_service.kv_cache import page_bytes
from drafter_service.synthetic import random_drafter
from stack import REPO, service_env


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_floor_bytes_are_the_drafters_tensors(dtype):
    """Independent count: every matrix the random drafter holds (fc, each layer's projections), the lm_head it
    multiplies by, and the context's K/V at the pool's bytes per row; only the RMSNorm vectors are left out."""
    model = random_drafter("k26-mini", dtype=dtype)
    cfg, item = model.cfg, torch.empty(0, dtype=dtype).element_size()
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2) * item
    norms = sum(p.numel() for p in model.parameters() if p.dim() == 1) * item
    head = model.lm_head.numel() * item
    context = 300
    kv = context * page_bytes(cfg.num_hidden_layers, 64, cfg.num_key_value_heads, cfg.head_dim, dtype) // 64
    assert norms > 0
    assert drafter_bytes(cfg, model.vocab_size, context, item) == matrices + head + kv


def test_bench_draft_on_cpu(tmp_path):
    out = tmp_path / "draft.jsonl"
    args = ["--preset", "k26-mini", "--device", "cpu", "--dtype", "float32", "--context", "70", "--iters", "3",
            "--budgets", "chain,8,128", "--sessions", "2", "--out", str(out)]
    done = subprocess.run([sys.executable, "-m", "drafter_service.bench_draft", *args], cwd=REPO, env=service_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["budget"] for r in rows] == ["chain", "8", "128"] and all(r["sessions"] == 2 for r in rows)
    assert all(0 < r["floor_ms"] < r["median_ms"] <= r["p90_ms"] for r in rows), rows
    assert "median/floor" in done.stdout
