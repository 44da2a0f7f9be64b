"""Plain, non-cached DFlash drafter forward — the oracle the cached, batched engine is tested against.

Written independently of model.py: it follows the reference code's single-sequence formulation
(z-lab/dflash `DFlashDraftModel.forward` with no cache): keys/values = [fused context ; block] recomputed
from scratch, RoPE applied to all keys and to the last Bk rows for queries, explicit softmax attention
with KV heads repeated for GQA. It reads tensors by their released checkpoint names.
"""

from __future__ import annotations

import torch

from .model_config import DFlashConfig


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return w * (x32 / torch.sqrt((x32 * x32).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _linear(state: dict, name: str, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, state[f"{name}.weight"], state.get(f"{name}.bias"))


def forward_ref(state: dict[str, torch.Tensor], cfg: DFlashConfig, embed: torch.Tensor, lm_head: torch.Tensor,
                inv_freq: torch.Tensor, features: torch.Tensor, first_position: int, root_token: int) -> torch.Tensor:
    """features [n, |ids|·H]: the context rows at positions first_position .. first_position + n - 1 (all of
    them are attended); the root sits at first_position + n. Returns fp32 logits [Bk - 1, V] of slots 1..Bk-1."""
    n, bk, hd, eps = features.shape[0], cfg.block_size, cfg.head_dim, cfg.rms_norm_eps
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    ctx = _rms(_linear(state, "fc", features.to(embed.dtype)), state["hidden_norm.weight"], eps)  # [n, H]
    ids = torch.tensor([root_token] + [cfg.mask_token_id] * (bk - 1))
    x = embed[ids] * cfg.input_embedding_scale  # [Bk, H]
    pos = torch.arange(first_position, first_position + n + bk)  # keys: context then block
    angles = pos.float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    cos = (emb.cos() * cfg.rope.amplitude).to(x.dtype)[:, None, :]  # [n+Bk, 1, hd]
    sin = (emb.sin() * cfg.rope.amplitude).to(x.dtype)[:, None, :]
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        a = _rms(x, state[p + "input_layernorm.weight"], eps)
        q = _rms(_linear(state, p + "self_attn.q_proj", a).view(bk, nh, hd), state[p + "self_attn.q_norm.weight"], eps)
        kv_in = torch.cat([ctx, a], dim=0)  # the context skips input_layernorm: it was hidden_norm-ed
        k = _linear(state, p + "self_attn.k_proj", kv_in).view(n + bk, nkv, hd)
        k = _rms(k, state[p + "self_attn.k_norm.weight"], eps)
        v = _linear(state, p + "self_attn.v_proj", kv_in).view(n + bk, nkv, hd)
        q, k = _rope(q, cos[-bk:], sin[-bk:]), _rope(k, cos, sin)
        k = k.repeat_interleave(nh // nkv, dim=1)  # [n+Bk, nh, hd]
        v = v.repeat_interleave(nh // nkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * hd**-0.5  # [nh, Bk, n+Bk]
        window = cfg.layer_window(i)
        if window is not None:  # sliding layers: causal + window by absolute position
            delta = pos[-bk:, None] - pos[None, :]
            scores = scores.masked_fill(~((delta >= 0) & (delta < window)), float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(x.dtype).reshape(bk, nh * hd)
        x = x + _linear(state, p + "self_attn.o_proj", out)
        h = _rms(x, state[p + "post_attention_layernorm.weight"], eps)
        gate, up = _linear(state, p + "mlp.gate_proj", h), _linear(state, p + "mlp.up_proj", h)
        x = x + _linear(state, p + "mlp.down_proj", torch.nn.functional.silu(gate) * up)
    logits = (_rms(x, state["norm.weight"], eps)[1:] @ lm_head.T).float() * cfg.output_multiplier
    if cfg.final_logit_softcapping:
        logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
    return logits
