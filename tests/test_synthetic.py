"""Synthetic full-dimension models for benchmarks without checkpoints (issue 10): random target slices
agree across world sizes, the drafter presets carry the released config numbers, the synthetic tokenizer
covers K2.6's vocabulary, and the expert-parallel floor matches reference/perf.md."""

import pytest
import torch

from drafter_service.synthetic import preset_config as drafter_preset
from drafter_service.synthetic import random_drafter
from gateway.tiny_tokenizer import write_synthetic_tokenizer
from gateway.tokenizer import KimiTokenizer
from verifier_service.bench_verify import expected_max_experts, to_slowest_rank
from verifier_service.expert_shard import ExpertShard
from verifier_service.ranks import split_range, split_rows
from verifier_service.synthetic import k26_config, preset_config, random_target
from verifier_service.weights import Split


def rank_weights(cfg, rank: int, world: int):
    return random_target(cfg, experts=split_range(cfg.n_routed_experts, rank, world),
                         heads=split_range(cfg.num_attention_heads, rank, world), device="cpu", dtype=torch.float32)


def test_random_target_slices_equal_the_unsplit_model():
    """Every part is seeded by its name: replicated tensors agree on all ranks, split ones are slices."""
    cfg = preset_config("k26-mini", 3)
    full = rank_weights(cfg, 0, 1)
    for rank in range(3):
        part = rank_weights(cfg, rank, 3)
        heads, experts = split_range(4, rank, 3), split_range(16, rank, 3)
        assert torch.equal(part.embed_tokens, full.embed_tokens) and torch.equal(part.lm_head, full.lm_head)
        for a, b in zip(part.layers, full.layers):
            assert torch.equal(a.self_attn.kv_a_proj_with_mqa, b.self_attn.kv_a_proj_with_mqa)
            rows = slice(heads.start * cfg.qk_head_dim, heads.stop * cfg.qk_head_dim)
            assert torch.equal(a.self_attn.q_b_proj, b.self_attn.q_b_proj[rows])
            cols = slice(heads.start * cfg.v_head_dim, heads.stop * cfg.v_head_dim)
            assert torch.equal(a.self_attn.o_proj, b.self_attn.o_proj[:, cols])
        moe_a, moe_b = part.layers[1].mlp, full.layers[1].mlp
        assert torch.equal(moe_a.gate, moe_b.gate) and moe_a.experts.first == experts.start
        assert torch.equal(moe_a.experts.down_proj.packed, moe_b.experts.down_proj.packed[experts.start:experts.stop])


def test_split_replicated_parts_are_slices_of_the_replicated_ones():
    """With `split` (--split-replicated), each rank holds its rows of the dense and shared gate/up, columns of
    their down and vocab rows of embed / head: slices of the same random tensors, covering them exactly."""
    cfg = preset_config("k26-mini", 2)
    full = rank_weights(cfg, 0, 1)
    world = 3
    parts = [random_target(cfg, experts=split_range(16, r, world), heads=split_range(4, r, world), device="cpu",
                           dtype=torch.float32, split=Split(r, world)) for r in range(world)]
    for name in ("embed_tokens", "lm_head"):
        assert torch.equal(torch.cat([getattr(p, name) for p in parts]), getattr(full, name))
    assert [p.vocab_start for p in parts] == [split_rows(cfg.vocab_size, r, world).start for r in range(world)]
    for layer, mlp in ((0, lambda w: w.layers[0].mlp), (1, lambda w: w.layers[1].mlp.shared_experts)):
        want = mlp(full)
        assert torch.equal(torch.cat([mlp(p).gate_proj for p in parts]), want.gate_proj), layer
        assert torch.equal(torch.cat([mlp(p).up_proj for p in parts]), want.up_proj), layer
        assert torch.equal(torch.cat([mlp(p).down_proj for p in parts], dim=1), want.down_proj), layer
        assert mlp(parts[0]).gate_proj.shape[0] < want.gate_proj.shape[0]


@pytest.mark.parametrize("world", [1, 3])
def test_floor_counts_one_ranks_tensors(world):
    """bench verify's floor (every expert touched, an empty prefix) equals the bytes rank 0 holds, split
    layout included, less what a step does not stream: the embedding (a few rows), norms, router bias."""
    from verifier_service.bench_verify import floor_bytes
    from verifier_service.runner import weight_nbytes

    cfg = preset_config("k26-mini", 3)
    experts, heads = split_range(16, 0, world), split_range(4, 0, world)
    w = random_target(cfg, experts=experts, heads=heads, device="cpu", dtype=torch.bfloat16, split=Split(0, world))
    norms = sum(t.numel() for layer in w.layers
                for t in (layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn.q_a_layernorm,
                          layer.self_attn.kv_a_layernorm))
    not_streamed = 2 * (norms + w.norm.numel() + w.embed_tokens.numel()) + sum(
        4 * layer.mlp.e_score_correction_bias.numel() for layer in w.layers[1:])
    kv = cfg.num_hidden_layers * cfg.kv_cache_width * 2  # the one row's own latent
    want = weight_nbytes(w) - not_streamed + kv
    assert floor_bytes(cfg, 3, len(experts), len(heads), 1, 0, touched=len(experts), split=world) == want


def test_presets_use_the_real_config_numbers():
    cfg = k26_config()
    assert (cfg.num_hidden_layers, cfg.n_routed_experts, cfg.vocab_size, cfg.hidden_size) == (61, 384, 163840, 7168)
    d = drafter_preset("k26")
    assert (d.num_hidden_layers, d.hidden_size, d.num_attention_heads, d.num_key_value_heads, d.head_dim,
            d.intermediate_size, d.block_size, d.mask_token_id, d.vocab_size) == (6, 7168, 64, 8, 128, 18432, 8,
                                                                                  163838, 163840)
    assert d.target_layer_ids == (1, 12, 24, 35, 47, 58)
    mini, target = drafter_preset("k26-mini"), preset_config("k26-mini")
    assert mini.hidden_size == target.hidden_size and max(mini.target_layer_ids) < target.num_hidden_layers
    assert max(drafter_preset("k26", 4).target_layer_ids) < 4  # follows --synthetic-layers
    model = random_drafter("k26-mini", dtype=torch.float32)
    assert model.embed_tokens.shape == (163840, 128) and model.fc.weight.shape == (128, 256)


def test_synthetic_tokenizer_covers_k26_ids(tmp_path):
    info = write_synthetic_tokenizer(tmp_path)
    tok = KimiTokenizer.from_dir(tmp_path)
    assert tok.vocab_size == info["vocab_size"] == 163840
    assert (info["bos_token_id"], info["eos_token_id"], info["mask_token_id"]) == (163584, 163585, 163838)
    text = "Hello world 2026, synthetic."
    assert tok.decode(tok.encode(text)) == text
    assert tok.token_bytes(163583) and tok.is_special(163838)


@pytest.mark.parametrize("rows, want", [(1, 2.72), (8, 12.25), (64, 44.96)])
def test_expected_max_experts_matches_perf_md(rows, want):
    """reference/perf.md §3.2: the most-loaded of 7 ranks under uniform routing (Monte Carlo there too)."""
    assert expected_max_experts(k26_config(), 7, rows) == pytest.approx(want, abs=0.15)


def test_split_rows_aligned_and_covering():
    """The replicated parts' split: contiguous shares covering 0..n-1 in order, in multiples of 8 elements
    (16-byte bf16 rows for every rank's GEMMs) at most 8 apart, or split_range's plain split when n is not
    a multiple of 8 or too small to give every rank 8."""
    for n, size in ((2048, 7), (18432, 7), (163840, 7), (4352, 3), (100, 3), (16, 3), (12, 7)):
        parts = [split_rows(n, r, size) for r in range(size)]
        assert [i for p in parts for i in p] == list(range(n))
        lens = [len(p) for p in parts]
        if n % 8 == 0 and n // 8 >= size:
            assert all(x % 8 == 0 and x > 0 for x in lens) and max(lens) - min(lens) <= 8, (n, size, lens)
        else:
            assert parts == [split_range(n, r, size) for r in range(size)]


def test_slowest_routing_puts_the_most_loaded_rank_on_rank_0():
    """`bench verify --routing slowest`: each uniform draw rotated so that rank 0 holds the most loaded rank's
    experts; over many one-row draws rank 0 then holds the expected maximum (~2.7), not the mean (~1.14)."""
    n, world, k = 384, 7, 8
    g = torch.Generator().manual_seed(0)
    held = []
    for rows in (1, 1, 1, 16) * 100:
        ids = torch.rand(rows, n, generator=g).topk(k).indices
        loads = [int(ids[(ids >= r.start) & (ids < r.stop)].unique().numel())
                 for r in (split_range(n, q, world) for q in range(world))]
        rotated = to_slowest_rank(ids, n, world)
        assert all(len(set(row)) == k for row in rotated.tolist())
        mine = int(rotated[rotated < split_range(n, 0, world).stop].unique().numel())
        assert max(loads) <= mine <= max(loads) + 1, (loads, mine)
        if rows == 1:
            held.append(mine)
    assert 2.5 < sum(held) / len(held) < 2.95


@pytest.mark.parametrize("S", [2, 4, 8])
def test_slowest_routing_with_expert_slices(S):
    """`--routing slowest --expert-slices S`: rank 0 holds as many touched slices as the most loaded rank, counted
    by brute force over ExpertShard's pieces of every rank."""
    n, world, k = 384, 7, 8
    g = torch.Generator().manual_seed(S)
    pieces = [set(ExpertShard(r, world, S).pieces(n)) for r in range(world)]
    for rows in (1, 2, 16, 64) * 10:
        ids = torch.rand(rows, n, generator=g).topk(k).indices
        touched = {(e, s) for e in ids.unique().tolist() for s in range(S)}
        rotated = to_slowest_rank(ids, n, world, S)
        assert all(len(set(row)) == k for row in rotated.tolist())
        mine = len({(e, s) for e in rotated.unique().tolist() for s in range(S)} & pieces[0])
        assert mine == max(len(touched & p) for p in pieces)
