"""Multi-head latent attention (reference/k26.md §3.3, §3.6), torch reference for both forms.

Head parallelism: `q_b_proj`, `kv_b_proj` and `o_proj` may hold only this rank's heads (rows of the
first two, columns of o_proj); the local head count is read from the weight shapes. The latent
projection is full on every rank, so the cached 576-wide rows are identical everywhere. The returned
output is this rank's partial sum over its heads; the caller all-reduces it.

Two torch paths read the keys: the reference loops over sessions (`KeyGroup`s from plan.key_groups, one
host sync per forward); the sync-free path (`RowKeys` from `row_keys`) gives every row the same static
key layout built with tensor ops only, so it runs on a GPU without host syncs and can be captured in a
CUDA graph. Both compute the attention core in fp32; K2.6 shapes on GPU use the CUDA kernel instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from verifier_service.linear import fuse_rows, project
from verifier_service.model_config import K2Config
from verifier_service.plan import BatchPlan, KeyGroup
from verifier_service.rope import apply_rope

# Epsilon of the q/kv latent RMSNorms. DeepSeek's modeling code shipped with the K2 checkpoints and
# HF transformers construct these norms with their default 1e-6, not config.rms_norm_eps (vLLM uses
# the latter; at K2.6's latent magnitudes the two agree far below bf16 resolution).
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLAWeights:
    """Checkpoint names under `self_attn.`; [out, in] like nn.Linear.

    The two latent projections read the same x, so they are stored as the row blocks of one tensor
    `qkv_a_proj` [q_lora_rank + kv_lora_rank + qk_rope_head_dim, H] and run as one GEMM (K2.6, 16 rows:
    one 30 MB GEMM instead of a split-K 22 MB one plus its reduce and an 8 MB one); `q_a_proj` and
    `kv_a_proj_with_mqa` are views of it."""

    q_a_proj: torch.Tensor  # [q_lora_rank, H]
    q_a_layernorm: torch.Tensor  # [q_lora_rank]
    q_b_proj: torch.Tensor  # [heads_local * qk_head_dim, q_lora_rank], per head [nope ; rope]
    kv_a_proj_with_mqa: torch.Tensor  # [kv_lora_rank + qk_rope_head_dim, H]
    kv_a_layernorm: torch.Tensor  # [kv_lora_rank]
    kv_b_proj: torch.Tensor  # [heads_local * (qk_nope_head_dim + v_head_dim), kv_lora_rank], per head [W_UK ; W_UV]
    o_proj: torch.Tensor  # [H, heads_local * v_head_dim]
    qkv_a_proj: torch.Tensor = field(init=False, repr=False)  # [q_a_proj ; kv_a_proj_with_mqa]

    def __post_init__(self) -> None:
        fuse_rows(self, "qkv_a_proj", "q_a_proj", "kv_a_proj_with_mqa")


def kv_b_heads(kv_b_proj: torch.Tensor, cfg: K2Config) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj [h·(nope + v), C] (or a cast of it) as per-head views: W_UK [h, nope, C], W_UV [h, v, C]."""
    per_head = cfg.qk_nope_head_dim + cfg.v_head_dim
    kv_b = kv_b_proj.view(kv_b_proj.numel() // (per_head * cfg.kv_lora_rank), per_head, cfg.kv_lora_rank)
    return kv_b.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fused: bool = False) -> torch.Tensor:
    """Statistics in fp32, normalized value cast back to x's dtype, then × weight (HF convention).
    fused: the same in one launch (kernels/rms_norm, CUDA) instead of ~6."""
    if fused:
        from kernels.rms_norm import rms_norm as rms_norm_kernel

        return rms_norm_kernel(x, weight, eps)  # contiguous rows, or a column block of wider ones
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, fused: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's residual add and the norm after it: h = x + delta, -> (h, rms_norm(h)).
    fused: both in one launch (kernels/rms_norm.add_rms_norm), same rounding."""
    if fused:
        from kernels.rms_norm import add_rms_norm as add_rms_norm_kernel

        return add_rms_norm_kernel(x, delta, weight, eps)
    h = x + delta
    return h, rms_norm(h, weight, eps)


def _projections(
    x: torch.Tensor, w: MLAWeights, cfg: K2Config, fused: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H] -> q [T, h, nope + rope], kv_a output [T, kv_lora + rope], normed latent c [T, kv_lora]
    (the rope part of kv is not normalized). fused: kernels for the norms and few-row projections."""
    heads, q_lora = w.q_b_proj.shape[0] // cfg.qk_head_dim, w.q_a_proj.shape[0]
    qkv = project(x, w.qkv_a_proj, fused)  # [T, q_lora + kv_lora + rope]
    kv = qkv[:, q_lora:]  # [T, kv_lora + rope], rows q_lora + kv_lora + rope apart
    if fused:  # both latent norms in one launch: one link fewer in the step's chain of small kernels
        from kernels.rms_norm import rms_norm_pair

        q_lat, c = rms_norm_pair(qkv[:, :q_lora], w.q_a_layernorm, kv[:, : cfg.kv_lora_rank], w.kv_a_layernorm,
                                 LATENT_NORM_EPS)
    else:
        q_lat = rms_norm(qkv[:, :q_lora], w.q_a_layernorm, LATENT_NORM_EPS)  # [T, q_lora]
        c = rms_norm(kv[:, : cfg.kv_lora_rank], w.kv_a_layernorm, LATENT_NORM_EPS)  # [T, kv_lora]
    q = project(q_lat, w.q_b_proj, fused).view(x.shape[0], heads, cfg.qk_head_dim)  # [T, h, 192]
    return q, kv, c


def mla_project(
    x: torch.Tensor, w: MLAWeights, cfg: K2Config, cos: torch.Tensor, sin: torch.Tensor, fused: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H] -> q_nope [T, h, nope], rotated q_rope [T, h, rope], latent row [T, kv_lora + rope]."""
    q, kv, c = _projections(x, w, cfg, fused)
    q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
    q_rope = apply_rope(q_rope, cos[:, None, :], sin[:, None, :])  # [T, h, rope]
    latent = torch.cat([c, apply_rope(kv[:, cfg.kv_lora_rank:], cos, sin)], dim=-1)  # [T, 576]
    return q_nope, q_rope, latent


def attend_absorbed(
    q_nope: torch.Tensor, q_rope: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor,
    w: MLAWeights, cfg: K2Config,
) -> torch.Tensor:
    """MQA over latent rows: q_nope [R, h, nope], q_rope [R, h, rope], keys [S, 576], mask [R, S] -> [R, h*v].

    The attention core runs in fp32 whatever the model dtype (kernels accumulate scores and P·V in fp32)."""
    dtype = q_nope.dtype
    c, k_rope = keys.float().split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)  # [S, C], [S, rope]
    w_uk, w_uv = kv_b_heads(w.kv_b_proj.float(), cfg)  # [h, nope, C], [h, v, C]
    q_lat = torch.einsum("rhn,hnc->rhc", q_nope.float(), w_uk)  # [R, h, C]
    scores = torch.einsum("rhc,sc->hrs", q_lat, c) + torch.einsum("rhd,sd->hrs", q_rope.float(), k_rope)
    probs = _softmax(scores * cfg.softmax_scale, mask)  # [h, R, S] fp32
    o_lat = torch.einsum("hrs,sc->rhc", probs, c)  # [R, h, C]
    return torch.einsum("rhc,hvc->rhv", o_lat, w_uv).flatten(1).to(dtype)  # [R, h*v]


def attend_explicit(
    q_nope: torch.Tensor, q_rope: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor,
    w: MLAWeights, cfg: K2Config,
) -> torch.Tensor:
    """Same contract as `attend_absorbed`, decompressing per-head K/V from the latent rows (fp32 core)."""
    heads, dtype = q_nope.shape[1], q_nope.dtype
    c, k_rope = keys.float().split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    kv = F.linear(c, w.kv_b_proj.float()).view(keys.shape[0], heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
    k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)  # [S, h, nope], [S, h, v]
    scores = torch.einsum("rhn,shn->hrs", q_nope.float(), k_nope) + torch.einsum("rhd,sd->hrs", q_rope.float(), k_rope)
    probs = _softmax(scores * cfg.softmax_scale, mask)  # [h, R, S] fp32
    return torch.einsum("hrs,shv->rhv", probs, v).flatten(1).to(dtype)  # [R, h*v]


@dataclass(frozen=True)
class RowKeys:
    """Sync-free key layout: row t may attend cache slots `slots[t, s]` where `valid[t, s]`.

    Columns (S = P·page_size + R): its sequence's prefix positions 0 .. P·page_size-1 through the page
    table (valid below prefix_len), then its sequence's rows 0 .. R-1 (valid where tree_mask)."""

    slots: torch.Tensor  # int64 [T, S]; 0 where not valid, so every gather index is a legal slot
    valid: torch.Tensor  # bool [T, S]


def row_keys(plan: BatchPlan, page_size: int) -> RowKeys:
    """Resolve the plan into per-row key slots with tensor ops only (no .tolist/.item, static shapes)."""
    T, R = plan.tree_mask.shape
    B, P = plan.page_table.shape
    dev = plan.write_slots.device
    rows = torch.arange(T, device=dev)
    # Row -> sequence: the last b with row_starts[b] <= t (empty sequences repeat a start and are skipped).
    seq = (torch.searchsorted(plan.row_starts, rows, right=True) - 1).clamp(0, max(B - 1, 0))  # [T]
    pos = torch.arange(P * page_size, device=dev)  # [P·ps] prefix positions
    prefix = plan.page_table[:, pos // page_size] * page_size + pos % page_size  # [B, P·ps] slots
    prefix_ok = pos < plan.prefix_lens[:, None]  # [B, P·ps]
    start, end = plan.row_starts[seq], plan.row_starts[seq + 1]  # [T] the row's sequence's rows
    own = start[:, None] + torch.arange(R, device=dev)  # [T, R] batch row of the sequence's j-th row
    own_ok = plan.tree_mask & (own < end[:, None])  # [T, R]
    own_slots = plan.write_slots[own.clamp(max=max(T - 1, 0))]  # [T, R]
    valid = torch.cat([prefix_ok[seq], own_ok], dim=1)  # [T, S]
    return RowKeys(torch.where(valid, torch.cat([prefix[seq], own_slots], dim=1), 0), valid)


# Sync-free attention processes query rows in chunks whose gathered keys and scores stay below this
# (chunk count is a function of shapes only, so the loop is the same on every replay).
ATTN_CHUNK_BYTES = 256 << 20
MASKED = torch.finfo(torch.float32).min  # finite: a row with no visible key averages zeros, never NaN


def attend_rows(
    q_nope: torch.Tensor, q_rope: torch.Tensor, kv_layer: torch.Tensor, keys: RowKeys,
    w: MLAWeights, cfg: K2Config, explicit: bool,
) -> torch.Tensor:
    """Every row over its own key set: q_nope [T, h, nope], q_rope [T, h, rope], kv_layer [slots, 576]
    -> [T, h*v] in q's dtype. fp32 core like `attend_absorbed` / `attend_explicit`."""
    T, S = keys.slots.shape
    heads = q_nope.shape[1]
    out = q_nope.new_zeros(T, heads * cfg.v_head_dim)
    if heads == 0:  # a rank without heads (more ranks than heads): contributes nothing
        return out
    per_key = cfg.kv_cache_width * (4 + kv_layer.element_size()) + 3 * 4 * heads  # keys + scores/probs
    if explicit:
        per_key += 4 * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)  # decompressed K and V
    step = max(1, ATTN_CHUNK_BYTES // max(1, S * per_key))
    attend = _explicit_rows if explicit else _absorbed_rows
    for r0 in range(0, T, step):
        r = slice(r0, r0 + step)
        # Keys not visible are zeroed: unused (even NaN-poisoned) cache slots never reach scores or values.
        k = kv_layer[keys.slots[r]].float().masked_fill_(~keys.valid[r, :, None], 0.0)  # [t, S, 576]
        out[r] = attend(q_nope[r].float(), q_rope[r].float(), k, keys.valid[r], w, cfg)
    return out


def _absorbed_rows(q_nope, q_rope, keys, valid, w: MLAWeights, cfg: K2Config) -> torch.Tensor:
    """fp32 q_nope [t, h, nope], q_rope [t, h, rope], keys [t, S, 576], valid [t, S] -> [t, h*v]."""
    c, k_rope = keys.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)  # [t, S, C], [t, S, rope]
    w_uk, w_uv = kv_b_heads(w.kv_b_proj.float(), cfg)  # [h, nope, C], [h, v, C]
    q_lat = torch.einsum("thn,hnc->thc", q_nope, w_uk)  # [t, h, C]
    scores = torch.einsum("thc,tsc->ths", q_lat, c) + torch.einsum("thd,tsd->ths", q_rope, k_rope)
    probs = _row_softmax(scores * cfg.softmax_scale, valid)  # [t, h, S]
    o_lat = torch.einsum("ths,tsc->thc", probs, c)  # [t, h, C]
    return torch.einsum("thc,hvc->thv", o_lat, w_uv).flatten(1)  # [t, h*v]


def _explicit_rows(q_nope, q_rope, keys, valid, w: MLAWeights, cfg: K2Config) -> torch.Tensor:
    """Same contract as `_absorbed_rows`, decompressing per-head K/V from each row's latent keys."""
    t, S, heads = keys.shape[0], keys.shape[1], q_nope.shape[1]
    c, k_rope = keys.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    kv = F.linear(c, w.kv_b_proj.float()).view(t, S, heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
    k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)  # [t, S, h, nope], [t, S, h, v]
    scores = torch.einsum("thn,tshn->ths", q_nope, k_nope) + torch.einsum("thd,tsd->ths", q_rope, k_rope)
    probs = _row_softmax(scores * cfg.softmax_scale, valid)  # [t, h, S]
    return torch.einsum("ths,tshv->thv", probs, v).flatten(1)  # [t, h*v]


def _row_softmax(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """scores fp32 [t, h, S], valid [t, S]: masked before the softmax (masked keys get weight 0)."""
    return torch.softmax(scores.masked_fill(~valid[:, None, :], MASKED), dim=-1)


def _softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """scores fp32 [h, R, S]; every row sees at least itself, so no row is fully masked."""
    return torch.softmax(scores.masked_fill(~mask[None], float("-inf")), dim=-1)


def mla_project_cached(
    x: torch.Tensor, w: MLAWeights, cfg: K2Config, cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor,
    write_slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`mla_project` + the cache write through kernels (norms, then RoPE and the latent rows in one launch):
    x [T, H] -> q_nope [T, h, nope], rotated q_rope [T, h, rope]; latent rows land at kv_layer[write_slots]."""
    from kernels.mla_rope import mla_rope

    q, kv, c = _projections(x, w, cfg, True)
    q_rope = mla_rope(q, kv, c, cos.contiguous(), sin.contiguous(), kv_layer, write_slots.contiguous())
    return q[..., : cfg.qk_nope_head_dim], q_rope


def mla_project_paged(
    x: torch.Tensor, w: MLAWeights, cfg: K2Config, cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor,
    write_slots: torch.Tensor, w_uk_t: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The tree-attention kernel's query, with the cache write in the latent norms' launch (kernels/rms_norm
    latent_norms): x [T, H] -> (q_abs [T, h, C] = W_UKᵀ q_nope, rope = (q_pe [T, h, rope] unrotated, cos, sin)).
    The kernel rotates q_pe as it loads the query, so W_UK's projection is the launch right before it, with no
    RoPE launch between (H200, 61-layer verify step against kernels/mla_rope between them: 1 / 4 / 16 rows -2.1 /
    -1.7 / -0.3 %, logits bit-equal). w_uk_t: see absorb_query."""
    from kernels.rms_norm import latent_norms

    heads, q_lora, nope = w.q_b_proj.shape[0] // cfg.qk_head_dim, w.q_a_proj.shape[0], cfg.qk_nope_head_dim
    cos, sin = cos.contiguous(), sin.contiguous()
    qkv = project(x, w.qkv_a_proj, True)  # [T, q_lora + kv_lora + rope]
    q_lat = latent_norms(qkv[:, :q_lora], w.q_a_layernorm, qkv[:, q_lora:], w.kv_a_layernorm, LATENT_NORM_EPS,
                         cos, sin, kv_layer, write_slots.contiguous())
    q = project(q_lat, w.q_b_proj, True).view(x.shape[0], heads, cfg.qk_head_dim)  # [T, h, 192]
    q_abs = x.new_empty(x.shape[0], heads, cfg.kv_lora_rank)
    absorb_query(q[..., :nope], w, cfg, q_abs, w_uk_t, before_attention=True)
    return q_abs, (q[..., nope:], cos, sin)


def mla_forward(
    x: torch.Tensor,
    w: MLAWeights,
    cfg: K2Config,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_layer: torch.Tensor,
    write_slots: torch.Tensor,
    groups: Sequence[KeyGroup] | RowKeys,
    explicit: bool,
    paged: tuple | None = None,
    fused: bool = False,
    w_uk_t: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H] -> this rank's partial attention output [T, H] (all-reduce over heads follows).

    kv_layer [num_slots, 576] is one layer's cache viewed flat; rows are written before attention reads.
    `paged` = (kv [pages, page_size, 576], plan) selects the CUDA tree-attention kernel (absorbed form);
    `groups` = RowKeys selects the sync-free batched path, a list of KeyGroups the per-session reference.
    `fused`: norms, RoPE and the cache write in kernels (kernels/rms_norm, and kernels/mla_rope or, with `paged`,
    the tree-attention kernel's own rotation; CUDA), and the
    projections of few rows (kernels/skinny_linear). `w_uk_t`: W_UK transposed per head (see absorb_query).
    """
    cached = fused and kv_layer.dtype == x.dtype and kv_layer.is_contiguous()  # the cache write by kernels
    if paged is not None and cached:  # the tree-attention kernel rotates the query itself
        q_abs, rope = mla_project_paged(x, w, cfg, cos, sin, kv_layer, write_slots, w_uk_t)
        return project(attend_paged_kernel(q_abs, w, cfg, *paged, rope=rope), w.o_proj, fused)
    if cached:
        q_nope, q_rope = mla_project_cached(x, w, cfg, cos, sin, kv_layer, write_slots)
    else:
        q_nope, q_rope, latent = mla_project(x, w, cfg, cos, sin, fused)
        kv_layer[write_slots] = latent.to(kv_layer.dtype)
    if paged is not None:  # the tree-attention kernel's absorbed query [W_UKᵀ q_nope ; rotated q_rope]
        q_abs = x.new_empty(*q_nope.shape[:2], cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        absorb_query(q_nope, w, cfg, q_abs, w_uk_t)
        q_abs[..., cfg.kv_lora_rank:] = q_rope
        return project(attend_paged_kernel(q_abs, w, cfg, *paged), w.o_proj, fused)
    if isinstance(groups, RowKeys):
        return project(attend_rows(q_nope, q_rope, kv_layer, groups, w, cfg, explicit).to(x.dtype), w.o_proj, fused)
    attend = attend_explicit if explicit else attend_absorbed
    heads = q_nope.shape[1]
    out = x.new_empty(x.shape[0], heads * cfg.v_head_dim)  # [T, h*v]
    for g in groups:
        keys = kv_layer[g.key_slots]  # [S, 576]
        out[g.rows] = attend(q_nope[g.rows], q_rope[g.rows], keys, g.mask, w, cfg)
    return project(out, w.o_proj, fused)


# Most rows whose per-head products (W_UV; W_UK given w_uk_t) run on kernels/skinny_gemm. H200, 61-layer step, W_UV
# against cuBLAS: 1 row -0.5 %, 16 rows -1.2 %, 32 rows +0.6 %.
UV_SKINNY_MAX_ROWS = 16


def uk_transposed(w: MLAWeights, cfg: K2Config) -> torch.Tensor:
    """W_UK per head as skinny_gemm's [N, K] weights: [h, C, nope] contiguous (a copy made at load: K2.6, 10 heads,
    1.3 MB a layer). kv_b_proj holds it as [h, nope, C], the input dimension first."""
    return kv_b_heads(w.kv_b_proj, cfg)[0].transpose(1, 2).contiguous()


def absorb_query(q_nope: torch.Tensor, w: MLAWeights, cfg: K2Config, q_abs: torch.Tensor,
                 w_uk_t: torch.Tensor | None = None, before_attention: bool = False) -> None:
    """q_abs[..., :C] = W_UKᵀ q_nope per head: a batched GEMM over heads that reads q_nope [T, h, nope] and writes
    q_abs [T, h, C] or [T, h, C + rope] through strided views (cuBLAS takes any row and batch stride: no head-major copies).
    With w_uk_t (uk_transposed) and up to UV_SKINNY_MAX_ROWS rows: one kernels/skinny_gemm launch over heads;
    before_attention: the tree-attention kernel is launched right after it (it may start on its prefix tiles)."""
    heads, C = q_nope.shape[1], cfg.kv_lora_rank
    if heads == 0:
        return
    x, out = q_nope.transpose(0, 1), q_abs[..., :C].transpose(0, 1)  # [h, T, nope], [h, T, C]
    if w_uk_t is not None and x.shape[1] <= UV_SKINNY_MAX_ROWS:
        from kernels import skinny_gemm

        if skinny_gemm.fits(x, w_uk_t):
            skinny_gemm.skinny_gemm(x, w_uk_t, out=out, early_trigger=before_attention)
            return
    torch.matmul(x, kv_b_heads(w.kv_b_proj, cfg)[0], out=out)


def attend_paged_kernel(q: torch.Tensor, w: MLAWeights, cfg: K2Config, kv_paged: torch.Tensor,
                        plan, rope=None) -> torch.Tensor:
    """Absorbed MLA through kernels/mla_tree_attention: q [T, h, 576] = [W_UKᵀ q_nope ; q_rope] (absorb_query and
    RoPE wrote it), or q [T, h, 512] and rope = (q_pe, cos, sin) for the kernel to rotate (mla_project_paged),
    o_lat [T, h, 512] over the paged cache, then W_UV -> [T, h*v] (bf16, CUDA): a batched GEMM
    over heads through strided views, as absorb_query (K2.6: four ~2.2 us head-major copies per layer before), on
    kernels/skinny_gemm up to UV_SKINNY_MAX_ROWS rows (one launch, PDL), else cuBLAS."""
    from kernels import skinny_gemm
    from kernels.mla_tree_attention import mla_tree_attention

    T, heads = q.shape[:2]
    if heads == 0:  # a rank without heads (more ranks than heads): contributes nothing
        return q.new_zeros(T, 0)
    w_uv = kv_b_heads(w.kv_b_proj, cfg)[1]  # [h, v, C]
    o_lat = mla_tree_attention(q, kv_paged, plan.page_table, plan.prefix_lens, plan.row_starts,
                               plan.tree_mask, plan.write_slots, cfg.softmax_scale, plan.pad_last, rope)  # [T, h, C]
    out = o_lat.new_empty(T, heads, cfg.v_head_dim)
    x = o_lat.transpose(0, 1)  # [h, T, C]
    if T <= UV_SKINNY_MAX_ROWS and skinny_gemm.fits(x, w_uv):  # one launch over heads, weights before its wait
        skinny_gemm.skinny_gemm(x, w_uv, out=out.transpose(0, 1))
    else:
        torch.matmul(x, w_uv.transpose(1, 2), out=out.transpose(0, 1))  # [h, T, v]
    return out.view(T, heads * cfg.v_head_dim)
