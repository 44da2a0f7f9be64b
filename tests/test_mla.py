"""MLA: absorbed (latent MQA) form = explicit (decompressed K/V) form; head slices sum to the whole;
YaRN RoPE numbers against the closed forms of reference/k26.md §3.4-§3.5."""

from __future__ import annotations

import json
import math

import pytest
import torch
from model_fixtures import new_cache, prefill, single_thread, tiny_dir, tiny_model  # noqa: F401

from verifier_service.mla import (MLAWeights, attend_absorbed, attend_explicit, mla_forward, mla_project,
                                  uk_transposed)
from verifier_service.model_config import K2Config
from verifier_service.plan import KeyGroup
from verifier_service.rope import apply_rope, rope_cos_sin, rope_inv_freq


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).norm() / ref.norm()).item()


def _attention_inputs(model, n_keys: int = 40, n_rows: int = 9, seed: int = 0):
    """Latent rows for n_keys cached tokens, queries for the last n_rows, a random tree-ish mask."""
    g = torch.Generator().manual_seed(seed)
    cfg, w = model.cfg, model.weights.layers[1].self_attn
    x = torch.randn(n_keys, cfg.hidden_size, generator=g)
    positions = torch.randint(0, 200_000, (n_keys,), generator=g)
    cos, sin = rope_cos_sin(model.inv_freq, positions, cfg.rope_amplitude)
    q_nope, q_rope, latent = mla_project(x, w, cfg, cos, sin)
    mask = torch.rand(n_rows, n_keys, generator=g) < 0.6
    mask[torch.arange(n_rows), n_keys - n_rows + torch.arange(n_rows)] = True  # every row sees itself
    return cfg, w, q_nope[-n_rows:], q_rope[-n_rows:], latent, mask


def test_absorbed_equals_explicit(tiny_model):
    cfg, w, q_nope, q_rope, keys, mask = _attention_inputs(tiny_model)
    explicit = attend_explicit(q_nope, q_rope, keys, mask, w, cfg)
    absorbed = attend_absorbed(q_nope, q_rope, keys, mask, w, cfg)
    assert explicit.shape == (q_nope.shape[0], cfg.num_attention_heads * cfg.v_head_dim)
    assert rel_err(absorbed, explicit) < 1e-5
    # The mask matters: attending to everything gives a different answer.
    full = attend_absorbed(q_nope, q_rope, keys, torch.ones_like(mask), w, cfg)
    assert rel_err(full, explicit) > 1e-2


def test_whole_model_absorbed_equals_explicit(tiny_model):
    tokens = torch.randint(4, 500, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    runs = [prefill(tiny_model, new_cache(tiny_model, page_size=8), "s", tokens, explicit=e, target_layer_ids=[1, 2])
            for e in (True, False)]
    assert rel_err(runs[1].logits, runs[0].logits) < 1e-5
    assert rel_err(runs[1].hidden, runs[0].hidden) < 1e-5


def _head_slice(w: MLAWeights, cfg: K2Config, heads: slice) -> MLAWeights:
    """What a head-parallel rank holds: its heads' rows of q_b / kv_b and columns of o_proj."""
    def rows(t: torch.Tensor, per_head: int) -> torch.Tensor:
        return t.view(cfg.num_attention_heads, per_head, -1)[heads].flatten(0, 1)
    o = w.o_proj.view(cfg.hidden_size, cfg.num_attention_heads, cfg.v_head_dim)[:, heads].flatten(1)
    return MLAWeights(w.q_a_proj, w.q_a_layernorm, rows(w.q_b_proj, cfg.qk_head_dim), w.kv_a_proj_with_mqa,
                      w.kv_a_layernorm, rows(w.kv_b_proj, cfg.qk_nope_head_dim + cfg.v_head_dim), o)


@pytest.mark.parametrize("explicit", [True, False])
def test_head_slices_sum_to_full_attention(tiny_model, explicit):
    """Uneven head split (like 64 over 7): the ranks' partial o_proj outputs all-reduce to the full one."""
    cfg, w = tiny_model.cfg, tiny_model.weights.layers[1].self_attn
    g = torch.Generator().manual_seed(5)
    x = torch.randn(12, cfg.hidden_size, generator=g)
    cos, sin = rope_cos_sin(tiny_model.inv_freq, torch.arange(100, 112), cfg.rope_amplitude)
    groups = [KeyGroup(slice(0, 12), torch.arange(12), torch.ones(12, 12, dtype=torch.bool).tril())]

    def run(weights: MLAWeights) -> torch.Tensor:
        kv = torch.zeros(16, cfg.kv_cache_width)
        return mla_forward(x, weights, cfg, cos, sin, kv, torch.arange(12), groups, explicit)

    full = run(w)
    parts = [run(_head_slice(w, cfg, s)) for s in (slice(0, 3), slice(3, 4))]
    assert rel_err(parts[0] + parts[1], full) < 1e-5


K26_ROPE = {
    "rope_theta": 50000.0, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
}


def test_uk_transposed_is_w_uk_per_head(tiny_model):
    """uk_transposed [h, C, nope]: head h's W_UK (rows h·(nope + v) .. + nope of kv_b) with the input dimension
    last, so q_nope · W_UK[h] = q_nope · uk_t[h]ᵀ. Checked against the explicit per-head slice of kv_b."""
    cfg, w, q_nope = _attention_inputs(tiny_model)[:3]
    uk_t = uk_transposed(w, cfg)
    heads, step = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim
    assert uk_t.shape == (heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim) and uk_t.is_contiguous()
    for h in range(heads):
        w_uk = w.kv_b_proj[h * step: h * step + cfg.qk_nope_head_dim]  # [nope, C]
        assert torch.equal(uk_t[h], w_uk.T)
        assert torch.allclose(q_nope[:, h] @ uk_t[h].T, q_nope[:, h] @ w_uk, rtol=1e-5, atol=1e-6)


def test_yarn_numbers_for_k26(tiny_dir):
    """K2.6 rope: pairs 0..8 keep base frequencies, pairs >= 20 are divided by 64, scale 0.14467963."""
    raw = json.loads((tiny_dir / "config.json").read_text())
    raw["text_config"].update(K26_ROPE, kv_lora_rank=512, v_head_dim=128)
    cfg = K2Config.from_json(raw)
    base = 1.0 / (50000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    inv = rope_inv_freq(cfg).double()
    assert torch.allclose(inv[:9], base[:9], rtol=1e-6)
    assert torch.allclose(inv[20:], base[20:] / 64, rtol=1e-6)
    assert ((inv[9:20] < base[9:20]) & (inv[9:20] > base[9:20] / 64)).all()
    assert cfg.softmax_scale == pytest.approx(0.14467963, rel=1e-7)
    assert cfg.rope_amplitude == 1.0
    assert cfg.kv_cache_width == 576


def test_rope_depends_on_position_difference_only(tiny_model):
    """q·k after interleaved RoPE is a function of p_q - p_k (amplitude 1); in fp64 to avoid angle rounding."""
    g = torch.Generator().manual_seed(7)
    d = tiny_model.cfg.qk_rope_head_dim
    q, k = torch.randn(d, generator=g, dtype=torch.float64), torch.randn(d, generator=g, dtype=torch.float64)
    inv = rope_inv_freq(tiny_model.cfg).double()

    def dot(pq: int, pk: int) -> float:
        cq, sq = torch.cos(pq * inv), torch.sin(pq * inv)
        ck, sk = torch.cos(pk * inv), torch.sin(pk * inv)
        return float(apply_rope(q, cq, sq) @ apply_rope(k, ck, sk))

    assert dot(5, 2) == pytest.approx(dot(100_003, 100_000), abs=1e-9)
    assert dot(5, 2) != pytest.approx(dot(5, 3), abs=1e-3)
    # Pair i rotates (x[2i], x[2i+1]): a unit vector on pair 0 turns by exactly the angle p·f_0.
    e0 = torch.zeros(d, dtype=torch.float64)
    e0[0] = 1
    p = 3
    rotated = apply_rope(e0, torch.cos(p * inv), torch.sin(p * inv))
    assert rotated[:2].tolist() == pytest.approx([math.cos(p * inv[0].item()), math.sin(p * inv[0].item())])
    assert rotated[2:].abs().max() == 0


def test_fused_latent_and_gate_up_projections_are_held_once():
    """q_a ; kv_a and gate ; up are concatenated at construction and the named fields become views of the
    fused tensors: same values, and the memory a verifier rank reports counts each byte once."""
    from verifier_service.moe import MLPWeights
    from verifier_service.runner import weight_nbytes

    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(shape, generator=g) for shape in ((24, 16), (24,), (40, 24), (12, 16), (8,), (64, 8),
                                                            (16, 20))]
    w = MLAWeights(*(p.clone() for p in parts))
    assert torch.equal(w.qkv_a_proj, torch.cat([parts[0], parts[3]]))
    assert torch.equal(w.q_a_proj, parts[0]) and torch.equal(w.kv_a_proj_with_mqa, parts[3])
    assert w.kv_a_proj_with_mqa.untyped_storage().data_ptr() == w.qkv_a_proj.untyped_storage().data_ptr()
    assert weight_nbytes(w) == sum(p.numel() * 4 for p in parts)
    gate, up, down = (torch.randn(shape, generator=g) for shape in ((32, 16), (32, 16), (16, 32)))
    mlp = MLPWeights(gate.clone(), up.clone(), down.clone())
    assert torch.equal(mlp.gate_up_proj, torch.cat([gate, up])) and torch.equal(mlp.up_proj, up)
    assert weight_nbytes([w, mlp]) == sum(p.numel() * 4 for p in parts) + 3 * 32 * 16 * 4
