"""Verifier across 2 GPUs (NCCL): same logits and same greedy outputs as world size 1.
Run on a 2-GPU machine with tests/run_multigpu.sh (CI has no GPU: skipped there)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)

from stack import gen_request, generate, new_stack, tiny_ckpt  # noqa: E402,F401
from test_multirank import forward_at, rel  # noqa: E402
from ddtree.v1 import generation_pb2 as pb  # noqa: E402


def test_direct_forward_nccl_equals_world_size_1(tiny_ckpt, tmp_path):
    ref = forward_at(tiny_ckpt, 1, tmp_path / "w1.pt", "cuda")
    for extra in ((), ("split",)):
        got = forward_at(tiny_ckpt, 2, tmp_path / "w2.pt", "cuda", *extra)
        for key in ("prefill", "tree", "after_commit"):
            assert rel(got[key], ref[key]) < 1e-5, f"{extra} {key}: rel {rel(got[key], ref[key]):.2e}"


PROMPTS = [[3, 14, 15, 92, 65], "def main():\n    return", [271, 828, 1828, 459, 45, 235, 36]]


def outputs(request, tiny_ckpt, tmp_path_factory, world: int, mode: int) -> list[list[int]]:
    with new_stack(request, tiny_ckpt, tmp_path_factory) as st:
        st.add_drafter("--device", "cuda:0")
        st.add_verifier("--world-size", str(world), "--device", "cuda")
        st.add_gateway()
        return [generate(st.generation, gen_request(p, 32, mode=mode, budget=8)).ids for p in PROMPTS]


def test_stack_on_two_gpus_equals_one(request, tiny_ckpt, tmp_path_factory):
    ref = outputs(request, tiny_ckpt, tmp_path_factory, 1, pb.SPEC_MODE_AR)
    assert outputs(request, tiny_ckpt, tmp_path_factory, 2, pb.SPEC_MODE_DDTREE) == ref


def test_drafter_and_verifier_on_the_second_gpu(request, tiny_ckpt, tmp_path_factory):
    """Bare-metal flags, no CUDA_VISIBLE_DEVICES: drafter --device cuda:1, verifier --gpus 1. CUDA's current
    device is per thread (gRPC's and the engine's threads start on GPU 0), so each service binds its GPU
    in every thread that launches kernels or replays graphs. Drafts must arrive and change nothing."""
    with new_stack(request, tiny_ckpt, tmp_path_factory) as st:
        st.add_drafter("--device", "cuda:1")
        st.add_verifier("--device", "cuda", "--gpus", "1")
        st.add_gateway()
        ar = [generate(st.generation, gen_request(p, 32, mode=pb.SPEC_MODE_AR)) for p in PROMPTS]
        tree = [generate(st.generation, gen_request(p, 32, mode=pb.SPEC_MODE_DDTREE, budget=8)) for p in PROMPTS]
    assert [r.ids for r in tree] == [r.ids for r in ar]
    stats = [r.final.spec_stats for r in tree]
    assert all(s.draft_tokens > 0 and s.draft_unavailable_steps == 0 for s in stats), stats
