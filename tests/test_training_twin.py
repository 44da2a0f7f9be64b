"""The training twin (tools/k2_twin.py) computes the same function as verifier_service's K2Model."""

from __future__ import annotations

import copy

import pytest
import torch

from tools.k2_twin import K2Twin
from verifier_service.model import K2Model
from verifier_service.model_config import K2Config
from verifier_service.plan import SeqRows, build_plan, chain_parents
from verifier_service.tiny_checkpoint import TEXT_DEFAULTS

SMALL = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=96,
             moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3, vocab_size=300,
             bos_token_id=0, eos_token_id=1)


def small_cfg(**overrides) -> K2Config:
    text = copy.deepcopy(TEXT_DEFAULTS)
    text.update(SMALL, **overrides)
    return K2Config.from_json(text)


def random_twin(cfg: K2Config, seed: int = 0) -> K2Twin:
    twin = K2Twin(cfg).init_weights(seed, std=0.15)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if p.dim() == 1:  # norms around 1, not exactly 1
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
        for layer in twin.model.layers:  # a non-zero selection bias
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(cfg.n_routed_experts, generator=gen))
    return twin


def verifier_prefill(cfg: K2Config, twin: K2Twin, tokens: list[int], layer_ids: list[int]):
    model = K2Model(cfg, twin.target_weights(torch.float32))
    page_size, n = 8, len(tokens)
    pages = list(range((n + page_size - 1) // page_size))
    kv = torch.zeros(cfg.num_hidden_layers, len(pages), page_size, cfg.kv_cache_width)
    plan = build_plan([SeqRows(tokens, chain_parents(n), 0, pages, list(range(n)))], explicit_mla=True)
    return model.forward(plan, kv, layer_ids)


@pytest.mark.parametrize("overrides", [{}, {"n_group": 4, "topk_group": 2}, {"rope_scaling": None}])
def test_twin_logits_equal_k2model(overrides):
    torch.manual_seed(0)
    cfg = small_cfg(**overrides)
    twin = random_twin(cfg).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 21), generator=torch.Generator().manual_seed(3))
    layer_ids = [0, 2]
    with torch.no_grad():
        logits, hidden = twin(tokens, capture=layer_ids)
    for b in range(tokens.shape[0]):
        ref = verifier_prefill(cfg, twin, tokens[b].tolist(), layer_ids)
        scale = ref.logits.abs().max()
        assert (logits[b] - ref.logits).abs().max() <= 1e-4 * scale
        feats = torch.cat(hidden, dim=-1)[b]
        assert (feats - ref.hidden).abs().max() <= 1e-4 * ref.hidden.abs().max()


def test_twin_is_differentiable_and_balances():
    cfg = small_cfg()
    twin = random_twin(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    logits, _ = twin(tokens)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    grads = {n: p.grad for n, p in twin.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["model.layers.1.mlp.gate.weight"].abs().sum() > 0  # the router learns through the weights
    assert grads["model.layers.1.mlp.experts.gate_proj"].abs().sum() > 0
    before = twin.model.layers[1].mlp.gate.e_score_correction_bias.clone()
    twin.balance_router(1e-3)
    assert not torch.equal(before, twin.model.layers[1].mlp.gate.e_score_correction_bias)


def test_checkpoint_tensors_round_trip():
    cfg = small_cfg()
    twin = random_twin(cfg)
    tensors = twin.checkpoint_tensors()
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in tensors
    assert tensors["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (cfg.hidden_size, cfg.moe_intermediate_size)
    other = K2Twin(cfg)
    other.load_checkpoint_tensors(tensors)
    for (n, a), (_, b) in zip(twin.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), n


def test_drafter_training_forward_equals_service_draft():
    """tools.drafter_objective.block_logits (all anchors at once, training masks) gives, for each anchor, the
    logits drafter_service computes for a root at that position with the context before it injected."""
    from tools.drafter_objective import block_logits
    from tools.train_drafter import drafter_config, new_drafter

    cfg = small_cfg()
    twin = random_twin(cfg)
    dcfg = drafter_config(cfg, [0, 2], dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=16, intermediate_size=48, block_size=5))
    dcfg["dflash_config"]["mask_token_id"] = cfg.vocab_size - 2
    d = new_drafter(dcfg, twin, torch.device("cpu"), seed=0).eval()
    gen = torch.Generator().manual_seed(5)
    S = 24
    tokens = torch.randint(0, cfg.vocab_size, (2, S), generator=gen)
    feats = torch.randn(2, S, 2 * cfg.hidden_size, generator=gen)
    anchors = torch.tensor([[1, 7, 19], [3, 4, 12]])
    with torch.no_grad():
        got = block_logits(d, feats, tokens, anchors)  # [2, 3, 4, V]
        for b in range(2):
            for j, a in enumerate(anchors[b].tolist()):
                k, v = d.context_kv(feats[b, :a], torch.arange(a))  # [layers, a, nkv, hd]
                ids = torch.full((1, 5), dcfg["dflash_config"]["mask_token_id"])
                ids[0, 0] = tokens[b, a]
                hidden = d.forward_block(ids, (a + torch.arange(5))[None], torch.arange(a)[None],
                                         torch.ones(1, a, dtype=torch.bool), lambda layer: (k[layer][None], v[layer][None]))
                want = d.logits(hidden[:, 1:])[0]
                assert (got[b, j] - want).abs().max() <= 1e-4 * want.abs().max()
