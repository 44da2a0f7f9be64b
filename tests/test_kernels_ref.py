"""CPU: each kernel's torch reference computes what the model's own reference computes, so the
model can swap one for the other with a flag (the GPU tests then hold each kernel to its reference)."""

from __future__ import annotations

import types

import torch

from drafter_service.tree import build_tree, topk_logprobs
from kernels.bench import mla_case, random_experts, spread_routing
from kernels.ddtree_build import ddtree_topk_ref, ddtree_tree_ref
from kernels.kv_commit import kv_commit_ref
from kernels.mla_rope import mla_rope_ref
from kernels.mla_tree_attention import mla_tree_attention_ref
from kernels.moe_gate import moe_gate_ref
from kernels.moe_w4a16 import moe_w4a16_ref
from kernels.rms_norm import latent_norms_ref
from kernels.tree_accept import tree_accept_ref
from verifier_service.acceptance import walk_tree
from verifier_service.int4 import Int4Weight
from verifier_service.kv_cache import PagedKVCache
from verifier_service import mla
from verifier_service.mla import MLAWeights, attend_absorbed
from verifier_service.moe import ExpertStack, moe_experts_ref, route
from verifier_service.plan import SeqRows, build_plan, key_groups
from verifier_service.rope import apply_rope


def test_moe_ref_matches_model_reference():
    E, H, I = 6, 256, 128
    ex = random_experts(E, H, I, first=3, device="cpu")
    stack = ExpertStack(*(Int4Weight(w.packed, w.scale, (w.packed.shape[1], w.scale.shape[2] * 32), w.tiled)
                          for w in (ex.gate_proj, ex.up_proj, ex.down_proj)), first=3)
    ids, w = spread_routing(5, 4, 6, E, device="cpu")
    ids = ids + 1  # ids 1..6: expert ids 1, 2 belong to another rank
    x = torch.randn(5, H).bfloat16()
    ours, model = moe_w4a16_ref(x, ids, w, ex), moe_experts_ref(x, ids, w, stack)
    # the model's reference rounds dequantized weights and activations to bf16; ours stays fp32
    assert ((ours.float() - model.float()).norm() / model.float().norm()) < 2e-2


def test_mla_ref_matches_attend_absorbed():
    rows, prefixes, heads, ps = [3, 5], [7, 20], 2, 4
    q, kv, table, prefix_lens, starts, mask, slots = mla_case(rows, prefixes, heads, ps, device="cpu")
    cfg = types.SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=512, v_head_dim=512,
                                softmax_scale=0.1)
    eye = torch.eye(512).repeat(heads, 2, 1)  # W_UK = W_UV = I: q_lat = q_nope, output = o_lat
    unused = torch.zeros(1, 1)  # the latent projections, norms and o_proj: attend_absorbed reads only kv_b
    w = MLAWeights(*[unused] * 5, kv_b_proj=eye, o_proj=unused)
    seqs = [SeqRows([0] * n, [int(p) for p in _parents(mask[s:s + n, :n])], pre, table[b].tolist(),
                    slots[s:s + n].tolist()) for b, (n, pre, s) in enumerate(zip(rows, prefixes, starts.tolist()))]
    plan = build_plan(seqs)
    assert torch.equal(plan.tree_mask, mask)
    flat = kv.view(-1, 576).float().nan_to_num()
    got = mla_tree_attention_ref(q, kv, table, prefix_lens, starts, mask, slots, 0.1).float()
    for gr in key_groups(plan, ps):
        want = attend_absorbed(q[gr.rows, :, :512].float(), q[gr.rows, :, 512:].float(), flat[gr.key_slots],
                               gr.mask, w, cfg)
        assert torch.allclose(got[gr.rows].flatten(1), want, atol=2e-2, rtol=1e-2)


def _parents(mask: torch.Tensor) -> list[int]:
    """Tree mask rows (ancestors + self) -> parent of each row (-1 for the root)."""
    return [max((j for j in range(i) if mask[i, j]), default=-1) for i in range(mask.shape[0])]


def test_tree_accept_ref_matches_walk_tree():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        n = int(torch.randint(1, 40, (1,), generator=g))
        parents = [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n + 1)]
        tokens = torch.randint(0, 3, (n,), generator=g).tolist()
        target = torch.randint(0, 3, (n + 1,), generator=g).tolist()
        walk = walk_tree(tokens, parents, target)
        acc, emi, num = tree_accept_ref(torch.tensor([tokens]), torch.tensor([parents]), torch.tensor([target]))
        assert acc[0, : num[0]].tolist() == walk.accepted_rows and emi[0, : num[0]].tolist() == walk.tokens


def test_kv_commit_ref_matches_paged_cache_commit():
    cache = PagedKVCache(num_layers=3, width=16, num_pages=8, page_size=4)
    cache.kv.copy_(torch.randn_like(cache.kv))
    cache.table.open("s")
    cache.table.extend("s", 5)
    scratch = cache.table.scratch("s", 6)
    src = [scratch[r] for r in (0, 2, 5)]
    expected = cache.kv.clone()
    dst = cache.commit("s", [0, 2, 5])
    kv_commit_ref(expected, torch.tensor(src), torch.tensor(dst))
    assert torch.equal(cache.kv, expected)


def test_ddtree_refs_match_drafter_tree():
    g = torch.Generator().manual_seed(0)
    for S, L, V, k, budget in ((1, 1, 50, 1, 1), (2, 7, 300, 4, 16), (3, 15, 1000, 8, 64), (1, 3, 40, 2, 100)):
        logits = torch.randn(S, L, V, generator=g) * 3
        ids, lps = ddtree_topk_ref(logits, k)
        want_ids, want_lps = topk_logprobs(logits, k)
        assert ids.tolist() == want_ids.tolist() and torch.allclose(lps, torch.from_numpy(want_lps))
        tokens, parents, depths, logprobs, count = ddtree_tree_ref(ids, lps, budget)
        full = torch.log_softmax(logits, dim=-1)
        for s in range(S):
            tree = build_tree(ids[s].numpy(), lps[s].numpy(), budget)
            n = int(count[s])
            assert n == len(tree) and tokens[s, :n].tolist() == tree.tokens.tolist()
            assert parents[s, :n].tolist() == tree.parents.tolist() and depths[s, :n].tolist() == tree.depths.tolist()
            # each node's log q at its depth, from the logits themselves
            want = full[s, depths[s, :n].long() - 1, tokens[s, :n]]
            assert torch.allclose(logprobs[s, :n], want, atol=1e-5)
            assert logprobs[s, :n].tolist() == tree.logprobs.tolist()
            assert (logprobs[s, n:] == 0).all()


def test_moe_gate_ref_matches_model_route():
    """kernels/moe_gate's reference routes as verifier_service.moe.route does for one expert group."""
    E, H, k = 24, 64, 4
    cfg = types.SimpleNamespace(n_group=1, topk_group=1, num_experts_per_tok=k, norm_topk_prob=True,
                                routed_scaling_factor=2.827)
    g = torch.Generator().manual_seed(3)
    w = types.SimpleNamespace(gate=torch.randn(E, H, generator=g), e_score_correction_bias=torch.randn(E, generator=g))
    x = torch.randn(9, H, generator=g).bfloat16()
    want_ids, want_w = route(x, w, cfg)
    ids, weights = moe_gate_ref(x, w.gate, w.e_score_correction_bias, k, 2.827)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)
    for live in (0, 4, 9, 12):  # rows from `live` on are a graph's pad rows: no expert, weight 0
        live_rows = torch.tensor([live])
        for got_ids, got_w in (route(x, w, cfg, live_rows=live_rows),
                               moe_gate_ref(x, w.gate, w.e_score_correction_bias, k, 2.827, live_rows=live_rows)):
            assert torch.equal(got_ids[:live], want_ids[:live]) and torch.equal(got_w[:live], want_w[:live])
            assert got_ids[live:].eq(-1).all() and got_w[live:].eq(0).all()


def test_mla_rope_ref_matches_apply_rope():
    """kernels/mla_rope's reference rotates q's rope part and writes [c | rope(k_rope)] rows as the model's
    mla_project + cache write do."""
    T, h, nope, R, C = 5, 3, 8, 4, 6
    g = torch.Generator().manual_seed(5)
    q, kv = torch.randn(T, h, nope + R, generator=g), torch.randn(T, C + R, generator=g)
    c = torch.randn(T, C, generator=g)
    angles = torch.rand(T, R // 2, generator=g) * 50
    cache, slots = torch.zeros(12, C + R), torch.tensor([7, 0, 3, 11, 5])
    q_rope = mla_rope_ref(q, kv, c, angles.cos(), angles.sin(), cache, slots)
    assert torch.equal(q_rope, apply_rope(q[..., nope:], angles.cos()[:, None], angles.sin()[:, None]))
    assert torch.equal(cache[slots], torch.cat([c, apply_rope(kv[:, C:], angles.cos(), angles.sin())], dim=-1))
    assert cache[[1, 2, 4, 6, 8, 9, 10]].eq(0).all()


def test_latent_norms_ref_matches_the_model():
    """kernels/rms_norm latent_norms' reference: the model's two latent norms, and the cache row the model writes
    (the normed latent, then the rotated k_rope)."""
    T, q_lora, C, R = 4, 12, 8, 4
    g = torch.Generator().manual_seed(6)
    x1, kv = torch.randn(T, q_lora, generator=g), torch.randn(T, C + R, generator=g)
    w1, w2 = torch.rand(q_lora, generator=g) + 0.5, torch.rand(C, generator=g) + 0.5
    angles = torch.rand(T, R // 2, generator=g) * 50
    cache, slots = torch.zeros(9, C + R), torch.tensor([8, 0, 3, 5])
    q_lat = latent_norms_ref(x1, w1, kv, w2, 1e-6, angles.cos(), angles.sin(), cache, slots)
    assert torch.allclose(q_lat, mla.rms_norm(x1, w1, 1e-6), atol=1e-6)
    want = torch.cat([mla.rms_norm(kv[:, :C], w2, 1e-6), apply_rope(kv[:, C:], angles.cos(), angles.sin())], dim=-1)
    assert torch.allclose(cache[slots], want, atol=1e-6)
    assert cache[[1, 2, 4, 6, 7]].eq(0).all()


def test_mla_ref_rotates_the_query_as_the_model():
    """mla_tree_attention_ref given rope = (q_pe, cos, sin) and the 512 absorbed columns: the same as given the query
    the model rotates with apply_rope."""
    q, *plan = mla_case([3, 1], [70, 5], 2, 16, device="cpu", seed=2)
    g = torch.Generator().manual_seed(3)
    q_pe, angles = torch.randn(q.shape[0], 2, 64, generator=g).bfloat16(), torch.rand(q.shape[0], 32, generator=g) * 9
    cos, sin = angles.cos(), angles.sin()
    full = torch.cat([q[..., :512], apply_rope(q_pe, cos[:, None], sin[:, None])], dim=-1)
    got = mla_tree_attention_ref(q[..., :512], *plan, 0.125, rope=(q_pe, cos, sin))
    assert torch.equal(got, mla_tree_attention_ref(full, *plan, 0.125))
    assert not torch.equal(got, mla_tree_attention_ref(q, *plan, 0.125))  # the rope part does count
