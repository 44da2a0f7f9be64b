"""The tiny target on disk: its K2.6 config.json, the export of the trained twin (routed experts
INT4), the checkpoint read back, and held-out loss through the twin and through verifier_service.

Export: wrapper config.json (kimi_k25 + text_config + compressed-tensors quantization_config),
`language_model.`-prefixed bf16 tensors, routed experts pack-quantized INT4 (group 32, symmetric,
verifier_service/int4.py), fp32 router bias, a few placeholder vision tensors (skipped by the loader,
as K2.6's vision tower is), one shard per layer + one for the tables, `model.safetensors.index.json`.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from tools import corpus
from tools.k2_twin import K2Twin
from tools.train_loop import autocast, heldout_windows
from tools.train_tokenizer import special_ids
from verifier_service.int4 import quantize_int4_groupwise
from verifier_service.model_config import K2Config
from verifier_service.tiny_checkpoint import (GROUP_SIZE, PREFIX, QUANTIZATION_CONFIG, TEXT_DEFAULTS, _write_shards,
                                              kimi_wrapper)

# The target's architecture: K2.6's (DeepSeek-V3 MLA + MoE) scaled down; the rest of text_config is K2.6's.
TARGET_TEXT = dict(
    hidden_size=384, num_hidden_layers=6, first_k_dense_replace=1, num_attention_heads=6, num_key_value_heads=6,
    q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    intermediate_size=1024, moe_intermediate_size=192, n_routed_experts=16, num_experts_per_tok=4,
    n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.827, max_position_embeddings=262144,
)


def wrapper_config(num_regular: int, text_overrides: dict | None = None, quantized: bool = True) -> dict:
    """config.json of the K2.6 layout (kimi_k25 wrapper) for this tokenizer."""
    ids = special_ids(num_regular)
    vocab, bos, eos = ids["vocab_size"], ids["bos_token_id"], [ids["eos_token_id"], ids["im_end_id"]]
    text = copy.deepcopy(TEXT_DEFAULTS)
    text.update(copy.deepcopy(TARGET_TEXT))
    text.update(vocab_size=vocab, bos_token_id=bos, eos_token_id=eos, pad_token_id=ids["pad_token_id"])
    if quantized:
        text["quantization_config"] = copy.deepcopy(QUANTIZATION_CONFIG)
    text.update(copy.deepcopy(text_overrides or {}))
    return kimi_wrapper(text)


def num_regular_ids(tokenizer_dir: str | Path) -> int:
    return sum(1 for line in (Path(tokenizer_dir) / "tiktoken.model").read_text().splitlines() if line.strip())


def _vision_placeholders(hidden: int) -> dict[str, torch.Tensor]:
    """Placeholder multimodal tensors at K2.6's names (the text loader skips them)."""
    gen = torch.Generator().manual_seed(0)
    t = lambda *s: (torch.randn(*s, generator=gen) * 0.02).to(torch.bfloat16)  # noqa: E731
    return {"vision_tower.patch_embed.proj.weight": t(8, 3, 2, 2),
            "vision_tower.encoder.blocks.0.wqkv.weight": t(24, 8),
            "vision_tower.encoder.final_layernorm.weight": torch.ones(8, dtype=torch.bfloat16),
            "mm_projector.pre_norm.weight": torch.ones(32, dtype=torch.bfloat16),
            "mm_projector.proj.0.weight": t(32, 32), "mm_projector.proj.2.weight": t(hidden, 32)}


def export(twin: K2Twin, out_dir: str | Path, num_regular: int, *, quantize: bool = True) -> dict:
    """Write config.json + shards + index (K2.6 layout). quantize=False keeps routed experts bf16 (and
    writes no quantization_config): the 'before INT4' model for the same loader."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = wrapper_config(num_regular, getattr(twin, "text_overrides", None), quantized=quantize)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: v.cpu() for k, v in twin.checkpoint_tensors().items()}
    cfg = twin.cfg
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(cfg.num_hidden_layers)]
    tables: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        target = shards[int(name.split(".")[2])] if name.startswith("model.layers.") else tables
        full = PREFIX + name
        if name.endswith("e_score_correction_bias"):
            target[full] = t.float()
        elif ".mlp.experts." in name and quantize:
            packed, scale = quantize_int4_groupwise(t, GROUP_SIZE)
            base = full[: -len(".weight")]
            target[base + ".weight_packed"] = packed
            target[base + ".weight_scale"] = scale
            target[base + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int32)
        else:
            target[full] = t.to(torch.bfloat16)
    _write_shards(out, [*shards, tables, _vision_placeholders(cfg.hidden_size)])
    return config


def dequantized_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Canonical name -> fp32 tensor of a written checkpoint, INT4 experts dequantized (for the twin)."""
    from safetensors.torch import load_file

    from verifier_service.int4 import dequantize_int4

    raw = {}
    for f in sorted(Path(model_dir).glob("model-*.safetensors")):
        raw.update(load_file(str(f)))
    out = {}
    for name, t in raw.items():
        if not name.startswith(PREFIX):
            continue
        name = name[len(PREFIX):]
        if name.endswith(".weight_packed"):
            base = name[: -len(".weight_packed")]
            shape = tuple(raw[PREFIX + base + ".weight_shape"].tolist())
            out[base + ".weight"] = dequantize_int4(t, raw[PREFIX + base + ".weight_scale"], shape, torch.float32)
        elif name.endswith((".weight_scale", ".weight_shape")):
            continue
        else:
            out[name] = t.float()
    return out


@torch.no_grad()
def eval_twin(twin: K2Twin, windows: torch.Tensor, device: torch.device, batch: int = 16) -> float:
    """Mean next-token loss of windows [N, S+1] through the twin (bf16 autocast on cuda); the twin is left
    in train mode."""
    twin.eval()
    total, count = 0.0, 0
    for lo in range(0, windows.shape[0], batch):
        w = windows[lo:lo + batch].to(device)
        with autocast(device):
            logits, _ = twin(w[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum")
        total, count = total + float(loss), count + w[:, 1:].numel()
    twin.train()
    return total / max(count, 1)


@torch.no_grad()
def eval_verifier(model_dir: str | Path, windows: torch.Tensor, *, device: str = "cpu",
                  dtype: torch.dtype = torch.float32, batch: int = 8) -> float:
    """Mean next-token loss of windows [N, S+1] through verifier_service's loader + K2Model (prefill plans)."""
    from verifier_service.model import K2Model
    from verifier_service.plan import SeqRows, build_plan, chain_parents
    from verifier_service.weights import load_target_weights

    cfg = K2Config.from_json(model_dir)
    w = load_target_weights(model_dir, cfg, dtype=dtype, device=device, progress=lambda p: None)
    model = K2Model(cfg, w)
    seq, page_size = windows.shape[1] - 1, 64
    pages_per = -(-seq // page_size)
    total, count = 0.0, 0
    for lo in range(0, windows.shape[0], batch):
        chunk = windows[lo:lo + batch]
        kv = torch.zeros(cfg.num_hidden_layers, pages_per * len(chunk), page_size, cfg.kv_cache_width,
                         dtype=dtype, device=device)
        seqs = []
        for b, row in enumerate(chunk):
            pages = list(range(b * pages_per, (b + 1) * pages_per))
            seqs.append(SeqRows(row[:-1].tolist(), chain_parents(seq), 0, pages,
                                [pages[p // page_size] * page_size + p % page_size for p in range(seq)]))
        out = model.forward(build_plan(seqs, explicit_mla=True, device=device), kv)
        loss = F.cross_entropy(out.logits, chunk[:, 1:].flatten().to(device), reduction="sum")
        total, count = total + float(loss), count + chunk[:, 1:].numel()
    return total / max(count, 1)


def export_and_evaluate(twin: K2Twin, out_dir: str | Path, work_dir: str | Path, corpus_dir: str | Path,
                        num_regular: int, *, device: str = "cpu", eval_windows: int = 32, seq: int = 512,
                        log=print) -> dict:
    """Writes the model twice, routed experts bf16 (WORK/target_bf16) and INT4 (out_dir), and measures
    held-out loss of both through verifier_service and through the twin."""
    dev = torch.device(device)
    windows = heldout_windows(corpus.load_stream(corpus_dir, "heldout"), seq, eval_windows)
    dense_dir = Path(work_dir) / "target_bf16"
    export(twin, dense_dir, num_regular, quantize=False)
    export(twin, out_dir, num_regular, quantize=True)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    before = eval_verifier(dense_dir, windows, device=device, dtype=dtype)
    after = eval_verifier(out_dir, windows, device=device, dtype=dtype)
    # The twin with the dequantized experts loaded back, same windows: isolates the INT4 effect.
    twin_q = K2Twin(twin.cfg).to(dev)
    twin_q.text_overrides = getattr(twin, "text_overrides", None)
    twin_q.load_checkpoint_tensors({k: v.to(dev) for k, v in dequantized_tensors(out_dir).items()})
    twin_before, twin_after = eval_twin(twin, windows, dev), eval_twin(twin_q, windows, dev)
    info = {"eval_tokens": int(windows[:, 1:].numel()), "verifier_dtype": str(dtype).removeprefix("torch."),
            "heldout_loss_bf16": round(before, 4), "heldout_ppl_bf16": round(math.exp(before), 2),
            "heldout_loss_int4": round(after, 4), "heldout_ppl_int4": round(math.exp(after), 2),
            "twin_heldout_loss_bf16": round(twin_before, 4), "twin_heldout_loss_int4": round(twin_after, 4),
            "files": {p.name: p.stat().st_size for p in sorted(Path(out_dir).iterdir()) if p.is_file()}}
    log(f"target: held-out through verifier_service ({info['eval_tokens']} tokens, {info['verifier_dtype']}): "
        f"bf16 experts loss {before:.4f} (ppl {math.exp(before):.2f}) -> INT4 loss {after:.4f} "
        f"(ppl {math.exp(after):.2f}); twin {twin_before:.4f} -> {twin_after:.4f}")
    return info

