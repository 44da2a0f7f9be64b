"""A small random target checkpoint in exactly the K2.6 on-disk format (reference/k26.md §1-§2).

Wrapper `config.json` (kimi_k25 + `text_config` kimi_k2 + compressed-tensors `quantization_config`),
`language_model.`-prefixed names, INT4 pack-quantized routed experts, bf16 everything else, fp32
router bias, a few vision tensors, several shards named `model-0000N-of-00000M.safetensors` (Moonshot:
5-digit index, 6-digit total) and `model.safetensors.index.json`. Same seed -> same bytes.

Weights use fan-in scaling (std 1/sqrt(in)), embeddings std 1, norm weights 1 ± 0.1, so attention is
peaked enough to depend on positions, routing is spread, and logits are far from ties.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from verifier_service.int4 import quantize_int4_groupwise

Maker = Callable[..., torch.Tensor]  # random-tensor factory bound to the seeded generator
PREFIX = "language_model."
GROUP_SIZE = 32

QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": GROUP_SIZE, "dynamic": False, "observer": "minmax", "actorder": None},
            "input_activations": None,
            "output_activations": None,
        }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
}

TEXT_DEFAULTS: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
    "hidden_size": 256, "num_hidden_layers": 4, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
    "intermediate_size": 512, "moe_intermediate_size": 64,
    "n_routed_experts": 16, "num_experts_per_tok": 4, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 2.827, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc", "seq_aux": True, "aux_loss_alpha": 0.001,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "max_position_embeddings": 262144, "attention_bias": False, "attention_dropout": 0.0,
    "num_nextn_predict_layers": 0, "tie_word_embeddings": False, "initializer_range": 0.02,
    "use_cache": True, "torch_dtype": "bfloat16",
}


def kimi_wrapper(text: dict[str, Any]) -> dict[str, Any]:
    """K2.5/K2.6's config.json: the kimi_k25 wrapper around `text` (a DeepSeek-V3 text_config), with
    the wrapper's token ids taken from it and a stub vision_config (its tensors are skipped)."""
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                     "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
                     "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
        "model_type": "kimi_k25",
        "bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"],
        "pad_token_id": text["pad_token_id"],
        "tie_word_embeddings": False, "use_unified_vision_chunk": True,
        "text_config": text,
        "vision_config": {"model_type": "moonvit3d", "hidden_size": 8, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "patch_size": 2, "merge_kernel_size": [2, 2],
                          "mm_projector_type": "patchmerger", "text_hidden_size": text["hidden_size"]},
        "torch_dtype": "bfloat16",
    }


def write_tiny_target(
    out_dir: str | Path,
    *,
    vocab_size: int,
    bos_token_id: int,
    eos_token_ids: list[int],
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write config.json + shards + index into out_dir; -> the config.json dict.
    `overrides` replace keys of `text_config` (e.g. {"n_group": 4, "topk_group": 2})."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    eos: int | list[int] = eos_token_ids[0] if len(eos_token_ids) == 1 else list(eos_token_ids)
    text = copy.deepcopy(TEXT_DEFAULTS)
    text.update(vocab_size=vocab_size, bos_token_id=bos_token_id, eos_token_id=eos,
                pad_token_id=vocab_size - 1, quantization_config=copy.deepcopy(QUANTIZATION_CONFIG))
    text.update(copy.deepcopy(overrides or {}))
    config = kimi_wrapper(text)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shards = _random_shards(text, torch.Generator().manual_seed(seed))
    _write_shards(out, shards)
    return config


def _random_shards(t: dict[str, Any], gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """-> one tensor dict per shard: layer 0, each further layer, globals, vision (like K2.5)."""
    H = t["hidden_size"]

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def dense(out: int, inp: int) -> torch.Tensor:  # bf16 [out, in], std 1/sqrt(in)
        return normal(out, inp, std=inp**-0.5).to(torch.bfloat16)

    def norm_weight(n: int) -> torch.Tensor:
        return (1 + normal(n, std=0.1)).to(torch.bfloat16)

    shards = []
    for layer in range(t["num_hidden_layers"]):
        p = f"{PREFIX}model.layers.{layer}."
        s = {p + "input_layernorm.weight": norm_weight(H), p + "post_attention_layernorm.weight": norm_weight(H)}
        s.update(_attention(p + "self_attn.", t, dense, norm_weight))
        if layer < t["first_k_dense_replace"]:
            s.update(_mlp(p + "mlp.", H, t["intermediate_size"], dense))
        else:
            s.update(_moe(p + "mlp.", t, dense, normal))
        shards.append(s)
    shards.append({
        f"{PREFIX}model.embed_tokens.weight": normal(t["vocab_size"], H, std=1.0).to(torch.bfloat16),
        f"{PREFIX}model.norm.weight": norm_weight(H),
        f"{PREFIX}lm_head.weight": dense(t["vocab_size"], H),
    })
    shards.append({  # skipped by the text loader
        "vision_tower.patch_embed.proj.weight": normal(8, 3, 2, 2, std=0.1).to(torch.bfloat16),
        "vision_tower.encoder.blocks.0.wqkv.weight": dense(24, 8),
        "vision_tower.encoder.final_layernorm.weight": norm_weight(8),
        "mm_projector.pre_norm.weight": norm_weight(32),
        "mm_projector.proj.0.weight": dense(32, 32),
        "mm_projector.proj.2.weight": dense(H, 32),
    })
    return shards


def _attention(p: str, t: dict[str, Any], dense: Maker, norm_weight: Maker) -> dict[str, torch.Tensor]:
    H, heads = t["hidden_size"], t["num_attention_heads"]
    qk = t["qk_nope_head_dim"] + t["qk_rope_head_dim"]
    return {
        p + "q_a_proj.weight": dense(t["q_lora_rank"], H),
        p + "q_a_layernorm.weight": norm_weight(t["q_lora_rank"]),
        p + "q_b_proj.weight": dense(heads * qk, t["q_lora_rank"]),
        p + "kv_a_proj_with_mqa.weight": dense(t["kv_lora_rank"] + t["qk_rope_head_dim"], H),
        p + "kv_a_layernorm.weight": norm_weight(t["kv_lora_rank"]),
        p + "kv_b_proj.weight": dense(heads * (t["qk_nope_head_dim"] + t["v_head_dim"]), t["kv_lora_rank"]),
        p + "o_proj.weight": dense(H, heads * t["v_head_dim"]),
    }


def _mlp(p: str, hidden: int, inter: int, dense: Maker) -> dict[str, torch.Tensor]:
    return {p + "gate_proj.weight": dense(inter, hidden), p + "up_proj.weight": dense(inter, hidden),
            p + "down_proj.weight": dense(hidden, inter)}


def _moe(p: str, t: dict[str, Any], dense: Maker, normal: Maker) -> dict[str, torch.Tensor]:
    H, inter, n = t["hidden_size"], t["moe_intermediate_size"], t["n_routed_experts"]
    s = {p + "gate.weight": dense(n, H),
         p + "gate.e_score_correction_bias": normal(n, std=0.1)}  # fp32, non-zero: selection only
    if t["n_shared_experts"]:
        s.update(_mlp(p + "shared_experts.", H, inter * t["n_shared_experts"], dense))
    for e in range(n):
        for proj, (out, inp) in (("gate_proj", (inter, H)), ("up_proj", (inter, H)), ("down_proj", (H, inter))):
            packed, scale = quantize_int4_groupwise(normal(out, inp, std=inp**-0.5), GROUP_SIZE)
            name = f"{p}experts.{e}.{proj}."
            s[name + "weight_packed"] = packed  # int32 [out, in/8]
            s[name + "weight_scale"] = scale  # bf16 [out, in/32]
            s[name + "weight_shape"] = torch.tensor([out, inp], dtype=torch.int32)
    return s


def _write_shards(out: Path, shards: list[dict[str, torch.Tensor]]) -> None:
    n = len(shards)
    weight_map, total = {}, 0
    for i, tensors in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{n:06d}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / file), metadata={"format": "pt"})
        for name, tensor in tensors.items():
            weight_map[name] = file
            total += tensor.numel() * tensor.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
