"""Expert slices (`--expert-slices S`): each routed expert cut into S slices of its intermediate rows, dealt
round-robin over the verifier ranks. The ranks' outputs must sum to the whole experts' (checked against the
reference on whole experts, an independent layout), every slice must be held exactly once, and the loader must
read the same values a cut of the whole expert holds."""

import collections

import pytest
import torch

from stack import tiny_ckpt  # noqa: F401 (fixture)
from verifier_service.config import VerifierConfig
from verifier_service.int4 import Int4Weight, quantize_int4_groupwise
from verifier_service.expert_shard import ExpertShard, cut_experts, local_pairs
from verifier_service.moe import ExpertStack, moe_experts_dense, moe_experts_ref
from verifier_service.synthetic import preset_config, random_target
from verifier_service.weights import expert_range, load_target_weights


@pytest.mark.parametrize("world,S", [(1, 1), (7, 1), (7, 2), (7, 4), (7, 8), (3, 4), (2, 16)])
def test_every_slice_is_held_once(world, S):
    n = 384
    held = collections.Counter(p for r in range(world) for p in ExpertShard(r, world, S).pieces(n))
    assert held == collections.Counter((e, s) for e in range(n) for s in range(S))
    if S == 1:  # whole experts keep the contiguous ranges
        for r in range(world):
            assert [e for e, _ in ExpertShard(r, world).pieces(n)] == list(expert_range(n, r, world))


def test_slices_even_out_the_slowest_rank():
    """One row routed to 8 of 384 experts on 7 ranks: the most loaded rank holds ~2.7 experts' bytes whole, ~1.6
    with 4 slices (simulation; reference/perf.md §3.2 gives 2.72 for whole experts)."""
    g = torch.Generator().manual_seed(0)
    worst = {1: 0.0, 4: 0.0}
    for _ in range(500):
        ids = torch.rand(1, 384, generator=g).topk(8).indices
        for S in worst:
            loads = []
            for r in range(7):
                stack = ExpertStack(torch.empty(len(ExpertShard(r, 7, S).pieces(384))), None, None,
                                    ExpertShard(r, 7, S).first(384), S, r, 7)
                local, _ = local_pairs(ids, torch.ones(1, 8), stack)
                loads.append(int((local >= 0).sum()) / S)
            worst[S] += max(loads) / 500
    assert 2.5 < worst[1] < 2.9 and 1.45 < worst[4] < 1.75, worst


def int4_experts(n: int, H: int, I: int, seed: int) -> ExpertStack:
    g = torch.Generator().manual_seed(seed)

    def q(out: int, inp: int) -> Int4Weight:
        packed, scale = zip(*(quantize_int4_groupwise(torch.randn(out, inp, generator=g)) for _ in range(n)))
        return Int4Weight(torch.stack(packed), torch.stack(scale), (out, inp))

    return ExpertStack(q(I, H), q(I, H), q(H, I), 0)


@pytest.mark.parametrize("world,S", [(1, 2), (2, 2), (3, 4), (7, 4), (5, 8)])
def test_sliced_ranks_sum_to_the_whole_experts(world, S):
    n, H, I, T, k = 12, 64, 256, 9, 4
    whole = int4_experts(n, H, I, seed=world * S)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(T)])
    ids[0, 1] = n + 3  # an id no rank holds contributes nothing
    w = torch.rand(T, k, generator=g)
    ref = moe_experts_ref(x, ids.where(ids < n, 0), w * (ids < n), whole)
    shards = [cut_experts(whole, ExpertShard(r, world, S)) for r in range(world)]
    for path in (moe_experts_ref, moe_experts_dense):
        got = sum(path(x, ids, w, s) for s in shards)
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-3), (path.__name__, float((got - ref).abs().max()))


def test_synthetic_slices_are_cuts_of_the_whole_experts():
    cfg = preset_config("k26-mini", 2)
    whole = random_target(cfg, experts=range(cfg.n_routed_experts), heads=range(cfg.num_attention_heads),
                          device="cpu", dtype=torch.float32).layers[1].mlp.experts
    for r in range(3):
        shard = ExpertShard(r, 3, 2)
        part = random_target(cfg, experts=shard, heads=range(cfg.num_attention_heads), device="cpu",
                             dtype=torch.float32).layers[1].mlp.experts
        want = cut_experts(whole, shard)
        for a, b in ((part.gate_proj, want.gate_proj), (part.down_proj, want.down_proj)):
            assert a.shape == b.shape and torch.equal(a.packed, b.packed) and torch.equal(a.scale, b.scale)


def test_loader_reads_the_slices_of_the_checkpoint(tiny_ckpt):
    whole = load_target_weights(tiny_ckpt, dtype=torch.float32).layers[1].mlp.experts
    part = load_target_weights(tiny_ckpt, dtype=torch.float32, ep_rank=1, ep_size=3,
                               expert_slices=2).layers[1].mlp.experts
    want = cut_experts(whole, ExpertShard(1, 3, 2))
    assert (part.slices, part.rank, part.world) == (2, 1, 3)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        a, b = getattr(part, proj), getattr(want, proj)
        assert a.shape == b.shape and torch.equal(a.packed, b.packed) and torch.equal(a.scale, b.scale), proj


def test_slices_must_cut_whole_scale_groups(tiny_ckpt):
    with pytest.raises(ValueError, match="expert_slices"):
        load_target_weights(tiny_ckpt, dtype=torch.float32, ep_rank=0, ep_size=2, expert_slices=4)  # 64 / 4 = 16
    with pytest.raises(ValueError, match="expert_slices"):
        VerifierConfig(model="m", expert_slices=3)
