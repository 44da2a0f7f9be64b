#!/usr/bin/env bash
# GPU checks on a machine with two or more GPUs (not CI): every GPU test (verifier ranks vs world size 1,
# services on the second GPU, the one-shot all-reduce, model, drafter and kernels), the model checks again
# with the MoE kernel's programmatic dependent launch off (moe.PDL, on by default), the all-reduce and 2-rank
# full-dimension verify-step benchmarks (each also with the all-reduce by PDL, all_reduce.PDL), and the
# end-to-end speculative benchmark with the drafter on its own GPU.
# Usage: tests/run_multigpu.sh [OUT_DIR]   (stubs must be generated: `make protos` or carried)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-.}
export PYTHONPATH=${PYTHONPATH:-}:.:protos PYTHONUNBUFFERED=1
status=0
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_multigpu.py tests/test_all_reduce_gpu.py \
    tests/test_model_gpu.py tests/test_drafter_gpu.py tests/test_kernels_gpu.py || status=1
python3 -c "import sys, pytest, kernels.moe_w4a16 as moe; moe.PDL = False; sys.exit(pytest.main(
    ['-q', '-p', 'no:cacheprovider', '-m', 'gpu', 'tests/test_model_gpu.py', '-k', 'k26 or full_dimension']))" \
    || status=1
python3 -m torch.distributed.run --nproc-per-node 2 -m kernels.bench_all_reduce --out "$out/bench_all_reduce.jsonl" \
    || status=1
python3 -m torch.distributed.run --nproc-per-node 2 -m verifier_service.bench_verify --layers 4 \
    --tree-sizes 1,8,16,64 --no-reference --out "$out/bench_verify_2gpu.jsonl" || status=1
# the same two with the all-reduce launched by PDL (all_reduce.PDL, off by default until this A/B says otherwise)
python3 -m torch.distributed.run --nproc-per-node 2 -m kernels.bench_all_reduce --set all_reduce.PDL=True \
    --out "$out/bench_all_reduce_pdl.jsonl" || status=1
python3 -m torch.distributed.run --nproc-per-node 2 -m verifier_service.bench_verify --layers 4 \
    --tree-sizes 1,8,16,64 --no-reference --set all_reduce.PDL=True --out "$out/bench_verify_2gpu_pdl.jsonl" \
    || status=1
python3 -m tools.bench_spec --device cuda --drafter-device cuda:1 --dtype float32 --prompts 8 --max-new 128 \
    --temperatures 0,1 --no-in-process --e2e --out "$out/bench_spec_e2e" || status=1
exit $status
