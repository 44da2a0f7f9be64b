"""A random DFlash drafter of the Kimi K2.6 drafter's dimensions, made directly on the device (no checkpoint).

For benchmarks with a synthetic target (`ddtree drafter --synthetic PRESET`): `k26` is z-lab's Kimi DFlash
config (reference/k26.md §7: 6 layers, hidden 7168, 64/8 heads × 128, intermediate 18432, block 8, target
layers [1, 12, 24, 35, 47, 58], mask id 163838, vocab 163840), parsed by the real config parser; `k26-mini`
matches the verifier's `k26-mini` target (hidden 128, 4 layers, same vocabulary) for CPU tests. The
target's embed_tokens / lm_head, normally read from the target checkpoint, are random too.

The head is scaled so that draft logits have std LOGIT_STD: each depth's top token then dominates, and the
best-first trees are a deep spine plus siblings, as with a trained drafter (random logits of std 1 would
be flat over 163,840 tokens and give one-level trees, which no forced acceptance depth could walk). In
fp32 ~98% of 7-node trees are then a full 7-deep chain (std 40: 76%); bf16 logits round the top two
together in ~10% of depths whatever the std, so there a tree of exactly 7 nodes is often one level short.
"""

from __future__ import annotations

import math

import torch

from .model import DFlashDrafter
from .model_config import DFlashConfig
from .tiny_checkpoint import spread_layer_ids
from .weights import attach

LOGIT_STD = 100.0

KIMI_DFLASH_CONFIG = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 7168, "num_hidden_layers": 6,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 18432,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "attention_bias": False, "vocab_size": 163840,
    "max_position_embeddings": 262144, "num_target_layers": 61, "block_size": 8,
    "rope_parameters": {"rope_type": "deepseek_yarn", "rope_theta": 50000.0, "factor": 64.0,
                        "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                        "mscale": 1.0, "mscale_all_dim": 1.0},
    "dflash_config": {"target_layer_ids": [1, 12, 24, 35, 47, 58], "mask_token_id": 163838},
}
K26_MINI_OVERRIDES = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256, "num_target_layers": 4}
PRESETS = {"k26": KIMI_DFLASH_CONFIG, "k26-mini": {**KIMI_DFLASH_CONFIG, **K26_MINI_OVERRIDES}}


def preset_config(name: str, target_layers: int = 0) -> DFlashConfig:
    """The preset's config; `target_layers` > 0 drafts for a target of that many layers (the verifier's
    --synthetic-layers): one target layer id per drafter layer, spread like the released drafters'."""
    if name not in PRESETS:
        raise ValueError(f"synthetic preset {name!r} is not one of {sorted(PRESETS)}")
    raw = PRESETS[name]
    layers, count = target_layers or raw["num_target_layers"], raw["num_hidden_layers"]
    # A target shorter than the drafter's layer count (quick runs with a few layers) repeats layers.
    ids = spread_layer_ids(layers, count) if layers >= count else [round(i * (layers - 1) / (count - 1))
                                                                    for i in range(count)]
    dflash = {**raw["dflash_config"], "target_layer_ids": ids}
    return DFlashConfig.from_dict({**raw, "num_target_layers": layers, "dflash_config": dflash})


def random_drafter(name: str, *, target_layers: int = 0, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> DFlashDrafter:
    cfg = preset_config(name, target_layers)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):  # shapes only; every tensor is then drawn once, on the device, in `dtype`
        model = DFlashDrafter(cfg, vocab_size=cfg.vocab_size)

    def draw(shape, std: float) -> torch.Tensor:
        return torch.empty(shape, device=device, dtype=dtype).normal_(0.0, std, generator=gen)

    state = {n: torch.ones(p.shape, device=device, dtype=dtype) if p.dim() == 1 else draw(p.shape, p.shape[1] ** -0.5)
             for n, p in model.named_parameters()}  # RMSNorm weights 1, linears std 1/sqrt(fan-in)
    H = cfg.hidden_size
    embed = draw((cfg.vocab_size, H), 1.0)
    head = draw((cfg.vocab_size, H), LOGIT_STD / math.sqrt(H))
    return attach(model, state, embed, head, device)
