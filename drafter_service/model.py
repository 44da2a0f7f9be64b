"""DFlash drafter forward math (Qwen3-style layers with KV injection), torch reference path.

One draft round for a batch of sessions (`reference/ddtree.md` §1.4):
  context rows  c [n, |ids|·H]  → fc → hidden_norm → C [n, H] → per layer K = RoPE(k_norm(W_k C)), V = W_v C
                                  (done once per committed token, stored in the drafter KV cache)
  block         [root, mask × (B-1)] → target embed_tokens → layers → norm → target lm_head
Queries come only from the block; keys/values are [cached context ; block], no causal mask inside the block
(unless the checkpoint types a layer `sliding_attention`, which is causal + windowed as in the reference code).
Parameter names equal the released checkpoint's tensor names (without the optional `model.` prefix).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels import silu_mul
from kernels.dflash_attention import dflash_attention, supports
from kernels.rms_norm import add_rms_norm, rms_norm

from .model_config import DFlashConfig, RopeConfig


# Served on CUDA (use_kernels), each layer's q/k/v and gate/up run as one projection each (Attention.fuse, MLP.fuse).
FUSE_PROJECTIONS = True


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = False  # kernels/rms_norm (one launch, RoPE included); DFlashDrafter.use_kernels sets it

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None):
        """x [..., dim] → normed; with cos/sin ([..., 1, dim] against x [..., heads, dim]) also rotated (RoPE)."""
        if self.fused:
            return rms_norm(x, self.weight, self.eps, cos, sin)  # a fused projection's column block as it is
        # Normalize in fp32, scale in the activation dtype (Qwen3RMSNorm numerics).
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * x32.to(x.dtype)
        return y if cos is None else y * cos + rotate_half(y) * sin

    def add(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A residual add and this norm: (h, norm(h)) with h = x + delta (x itself when delta is None). Fused: one
        launch for both (kernels/rms_norm.add_rms_norm, the same rounding as the add and the norm apart)."""
        if delta is None:
            return x, self(x)
        if self.fused:
            return add_rms_norm(x, delta, self.weight, self.eps)
        h = x + delta
        return h, self(h)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim/2] fp32 inverse frequencies; YaRN blends interpolated and extrapolated ones per dimension."""
    pos_freqs = rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim)
    if rope.kind == "default":
        return 1.0 / pos_freqs

    def correction_dim(rotations: float) -> float:
        # dimension whose wavelength fits `rotations` turns into the original context
        return head_dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep_extrapolated = 1 - ramp  # 1 for high-frequency dims (kept as trained), 0 for low-frequency ones
    return (1.0 / (rope.factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * keep_extrapolated


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        hd, nh, nkv, h = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
        self.head_dim, self.num_heads, self.num_kv_heads = hd, nh, nkv
        self.q_proj = nn.Linear(h, nh * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, nkv * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, nkv * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(nh * hd, h, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def fuse(self) -> None:
        """q, k and v as one projection `qkv_proj` (one GEMM a block instead of three) and k, v as `kv_proj`, rows
        of the same tensors (the context's K/V). Serving only (DFlashDrafter.use_kernels): the checkpoint's names
        go."""
        self.qkv_proj = fused_rows(self.q_proj, self.k_proj, self.v_proj)
        self.kv_proj = row_block(self.qkv_proj, self.num_heads * self.head_dim)
        del self.q_proj, self.k_proj, self.v_proj

    def _heads(self, y: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """y [..., 2·nkv·hd], the k | v projection's output → K (k_norm + RoPE), V (a view of y), each [..., nkv, hd]."""
        k, v = y.split(self.num_kv_heads * self.head_dim, dim=-1)
        k = self.k_norm(k.unflatten(-1, (self.num_kv_heads, self.head_dim)), cos, sin)
        return k, v.unflatten(-1, (self.num_kv_heads, self.head_dim))

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., H] (already normed) → K (k_norm + RoPE), V, each [..., nkv, hd]."""
        if hasattr(self, "kv_proj"):
            return self._heads(self.kv_proj(x), cos, sin)
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim)), cos, sin)
        return k, self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))

    def forward(self, a, cos, sin, ctx, mask):
        """a [B, Bk, H] normed block; cos/sin [B, Bk, 1, hd]; ctx: the context's (K, V), each [B, Lc, nkv, hd],
        or a PagedContext; mask [B, Bk, Lc+Bk]."""
        if hasattr(self, "qkv_proj"):
            q, kv = self.qkv_proj(a).split([self.num_heads * self.head_dim, 2 * self.num_kv_heads * self.head_dim], -1)
            k_blk, v_blk = self._heads(kv, cos, sin)
        else:
            q = self.q_proj(a)
            k_blk, v_blk = self.kv(a, cos, sin)
        q = self.q_norm(q.unflatten(-1, (self.num_heads, self.head_dim)), cos, sin)
        if isinstance(ctx, PagedContext):
            out = dflash_attention(q, ctx.k, ctx.v, ctx.page_table, ctx.page_size, k_blk, v_blk, mask,
                                   self.head_dim**-0.5)
            return self.o_proj(out.flatten(2))
        ctx_k, ctx_v = ctx
        k = torch.cat([ctx_k, k_blk], dim=1).transpose(1, 2)  # [B, nkv, Lc+Bk, hd]
        v = torch.cat([ctx_v, v_blk], dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None],
                                             scale=self.head_dim**-0.5, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(2))  # [B, Bk, H]


class MLP(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def fuse(self) -> None:
        """gate and up as one projection `gate_up_proj` and its SwiGLU by kernels/silu_mul on CUDA (two launches
        instead of four). Serving only (DFlashDrafter.use_kernels): the checkpoint's names go."""
        self.gate_up_proj = fused_rows(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "gate_up_proj"):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = self.gate_up_proj(x)
        flat = gate_up.reshape(-1, gate_up.shape[-1])
        act = silu_mul.silu_mul(flat) if silu_mul.fits(flat) else silu_mul.silu_mul_ref(flat)
        return self.down_proj(act.view(*gate_up.shape[:-1], -1))


def fused_rows(*parts: nn.Module) -> nn.Module:
    """One projection whose output is the parts' outputs side by side: their rows stacked (nn.Linear or, after
    drafter_service/int8.quantize_drafter, Int8Linear; each part's per-row int8 scales stay its own)."""
    if isinstance(parts[0], nn.Linear):
        bias = parts[0].bias is not None
        fused = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=bias, device="meta")
        fused.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]), requires_grad=False)
        if bias:
            fused.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
        return fused
    from drafter_service.int8 import Int8Linear

    assert all(isinstance(p, Int8Linear) for p in parts), [type(p) for p in parts]
    return Int8Linear.stacked(parts)


def row_block(linear: nn.Module, start: int) -> nn.Module:
    """The projection of `linear`'s output rows from `start` on, sharing its tensors (a view, no copy)."""
    if isinstance(linear, nn.Linear):
        block = nn.Linear(linear.in_features, linear.out_features - start, bias=linear.bias is not None,
                          device="meta")
        block.weight = nn.Parameter(linear.weight[start:], requires_grad=False)
        if linear.bias is not None:
            block.bias = nn.Parameter(linear.bias[start:], requires_grad=False)
        return block
    return linear.rows(start)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx, mask, delta=None):
        """x [B, Bk, H] the residual stream, delta the previous layer's MLP output not added yet (None: none) ->
        (the residual stream, this layer's MLP output): each add joins the next norm's launch (RMSNorm.add)."""
        x, a = self.input_layernorm.add(x, delta)
        x, m = self.post_attention_layernorm.add(x, self.self_attn(a, cos, sin, ctx, mask))
        return x, self.mlp(m)


@dataclass(frozen=True)
class PagedContext:
    """One layer's context K/V left where the drafter's pool holds them: kernels/dflash_attention reads the
    pages directly (no gather, no cat). Key j of sequence b: slot page_table[b, j // page_size] · page_size +
    j % page_size of k / v."""
    k: torch.Tensor  # [slots, nkv, hd] one layer of KVPool.k
    v: torch.Tensor  # [slots, nkv, hd] one layer of KVPool.v
    page_table: torch.Tensor  # [B, P] int64
    page_size: int


# ctx_kv(layer) → the sessions' visible context for that layer: (K, V), each [B, Lc, nkv, hd], or a PagedContext.
ContextKV = Callable[[int], "tuple[torch.Tensor, torch.Tensor] | PagedContext"]


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig, vocab_size: int):
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.fc = nn.Linear(cfg.feature_width, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The target's tables (weights.py fills them from the target checkpoint); the target's final norm is
        # not used. Non-persistent: they are not drafter checkpoint tensors.
        self.register_buffer("embed_tokens", torch.empty(vocab_size, cfg.hidden_size), persistent=False)
        self.register_buffer("lm_head", torch.empty(vocab_size, cfg.hidden_size), persistent=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope, cfg.head_dim), persistent=False)
        self.paged_attention = False  # use_kernels sets it

    def use_kernels(self, on: bool) -> None:
        """On CUDA: the fused RMSNorm(+RoPE) kernel for every norm, kernels/dflash_attention for the block
        attention where its shapes allow (`paged_attention`: callers then pass PagedContext), and (FUSE_PROJECTIONS)
        q|k|v and gate|up as one projection each (Attention.fuse, MLP.fuse; once, not undone). CPU always runs the
        torch math on the checkpoint's separate projections."""
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.fused = on and m.weight.is_cuda
        if on and FUSE_PROJECTIONS and self.device.type == "cuda":
            for layer in self.layers:
                if hasattr(layer.self_attn, "q_proj"):
                    layer.self_attn.fuse()
                    layer.mlp.fuse()
        cfg = self.cfg
        self.paged_attention = on and self.device.type == "cuda" and supports(
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.block_size, self.dtype)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the embedding's; projections may be stored int8: drafter_service/int8.py)."""
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] int64 → cos, sin [..., 1, hd] (the 1 broadcasts over heads), amplitude folded in."""
        # Angles in fp32 as the HF rotary embedding the drafters were trained with computes them.
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq  # [..., hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)[..., None, :]
        amp = self.cfg.rope.amplitude
        return (emb.cos() * amp).to(dtype), (emb.sin() * amp).to(dtype)

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target feature rows [n, |ids|·H] at absolute positions [n] → K, V [layers, n, nkv, hd] for the cache."""
        c = self.hidden_norm(self.fc(features.to(self.dtype)))  # [n, H], shared by every layer
        cos, sin = self.rope(positions, c.dtype)
        kvs = [layer.self_attn.kv(c, cos, sin) for layer in self.layers]
        return torch.stack([k for k, _ in kvs]), torch.stack([v for _, v in kvs])

    def forward_block(self, block_ids: torch.Tensor, block_pos: torch.Tensor, ctx_pos: torch.Tensor,
                      ctx_valid: torch.Tensor, ctx_kv: ContextKV) -> torch.Tensor:
        """block_ids/block_pos [B, Bk]; ctx_pos/ctx_valid [B, Lc] (positions and visibility of the keys that
        ctx_kv returns) → final-normed hidden states [B, Bk, H]."""
        x = F.embedding(block_ids, self.embed_tokens) * self.cfg.input_embedding_scale
        cos, sin = self.rope(block_pos, x.dtype)
        masks: dict[int | None, torch.Tensor] = {}
        delta = None
        for i, layer in enumerate(self.layers):
            window = self.cfg.layer_window(i)
            if window not in masks:
                masks[window] = block_mask(block_pos, ctx_pos, ctx_valid, window)
            x, delta = layer(x, cos, sin, ctx_kv(i), masks[window], delta)
        return self.norm.add(x, delta)[1]

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[..., H] → fp32 logits [..., V] through the target's lm_head (written into `out` if given)."""
        # One 2-D GEMM: a 3-D (or non-contiguous) hidden makes torch run a bmm that re-reads the 2.3 GB Kimi
        # head once per session (18 ms at 32 sessions on an H200, against 0.7 ms).
        flat, head = hidden.reshape(-1, hidden.shape[-1]), self.lm_head
        logits = (head(flat) if isinstance(head, nn.Module) else F.linear(flat, head))  # int8: drafter_service/int8
        logits = logits.float().view(*hidden.shape[:-1], -1)
        logits = torch.mul(logits, self.cfg.output_multiplier, out=out)
        cap = self.cfg.final_logit_softcapping
        if cap:  # out of place: autograd (drafter training) keeps tanh's output
            capped = torch.tanh(logits / cap) * cap
            logits = capped if out is None else out.copy_(capped)
        return logits


def block_mask(block_pos: torch.Tensor, ctx_pos: torch.Tensor, ctx_valid: torch.Tensor,
               window: int | None) -> torch.Tensor:
    """Visibility [B, Bk, Lc+Bk] of [context ; block] keys for block queries. Full layers: every valid context
    key and the whole block. Sliding layers: causal and q_pos - k_pos < window (by absolute position)."""
    keys_pos = torch.cat([ctx_pos, block_pos], dim=1)  # [B, Lc+Bk]
    visible = torch.cat([ctx_valid, torch.ones_like(block_pos, dtype=torch.bool)], dim=1)
    visible = visible[:, None, :].expand(-1, block_pos.shape[1], -1)
    if window is None:
        return visible
    delta = block_pos[:, :, None] - keys_pos[:, None, :]  # [B, Bk, Lc+Bk]
    return visible & (delta >= 0) & (delta < window)
