"""Kimi K2.x / DeepSeek-V3 target forward (reference/k26.md §3): math only.

No loading (weights.py), no cache bookkeeping (kv_cache.py), no protos, no scheduling. One entry
point, `K2Model.forward(plan, kv_cache, target_layer_ids)`, serves prefill, decode and tree verify.
Parallel hooks: `all_reduce(t) -> t summed over ranks` is called after o_proj and after the routed
experts (identity at world size 1); the weights may hold only this rank's heads (mla.py) and experts
(moe.py). Everything else (embedding, norms, router, dense MLP, shared expert, head) is replicated.

Three ways to run attention and routed experts, chosen per call (`attention_path`, moe.moe_forward):
1. the CUDA kernels (kernels/): `use_kernels`, a GPU, K2.6 shapes (576-wide latent / bf16 INT4 experts
   with H, I multiples of 128);
2. the sync-free torch path: `sync_free` (default: `use_kernels` on a GPU) for what the kernels do not
   cover: batched attention over per-row key slots (mla.row_keys) and every-expert MoE over experts
   dequantized once at load (moe.moe_experts_dense; only while E_local·T <= moe.DENSE_MAX_PAIRS, and
   only if all layers' dense experts fit DENSE_EXPERTS_MAX_BYTES);
3. the torch reference (host syncs: per-session key groups, per-expert loop) — CPU by default.
Paths 1 and 2 never read tensors back to the host, so `graph_safe` lets the runner capture CUDA graphs.
With `use_kernels` on a GPU every RMSNorm is also one launch (kernels/rms_norm) at any shape, together
with the residual add before it where there is one (add_rms_norm), and fp32 projections of 1-64 rows
(dense, head, and path 2's every-expert MoE) run kernels/skinny_linear (linear.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from verifier_service.linear import project
from verifier_service.mla import MLAWeights, add_rms_norm, mla_forward, rms_norm, row_keys, uk_transposed
from verifier_service.model_config import K2Config
from verifier_service.moe import (ExpertStack, MLPWeights, MoEWeights, dense_fits, dense_stack, kernel_fits_for,
                                  mlp, moe_forward, tile_experts)
from verifier_service.plan import BatchPlan, key_groups
from verifier_service.rope import rope_cos_sin, rope_inv_freq

MLA_KERNEL_WIDTH = 576  # kernels/mla_tree_attention.D (not imported: CPU-only installs never load kernels)
GRAPH_MAX_ROWS = 256  # graphs.BUCKETS[-1]: the most rows a captured forward runs
# Dequantized copies of the routed experts for the sync-free MoE, all layers together (E_local·3·H·I
# values per layer, model dtype). Above this the model keeps the reference MoE (and is not graph safe).
DENSE_EXPERTS_MAX_BYTES = 4 << 30
KERNEL, SYNC_FREE, REFERENCE = "kernel", "sync_free", "reference"


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
        sync_free: bool | None = None,  # sync-free torch path; None: with use_kernels on a GPU; True: anywhere
    ):
        if len(weights.layers) != cfg.num_hidden_layers:
            raise ValueError(f"{len(weights.layers)} layers given, config has {cfg.num_hidden_layers}")
        self.cfg = cfg
        if use_kernels and weights.embed_tokens.is_cuda:
            weights = _with_tiled_experts(weights)  # the INT4 kernel's storage order
        self.weights = weights
        self.all_reduce = all_reduce
        self.all_gather = all_gather
        self.vocab_parallel = weights.embed_tokens.shape[0] != cfg.vocab_size
        self.use_kernels = use_kernels
        self.on_experts = on_experts  # (layer, topk_ids [T, k]) — e.g. to log distinct experts per layer
        # A graph's pad rows (plan.pad_last) route to no expert (moe.route); False: they route as the dummy row they
        # are, as before session 44 (`bench verify --route-pad-rows`, to measure what skipping them saves).
        self.skip_pad_rows = True
        self.dtype = weights.embed_tokens.dtype
        self.device = weights.embed_tokens.device
        self.inv_freq = rope_inv_freq(cfg).to(self.device)  # fp32 [rope/2]
        # CPU keeps the reference path by default: its outputs are compared with HF transformers.
        self.sync_free = (use_kernels and self.device.type == "cuda") if sync_free is None else sync_free
        self.fused = use_kernels and self.device.type == "cuda"  # kernels/rms_norm, mla_rope, skinny_linear, silu_mul
        self.dense_experts = self._dense_experts() if self.sync_free else {}  # layer -> dense ExpertStack
        # layer -> W_UK per head as [h, C, nope] (mla.uk_transposed): the absorption on kernels/skinny_gemm
        self.uk_t = ({i: uk_transposed(layer.self_attn, cfg) for i, layer in enumerate(weights.layers)}
                     if self.fused and self.dtype == torch.bfloat16 else {})

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
        path = self.attention_path(kv_cache)
        kernel_attn = path == KERNEL
        # Keys per row, resolved once per forward: the kernel reads the plan itself.
        groups = ([] if kernel_attn else row_keys(plan, kv_cache.shape[2]) if path == SYNC_FREE
                  else key_groups(plan, kv_cache.shape[2]))
        cos, sin = rope_cos_sin(self.inv_freq, plan.positions, cfg.rope_amplitude)  # [T, rope/2]
        h = self._embed(plan.token_ids)  # [T, H]
        hidden_rows = _rows(plan.hidden_rows, plan.num_rows, h.device)
        captured: dict[int, torch.Tensor] = {}
        eps, last = cfg.rms_norm_eps, len(w.layers) - 1
        a = rms_norm(h, w.layers[0].input_layernorm, eps, self.fused)
        # rows from row_starts[-2] on are the pad sequence's: int64 [1], read on the device (graphs fill it per step)
        live = plan.row_starts[-2:-1] if plan.pad_last and self.skip_pad_rows else None
        for i, layer in enumerate(w.layers):
            kv_layer = kv_cache[i].view(-1, cfg.kv_cache_width)  # [num_slots, 576], writes land in the cache
            paged = (kv_cache[i], plan) if kernel_attn else None
            attn = mla_forward(a, layer.self_attn, cfg, cos, sin, kv_layer, plan.write_slots, groups,
                               plan.explicit_mla, paged, self.fused, self.uk_t.get(i))
            # each residual add runs with the norm after it (one launch with the kernels)
            h, b = add_rms_norm(h, self.all_reduce(attn), layer.post_attention_layernorm, eps, self.fused)
            mlp_out = self._mlp(i, b, layer.mlp, live)
            if i < last:
                h, a = add_rms_norm(h, mlp_out, w.layers[i + 1].input_layernorm, eps, self.fused)
            else:
                h = h + mlp_out
            if i in target_layer_ids:
                captured[i] = h[hidden_rows]  # [Rh, H]
        hidden = (torch.cat([captured[i] for i in target_layer_ids], dim=-1) if target_layer_ids
                  else h.new_zeros(len(hidden_rows), 0))
        out_rows = _rows(plan.logit_rows, plan.num_rows, h.device)
        final = rms_norm(h[out_rows], w.norm, cfg.rms_norm_eps, self.fused)  # [Rl, H]
        return ForwardOutput(logits=self.all_gather(project(final, w.lm_head, self.fused).float()), hidden=hidden)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weights
        if not self.vocab_parallel:
            return F.embedding(ids, w.embed_tokens)
        local = ids - w.vocab_start  # rows of other ranks' vocab slices contribute zeros to the sum
        mine = (local >= 0) & (local < w.embed_tokens.shape[0])
        rows = F.embedding(local.clamp(0, w.embed_tokens.shape[0] - 1), w.embed_tokens) * mine[:, None]
        return self.all_reduce(rows)

    def _mlp(self, layer: int, x: torch.Tensor, w: MLPWeights | MoEWeights,
             live_rows: torch.Tensor | None) -> torch.Tensor:
        if isinstance(w, MLPWeights):  # replicated, or column/row split over ranks (then summed)
            y = mlp(x, w, self.fused)
            return self.all_reduce(y) if w.gate_proj.shape[0] < self.cfg.intermediate_size else y
        observe = None if self.on_experts is None else (lambda ids: self.on_experts(layer, ids))
        return moe_forward(x, w, self.cfg, self.all_reduce, observe, use_kernel=self.use_kernels,
                           dense=self.dense_experts.get(layer), live_rows=live_rows)

    def _dense_experts(self) -> dict[int, ExpertStack]:
        """Dequantize the routed experts the INT4 kernel will not run, once: all such layers, or none
        when they would exceed DENSE_EXPERTS_MAX_BYTES."""
        layers = {i: layer.mlp.experts for i, layer in enumerate(self.weights.layers)
                  if isinstance(layer.mlp, MoEWeights) and not self._moe_kernel(layer.mlp)}
        # gate/up/down are [E, I, H] logically, INT4 (shape = (I, H)) or dense tensors alike
        need = sum(3 * ex.count * ex.gate_proj.shape[-2] * ex.gate_proj.shape[-1] for ex in layers.values())
        if need * self.dtype.itemsize > DENSE_EXPERTS_MAX_BYTES:
            return {}
        # with the kernels, the projected path (skinny_linear) reads down as [H, E·I]
        return {i: dense_stack(ex, self.dtype, down_by_row=self.fused) for i, ex in layers.items()}

    def _moe_kernel(self, w: MoEWeights) -> bool:
        return self.use_kernels and kernel_fits_for(self.device, self.dtype, w.experts)

    def attention_path(self, kv_cache: torch.Tensor) -> str:
        """KERNEL, SYNC_FREE or REFERENCE for a forward over this cache (see the module docstring)."""
        if self._kernels_on(kv_cache):
            return KERNEL
        return SYNC_FREE if self.sync_free else REFERENCE

    def _kernels_on(self, kv_cache: torch.Tensor) -> bool:
        """CUDA kernels for attention: flag set, bf16 cache on a GPU (CPU always runs the reference)."""
        # The tree-MLA kernel is built for K2.6's 576-wide latent rows; other widths use the reference.
        return (self.use_kernels and kv_cache.is_cuda and kv_cache.dtype == torch.bfloat16
                and self.cfg.kv_cache_width == MLA_KERNEL_WIDTH)

    def graph_safe(self, kv_cache: torch.Tensor, max_rows: int = GRAPH_MAX_ROWS) -> bool:
        """Whether forward can be captured in a CUDA graph for plans up to `max_rows` rows: attention and
        every MoE layer on the kernel or the sync-free path (the reference path's per-session key groups
        and per-expert loop read tensors back to the host)."""
        if not kv_cache.is_cuda or self.attention_path(kv_cache) == REFERENCE:
            return False
        return all(self._moe_kernel(layer.mlp) or (i in self.dense_experts
                                                   and dense_fits(max_rows, self.dense_experts[i]))
                   for i, layer in enumerate(self.weights.layers) if isinstance(layer.mlp, MoEWeights))

    def _check(self, plan: BatchPlan, kv_cache: torch.Tensor, target_layer_ids: Sequence[int]) -> None:
        cfg = self.cfg
        layers, width = cfg.num_hidden_layers, cfg.kv_cache_width
        if kv_cache.dim() != 4 or kv_cache.shape[0] != layers or kv_cache.shape[3] != width:
            raise ValueError(f"kv_cache must be [{cfg.num_hidden_layers}, pages, page_size, "
                             f"{cfg.kv_cache_width}], got {tuple(kv_cache.shape)}")
        bad = [i for i in target_layer_ids if not 0 <= i < cfg.num_hidden_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} outside [0, {cfg.num_hidden_layers})")


def _with_tiled_experts(weights: TargetWeights) -> TargetWeights:
    """`weights` with every MoE layer's INT4 experts in the tiled order kernels/moe_w4a16 reads: the same
    objects where they already are (the loader and the synthetic draw give that order on a GPU), copies
    otherwise (small models moved to a GPU)."""
    def layer(w: LayerWeights) -> LayerWeights:
        if not isinstance(w.mlp, MoEWeights):
            return w
        return replace(w, mlp=replace(w.mlp, experts=tile_experts(w.mlp.experts)))

    return replace(weights, layers=tuple(layer(w) for w in weights.layers))


def _rows(rows: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device) if rows is None else rows
