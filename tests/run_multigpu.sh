#!/usr/bin/env bash
# GPU tests on a machine with two or more GPUs (not CI): NCCL verifier ranks vs world size 1, the
# kernel/graph tests, and the 2-rank full-dimension verify-step benchmark (graph replay vs eager).
# Usage: tests/run_multigpu.sh [OUT_DIR]   (stubs must be generated: `make protos` or carried)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.}
export PYTHONPATH=${PYTHONPATH:-}:.:protos PYTHONUNBUFFERED=1
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_multigpu.py tests/test_model_gpu.py tests/test_kernels_gpu.py
python3 -m torch.distributed.run --nproc-per-node 2 -m verifier_service.bench_verify --layers 4 \
    --tree-sizes 1,8,16,64 --no-reference --out "$out/bench_verify_2gpu.jsonl"
