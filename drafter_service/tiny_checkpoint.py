"""A random DFlash drafter checkpoint in the released layout, for tests and the tiny end-to-end stack.

Layout as z-lab's Kimi drafters ship it (reference/ddtree.md §1.9): config.json (DFlashDraftModel, qwen3,
top-level block_size, dflash_config.{target_layer_ids, mask_token_id}, YaRN rope) and one
model.safetensors in bf16 with tensor names without a `model.` prefix (plus its one-shard index).
Deterministic for a seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TINY_HEADS, TINY_KV_HEADS, TINY_HEAD_DIM, TINY_INTERMEDIATE = 4, 2, 64, 512


def spread_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """`count` target layers spread like the released drafters (Kimi: 61 layers, 6 ids → [1, 12, 24, 35, 47, 58],
    i.e. 1 … num_target_layers - 3); falls back to an even spread over all layers for tiny targets."""
    if count == 1:
        return [num_target_layers // 2]
    if num_target_layers - 4 >= count - 1:
        return [round(1 + i * (num_target_layers - 4) / (count - 1)) for i in range(count)]
    if num_target_layers < count:
        raise ValueError(f"cannot pick {count} distinct layers of a {num_target_layers}-layer target")
    return [round(i * (num_target_layers - 1) / (count - 1)) for i in range(count)]


def tiny_drafter_config(*, target_hidden_size: int, target_num_layers: int, vocab_size: int, mask_token_id: int,
                        block_size: int, num_layers: int) -> dict:
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "hidden_size": target_hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": TINY_HEADS,
        "num_key_value_heads": TINY_KV_HEADS,
        "head_dim": TINY_HEAD_DIM,
        "intermediate_size": TINY_INTERMEDIATE,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
        "max_position_embeddings": 262144,
        "rope_theta": 50000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "num_target_layers": target_num_layers,
        "block_size": block_size,
        "dflash_config": {"target_layer_ids": spread_layer_ids(target_num_layers, num_layers),
                          "mask_token_id": mask_token_id},
        "torch_dtype": "bfloat16",
    }


def _tiny_tensors(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h, hd, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    width = len(cfg["dflash_config"]["target_layer_ids"]) * h

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=gen) / in_features**0.5

    def norm(dim: int) -> torch.Tensor:  # around 1, but not exactly, so a wrong norm weight shows
        return 1.0 + 0.1 * torch.randn(dim, generator=gen)

    tensors = {"fc.weight": linear(h, width), "hidden_norm.weight": norm(h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": norm(h),
            p + "self_attn.q_proj.weight": linear(nh * hd, h),
            p + "self_attn.k_proj.weight": linear(nkv * hd, h),
            p + "self_attn.v_proj.weight": linear(nkv * hd, h),
            p + "self_attn.o_proj.weight": linear(h, nh * hd),
            p + "self_attn.q_norm.weight": norm(hd),
            p + "self_attn.k_norm.weight": norm(hd),
            p + "post_attention_layernorm.weight": norm(h),
            p + "mlp.gate_proj.weight": linear(inter, h),
            p + "mlp.up_proj.weight": linear(inter, h),
            p + "mlp.down_proj.weight": linear(h, inter),
        }
    tensors["norm.weight"] = norm(h)
    return {name: t.to(torch.bfloat16).contiguous() for name, t in tensors.items()}


def write_tiny_drafter(out_dir: str | Path, *, target_hidden_size: int, target_num_layers: int, vocab_size: int,
                       mask_token_id: int, seed: int = 0, block_size: int = 8, num_layers: int = 2) -> dict:
    """Write config.json, model.safetensors and its index into out_dir; returns the config dict."""
    if not 0 <= mask_token_id < vocab_size:
        raise ValueError(f"mask_token_id={mask_token_id} must be a row of the target embedding (vocab {vocab_size})")
    cfg = tiny_drafter_config(target_hidden_size=target_hidden_size, target_num_layers=target_num_layers,
                              vocab_size=vocab_size, mask_token_id=mask_token_id, block_size=block_size,
                              num_layers=num_layers)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tensors = _tiny_tensors(cfg, seed)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
             "weight_map": {name: "model.safetensors" for name in sorted(tensors)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return cfg


def write_tiny_target_tables(out_dir: str | Path, *, hidden_size: int, vocab_size: int, seed: int = 0,
                             prefix: str = "language_model.") -> None:
    """Only the two target tensors the drafter reads (`embed_tokens`, `lm_head`), sharded layout with an index:
    enough to run the drafter without a tiny target (servicer and drafter tests)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {f"{prefix}model.embed_tokens.weight": torch.randn(vocab_size, hidden_size, generator=gen),
               f"{prefix}lm_head.weight": torch.randn(vocab_size, hidden_size, generator=gen) / hidden_size**0.5 * 4}
    tensors = {name: t.to(torch.bfloat16).contiguous() for name, t in tensors.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model-00001-of-00001.safetensors"), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
             "weight_map": {name: "model-00001-of-00001.safetensors" for name in sorted(tensors)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
