#!/bin/bash
# Session 47's moe_few_down experiment (for a device session): main's kernel as a baseline, then
# docs/kernel-notes/s47-few-pipe.patch (act hoist, two batches in flight, N8): GPU tests, A/B, 16-layer step.
t0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader
echo "== main's moe_few_down (unpatched)"
PYTHONPATH=$PWD:$PYTHONPATH timeout 60 python3 docs/kernel-notes/s47_ab_few.py 2>&1 | grep -v "Warn\|warn" | tail -15
P=docs/kernel-notes/s47-few-pipe.patch  # `git apply` works outside a repository too, where `patch` is missing
{ command -v patch > /dev/null && patch -p1 --forward < $P > /dev/null; } || git apply $P || { echo "patch failed"; exit 1; }
echo "== patched $((SECONDS-t0)) s"
timeout 150 python3 -m pytest -q --tb=line -p no:cacheprovider tests/test_kernels_gpu.py \
  -k "few_down or decode or back_to_back or (expert_slices and few)" 2>&1 | tail -4
echo "== pytest $((SECONDS-t0)) s"
PYTHONPATH=$PWD:$PYTHONPATH timeout 120 python3 docs/kernel-notes/s47_ab_few.py breakdown 2>&1 | grep -v "Warn\|warn" | tail -60
echo "== ab $((SECONDS-t0)) s"
B="--layers 16 --no-reference --iters 20 --routing slowest --tree-sizes 1,2,4,8"
M="--set moe_w4a16.FEW_DOWN_T=8"
for cfg in "--set moe_w4a16.FEW_DOWN=False" "$M" "$M --set moe_w4a16.FEW_DOWN_PIPE=True --set moe_w4a16.FEW_DOWN_CPW=2" \
           "$M --set moe_w4a16.FEW_DOWN_PIPE=True" \
           "$M --set moe_w4a16.FEW_DOWN_PIPE=True --set moe_w4a16.FEW_DOWN_CPW=2 --set moe_w4a16.FEW_DOWN_N8=True"; do
  [ $((SECONDS-t0)) -lt 500 ] || break
  echo "== step $cfg $((SECONDS-t0)) s"; timeout 40 python3 -m verifier_service.bench_verify $B $cfg 2>&1 | tail -5
done
echo "== done $((SECONDS-t0)) s"
