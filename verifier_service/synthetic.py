"""Full-dimension Kimi K2.6 weights with random values, made directly on the device (no checkpoint).

For benchmarks of the real shapes: `k26_config(layers)` is K2.6's text config with fewer layers, and
`random_target` builds one rank's slice (its heads and experts) in the checkpoint's formats: bf16
attention / dense / shared / embeddings / head, INT4 pack-quantized routed experts, fp32 router bias.
Magnitudes keep activations O(1) so the numerics stay representative.
"""

from __future__ import annotations

import math

import torch

from verifier_service.int4 import Int4Weight
from verifier_service.mla import MLAWeights
from verifier_service.model import LayerWeights, TargetWeights
from verifier_service.model_config import K2Config
from verifier_service.moe import ExpertStack, MLPWeights, MoEWeights

K26_TEXT_CONFIG = {  # reference/k26.md §1.2
    "model_type": "kimi_k2", "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
    "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 384, "num_experts_per_tok": 8,
    "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "routed_scaling_factor": 2.827, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc", "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "max_position_embeddings": 262144, "tie_word_embeddings": False, "bos_token_id": 163584,
    "eos_token_id": 163585, "attention_bias": False, "num_nextn_predict_layers": 0,
    "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                "group_size": 32, "dynamic": False}}}},
}


def k26_config(num_layers: int = 61) -> K2Config:
    return K2Config.from_json({**K26_TEXT_CONFIG, "num_hidden_layers": num_layers})


class _Random:
    def __init__(self, device, dtype, seed: int):
        self.device, self.dtype = torch.device(device), dtype
        self.gen = torch.Generator(device=self.device).manual_seed(seed)

    def dense(self, out: int, inp: int) -> torch.Tensor:  # [out, in], std 1/sqrt(in)
        t = torch.empty(out, inp, device=self.device, dtype=self.dtype)
        return t.normal_(0.0, 1.0 / math.sqrt(inp), generator=self.gen)

    def norm(self, n: int) -> torch.Tensor:
        return torch.ones(n, device=self.device, dtype=self.dtype)

    def int4(self, experts: int, out: int, inp: int) -> Int4Weight:
        """Uniform random nibbles (q in [-8, 7], std ≈ 4.6) with scales giving std 1/sqrt(in)."""
        packed = torch.randint(-2**31, 2**31 - 1, (experts, out, inp // 8), device=self.device,
                               dtype=torch.int32, generator=self.gen)
        scale = torch.full((experts, out, inp // 32), 1.0 / (4.6 * math.sqrt(inp)), device=self.device,
                           dtype=torch.bfloat16)
        return Int4Weight(packed, scale, (out, inp))


def random_target(cfg: K2Config, *, experts: range, heads: range, device="cuda", dtype=torch.bfloat16,
                  seed: int = 0) -> TargetWeights:
    r = _Random(device, dtype, seed)
    layers = tuple(_layer(r, cfg, i, experts, heads) for i in range(cfg.num_hidden_layers))
    return TargetWeights(embed_tokens=r.dense(cfg.vocab_size, cfg.hidden_size) * 50, layers=layers,
                         norm=r.norm(cfg.hidden_size), lm_head=r.dense(cfg.vocab_size, cfg.hidden_size))


def _layer(r: _Random, cfg: K2Config, i: int, experts: range, heads: range) -> LayerWeights:
    H, h = cfg.hidden_size, len(heads)
    attn = MLAWeights(
        q_a_proj=r.dense(cfg.q_lora_rank, H), q_a_layernorm=r.norm(cfg.q_lora_rank),
        q_b_proj=r.dense(h * cfg.qk_head_dim, cfg.q_lora_rank),
        kv_a_proj_with_mqa=r.dense(cfg.kv_lora_rank + cfg.qk_rope_head_dim, H),
        kv_a_layernorm=r.norm(cfg.kv_lora_rank),
        kv_b_proj=r.dense(h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        o_proj=r.dense(H, h * cfg.v_head_dim))
    if cfg.is_moe_layer(i):
        I, E = cfg.moe_intermediate_size, len(experts)
        stack = ExpertStack(gate_proj=r.int4(E, I, H), up_proj=r.int4(E, I, H), down_proj=r.int4(E, H, I),
                            first=experts.start)
        shared = MLPWeights(r.dense(I * cfg.n_shared_experts, H), r.dense(I * cfg.n_shared_experts, H),
                            r.dense(H, I * cfg.n_shared_experts))
        bias = torch.randn(cfg.n_routed_experts, device=r.device, generator=r.gen) * 0.01
        mlp = MoEWeights(gate=r.dense(cfg.n_routed_experts, H).float(), e_score_correction_bias=bias,
                         experts=stack, shared_experts=shared)
    else:
        mlp = MLPWeights(r.dense(cfg.intermediate_size, H), r.dense(cfg.intermediate_size, H),
                         r.dense(H, cfg.intermediate_size))
    return LayerWeights(input_layernorm=r.norm(H), self_attn=attn, post_attention_layernorm=r.norm(H), mlp=mlp)
