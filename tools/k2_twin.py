"""Training twin of verifier_service's K2Model: a differentiable, batched, causal torch module.

Same parameter names as the checkpoint (without `language_model.`), same math as verifier_service
(its rms_norm, interleaved YaRN rope, softmax scale and router are called, not copied):
- RMSNorm with fp32 statistics; q/kv latent norms with eps 1e-6 (mla.LATENT_NORM_EPS);
- MLA in the explicit form (per-head K/V decompressed from the latent), causal;
- layers < first_k_dense_replace: SwiGLU MLP; the others: sigmoid router in fp32, bias
  `e_score_correction_bias` for selection only, top-k renormalized × routed_scaling_factor
  (verifier_service.moe.route), routed experts + shared expert added unweighted.
One deliberate difference in layout: routed experts are stacked per projection
(`mlp.experts.gate_proj` [E, I, H] …); `checkpoint_tensors` splits them into `experts.{e}.*`.
All experts are computed densely and weighted by the (mostly zero) routing weights: the same sum as
the verifier's sparse loop, and fast for a model this small.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from verifier_service.mla import LATENT_NORM_EPS, MLAWeights, rms_norm
from verifier_service.model import LayerWeights, TargetWeights
from verifier_service.model_config import K2Config
from verifier_service.moe import ExpertStack, MLPWeights, MoEWeights, route
from verifier_service.rope import apply_rope, rope_cos_sin, rope_inv_freq

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


class MLA(nn.Module):
    def __init__(self, cfg: K2Config):
        super().__init__()
        H, h = cfg.hidden_size, cfg.num_attention_heads
        self.cfg = cfg
        self.q_a_proj = _linear(H, cfg.q_lora_rank)
        self.q_a_layernorm = Norm(cfg.q_lora_rank, LATENT_NORM_EPS)
        self.q_b_proj = _linear(cfg.q_lora_rank, h * cfg.qk_head_dim)
        self.kv_a_proj_with_mqa = _linear(H, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        self.kv_a_layernorm = Norm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = _linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.o_proj = _linear(h * cfg.v_head_dim, H)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, S, H]; cos/sin [S, rope/2] -> [B, S, H] (causal self-attention)."""
        cfg, (B, S, _) = self.cfg, x.shape
        h = cfg.num_attention_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, S, h, cfg.qk_head_dim)
        q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        q_rope = apply_rope(q_rope, cos[:, None, :], sin[:, None, :])  # [B, S, h, rope]
        c, k_rope = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        k_rope = apply_rope(k_rope, cos, sin)  # [B, S, rope], shared by every head
        kv = self.kv_b_proj(self.kv_a_layernorm(c)).view(B, S, h, cfg.qk_nope_head_dim + cfg.v_head_dim)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        dtype = v.dtype
        q = torch.cat([q_nope.to(dtype), q_rope.to(dtype)], dim=-1)
        k = torch.cat([k_nope, k_rope[:, :, None, :].to(dtype).expand(B, S, h, cfg.qk_rope_head_dim)], dim=-1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, scale=cfg.softmax_scale)  # [B, h, S, v]
        return self.o_proj(out.transpose(1, 2).reshape(B, S, h * cfg.v_head_dim))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = _linear(hidden, inter), _linear(hidden, inter), _linear(inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, n: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, hidden))
        # Selection-only bias, moved by the aux-loss-free balancing rule (no gradient).
        self.register_buffer("e_score_correction_bias", torch.zeros(n))


class Experts(nn.Module):
    def __init__(self, n: int, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n, inter, hidden))
        self.up_proj = nn.Parameter(torch.empty(n, inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(n, hidden, inter))


class MoE(nn.Module):
    def __init__(self, cfg: K2Config):
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg.n_routed_experts, cfg.hidden_size)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
                               if cfg.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, H] -> (output [B, S, H], expert load [E] = tokens routed to each expert)."""
        flat = x.reshape(-1, x.shape[-1])  # [T, H]
        with torch.autocast(flat.device.type, enabled=False):  # router logits in fp32, as the verifier
            w = SimpleNamespace(gate=self.gate.weight.float(), e_score_correction_bias=self.gate.e_score_correction_bias)
            ids, weights = route(flat.float(), w, self.cfg)  # [T, k], [T, k] fp32
        dense_w = torch.zeros(flat.shape[0], self.cfg.n_routed_experts, device=x.device, dtype=weights.dtype)
        dense_w = dense_w.scatter(1, ids, weights)  # [T, E], zero for experts not chosen
        e = self.experts
        dt = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else flat.dtype
        xf = flat.to(dt)
        g = torch.einsum("th,eih->tei", xf, e.gate_proj.to(dt))
        u = torch.einsum("th,eih->tei", xf, e.up_proj.to(dt))
        act = F.silu(g) * u * dense_w[:, :, None].to(dt)  # [T, E, I]
        y = torch.einsum("tei,ehi->th", act, e.down_proj.to(dt))  # [T, H]
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        load = torch.bincount(ids.flatten(), minlength=self.cfg.n_routed_experts)
        return y.view_as(x), load


class Layer(nn.Module):
    def __init__(self, cfg: K2Config, index: int):
        super().__init__()
        self.input_layernorm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLA(cfg)
        self.post_attention_layernorm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(index) else MLP(cfg.hidden_size, cfg.intermediate_size)


class Body(nn.Module):
    def __init__(self, cfg: K2Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = Norm(cfg.hidden_size, cfg.rms_norm_eps)


class K2Twin(nn.Module):
    def __init__(self, cfg: K2Config):
        super().__init__()
        if cfg.tie_word_embeddings:
            raise ValueError("the twin keeps lm_head separate (K2.6 does not tie)")
        self.cfg = cfg
        self.model = Body(cfg)
        self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.last_load: list[torch.Tensor] = []  # per MoE layer, from the last forward

    def init_weights(self, seed: int = 0, std: float = 0.02) -> K2Twin:
        gen = torch.Generator().manual_seed(seed)
        out_std = std / math.sqrt(2 * self.cfg.num_hidden_layers)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
                continue
            s = out_std if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")) else std
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * s)
        return self

    def forward(self, input_ids: torch.Tensor, capture: Sequence[int] = (),
                logits: bool = True) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """input_ids [B, S] (positions 0..S-1) -> (logits [B, S, V] or None, [outputs of layers `capture`])."""
        cfg = self.cfg
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        cos, sin = rope_cos_sin(self.inv_freq, positions, cfg.rope_amplitude)  # [S, rope/2] fp32
        h = self.model.embed_tokens(input_ids)
        captured, self.last_load = {}, []
        for i, layer in enumerate(self.model.layers):
            h = h + layer.self_attn(layer.input_layernorm(h), cos, sin)
            b = layer.post_attention_layernorm(h)
            if isinstance(layer.mlp, MoE):
                y, load = layer.mlp(b)
                self.last_load.append(load)
            else:
                y = layer.mlp(b)
            h = h + y
            if i in capture:
                captured[i] = h
        out = self.lm_head(self.model.norm(h)) if logits else None
        return out, [captured[i] for i in capture]

    @torch.no_grad()
    def balance_router(self, rate: float) -> None:
        """Aux-loss-free balancing (DeepSeek-V3): raise the bias of under-loaded experts, lower over-loaded."""
        moe = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]
        for m, load in zip(moe, self.last_load):
            load = load.float()
            m.gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)

    # ---- conversion to what verifier_service loads ----
    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Canonical checkpoint names (no `language_model.`) -> fp32 tensors, experts split per id."""
        out = {}
        for name, t in self.state_dict().items():
            if ".mlp.experts." in name:
                base, proj = name.rsplit(".", 1)
                for e in range(t.shape[0]):
                    out[f"{base}.{e}.{proj}.weight"] = t[e].detach().float()
            else:
                out[name] = t.detach().float()
        return out

    def target_weights(self, dtype: torch.dtype = torch.float32) -> TargetWeights:
        """In-memory verifier_service weights (dense routed experts) equal to this module's parameters."""
        sd = {k: v.detach() for k, v in self.state_dict().items()}
        cast = lambda k: sd[k].to(dtype)  # noqa: E731
        layers = []
        for i in range(self.cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            attn = MLAWeights(**{k: cast(f"{a}{k}.weight") for k in (
                "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")})
            if self.cfg.is_moe_layer(i):
                shared = (MLPWeights(*(cast(f"{p}mlp.shared_experts.{k}.weight") for k in EXPERT_PROJS))
                          if self.cfg.n_shared_experts else None)
                mlp = MoEWeights(gate=sd[p + "mlp.gate.weight"].float(),
                                 e_score_correction_bias=sd[p + "mlp.gate.e_score_correction_bias"].float(),
                                 experts=ExpertStack(*(cast(f"{p}mlp.experts.{k}") for k in EXPERT_PROJS), first=0),
                                 shared_experts=shared)
            else:
                mlp = MLPWeights(*(cast(f"{p}mlp.{k}.weight") for k in EXPERT_PROJS))
            layers.append(LayerWeights(cast(p + "input_layernorm.weight"), attn,
                                       cast(p + "post_attention_layernorm.weight"), mlp))
        return TargetWeights(embed_tokens=cast("model.embed_tokens.weight"), layers=tuple(layers),
                             norm=cast("model.norm.weight"), lm_head=cast("lm_head.weight"))

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Inverse of `checkpoint_tensors` (e.g. dequantized INT4 experts back into the twin)."""
        sd = self.state_dict()
        for name in sd:
            if ".mlp.experts." in name:
                base, proj = name.rsplit(".", 1)
                sd[name] = torch.stack([tensors[f"{base}.{e}.{proj}.weight"] for e in range(sd[name].shape[0])])
            else:
                sd[name] = tensors[name]
        self.load_state_dict(sd)
