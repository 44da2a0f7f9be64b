"""Kimi K2.x / DeepSeek-V3 target forward (reference/k26.md §3): math only.

No loading (weights.py), no cache bookkeeping (kv_cache.py), no protos, no scheduling. One entry
point, `K2Model.forward(plan, kv_cache, target_layer_ids)`, serves prefill, decode and tree verify.
Parallel hooks: `all_reduce(t) -> t summed over ranks` is called after o_proj and after the routed
experts (identity at world size 1); the weights may hold only this rank's heads (mla.py) and experts
(moe.py). Everything else (embedding, norms, router, dense MLP, shared expert, head) is replicated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from verifier_service.mla import MLAWeights, mla_forward, rms_norm
from verifier_service.model_config import K2Config
from verifier_service.moe import MLPWeights, MoEWeights, mlp, moe_forward
from verifier_service.plan import BatchPlan, key_groups
from verifier_service.rope import rope_cos_sin, rope_inv_freq

MLA_KERNEL_WIDTH = 576  # kernels/mla_tree_attention.D (not imported: CPU-only installs never load kernels)


@dataclass(frozen=True)
class LayerWeights:
    input_layernorm: torch.Tensor  # [H]
    self_attn: MLAWeights
    post_attention_layernorm: torch.Tensor  # [H]
    mlp: MLPWeights | MoEWeights  # dense for layers < first_k_dense_replace


@dataclass(frozen=True)
class TargetWeights:
    embed_tokens: torch.Tensor  # [V, H], or this rank's vocab rows [vocab_start, vocab_start + V_local)
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H], or the same vocab rows as embed_tokens
    vocab_start: int = 0  # first vocab row held (vocab-parallel embedding/head)


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor  # fp32 [len(logit_rows), V]
    hidden: torch.Tensor  # [len(hidden_rows), len(target_layer_ids) * H], model dtype


def identity(t: torch.Tensor) -> torch.Tensor:
    return t


class K2Model:
    """The target model over preloaded weights. Stateless apart from the cache passed to `forward`."""

    def __init__(
        self,
        cfg: K2Config,
        weights: TargetWeights,
        *,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] = identity,
        all_gather: Callable[[torch.Tensor], torch.Tensor] = identity,  # vocab-parallel logits -> all [R, V]
        use_kernels: bool = False,  # CUDA kernels (kernels/) for tree attention and INT4 experts on GPU
        on_experts: Callable[[int, torch.Tensor], None] | None = None,
    ):
        if len(weights.layers) != cfg.num_hidden_layers:
            raise ValueError(f"{len(weights.layers)} layers given, config has {cfg.num_hidden_layers}")
        self.cfg = cfg
        self.weights = weights
        self.all_reduce = all_reduce
        self.all_gather = all_gather
        self.vocab_parallel = weights.embed_tokens.shape[0] != cfg.vocab_size
        self.use_kernels = use_kernels
        self.on_experts = on_experts  # (layer, topk_ids [T, k]) — e.g. to log distinct experts per layer
        self.dtype = weights.embed_tokens.dtype
        self.device = weights.embed_tokens.device
        self.inv_freq = rope_inv_freq(cfg).to(self.device)  # fp32 [rope/2]

    @torch.inference_mode()
    def forward(
        self, plan: BatchPlan, kv_cache: torch.Tensor, target_layer_ids: Sequence[int] = ()
    ) -> ForwardOutput:
        """Run the plan's rows through the model, writing each row's latent into the cache.

        kv_cache [num_layers, num_pages, page_size, 576] (PagedKVCache.kv). Returns logits for
        `plan.logit_rows` and the outputs of layers `target_layer_ids` (0-based; HF hidden_states[id+1])
        concatenated for `plan.hidden_rows`.
        """
        cfg, w = self.cfg, self.weights
        self._check(plan, kv_cache, target_layer_ids)
        kernel_attn = self._kernels_on(kv_cache)
        groups = [] if kernel_attn else key_groups(plan, page_size=kv_cache.shape[2])
        cos, sin = rope_cos_sin(self.inv_freq, plan.positions, cfg.rope_amplitude)  # [T, rope/2]
        h = self._embed(plan.token_ids)  # [T, H]
        hidden_rows = _rows(plan.hidden_rows, plan.num_rows, h.device)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(w.layers):
            kv_layer = kv_cache[i].view(-1, cfg.kv_cache_width)  # [num_slots, 576], writes land in the cache
            a = rms_norm(h, layer.input_layernorm, cfg.rms_norm_eps)
            paged = (kv_cache[i], plan) if kernel_attn else None
            attn = mla_forward(a, layer.self_attn, cfg, cos, sin, kv_layer, plan.write_slots, groups,
                               plan.explicit_mla, paged)
            h = h + self.all_reduce(attn)
            b = rms_norm(h, layer.post_attention_layernorm, cfg.rms_norm_eps)
            h = h + self._mlp(i, b, layer.mlp)
            if i in target_layer_ids:
                captured[i] = h[hidden_rows]  # [Rh, H]
        hidden = (torch.cat([captured[i] for i in target_layer_ids], dim=-1) if target_layer_ids
                  else h.new_zeros(len(hidden_rows), 0))
        out_rows = _rows(plan.logit_rows, plan.num_rows, h.device)
        final = rms_norm(h[out_rows], w.norm, cfg.rms_norm_eps)  # [Rl, H]
        return ForwardOutput(logits=self.all_gather(F.linear(final, w.lm_head).float()), hidden=hidden)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weights
        if not self.vocab_parallel:
            return F.embedding(ids, w.embed_tokens)
        local = ids - w.vocab_start  # rows of other ranks' vocab slices contribute zeros to the sum
        mine = (local >= 0) & (local < w.embed_tokens.shape[0])
        rows = F.embedding(local.clamp(0, w.embed_tokens.shape[0] - 1), w.embed_tokens) * mine[:, None]
        return self.all_reduce(rows)

    def _mlp(self, layer: int, x: torch.Tensor, w: MLPWeights | MoEWeights) -> torch.Tensor:
        if isinstance(w, MLPWeights):  # replicated, or column/row split over ranks (then summed)
            y = mlp(x, w)
            return self.all_reduce(y) if w.gate_proj.shape[0] < self.cfg.intermediate_size else y
        observe = None if self.on_experts is None else (lambda ids: self.on_experts(layer, ids))
        return moe_forward(x, w, self.cfg, self.all_reduce, observe, use_kernel=self.use_kernels)

    def _kernels_on(self, kv_cache: torch.Tensor) -> bool:
        """CUDA kernels for attention: flag set, bf16 cache on a GPU (CPU always runs the reference)."""
        # The tree-MLA kernel is built for K2.6's 576-wide latent rows; other widths use the reference.
        return (self.use_kernels and kv_cache.is_cuda and kv_cache.dtype == torch.bfloat16
                and self.cfg.kv_cache_width == MLA_KERNEL_WIDTH)

    def graph_safe(self, kv_cache: torch.Tensor) -> bool:
        """Whether forward can be captured in a CUDA graph: the kernel path has no host syncs (the
        reference path's per-session key groups and per-expert loops do)."""
        return self._kernels_on(kv_cache)

    def _check(self, plan: BatchPlan, kv_cache: torch.Tensor, target_layer_ids: Sequence[int]) -> None:
        cfg = self.cfg
        layers, width = cfg.num_hidden_layers, cfg.kv_cache_width
        if kv_cache.dim() != 4 or kv_cache.shape[0] != layers or kv_cache.shape[3] != width:
            raise ValueError(f"kv_cache must be [{cfg.num_hidden_layers}, pages, page_size, "
                             f"{cfg.kv_cache_width}], got {tuple(kv_cache.shape)}")
        bad = [i for i in target_layer_ids if not 0 <= i < cfg.num_hidden_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} outside [0, {cfg.num_hidden_layers})")


def _rows(rows: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device) if rows is None else rows
