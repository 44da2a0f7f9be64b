"""The DFlash drafter's block attention (GQA) over its paged K/V pool, and its torch reference.

    dflash_attention(q, k_pool, v_pool, page_table, page_size, k_blk, v_blk, mask, softmax_scale)
        -> out bf16 [B, Bk, nh, hd]

q           bf16 [B, Bk, nh, hd]    the block's queries (q_norm and RoPE applied)
k_pool      bf16 [slots, nkv, hd]   one layer of drafter_service.kv_cache.KVPool.k (v_pool: .v); slot s =
                                    page * page_size + offset
page_table  int64 [B, P]            pages of sequence b in position order: context key j of b is slot
                                    page_table[b, j // page_size] * page_size + j % page_size, j < P·page_size
k_blk       bf16 [B, Bk, nkv, hd]   the block's own keys (k_norm and RoPE applied), contiguous; v_blk: its values,
                                    contiguous or with its tokens any 16-byte-aligned stride apart (a column block
                                    of the drafter's fused k|v projection output)
mask        bool [B, Bk, P·page_size + Bk]  token t of b sees key j of [context ; block] (any strides with a
                                    unit last stride: drafter_service.model.block_mask's expanded view works)

Query head i reads kv head i // (nh / nkv), as torch's scaled_dot_product_attention(enable_gqa=True).
out = softmax(scale · q·k over the visible keys) v; a query that sees no key gets 0. The served drafter ran
this as a gather of the context K/V, a cat with the block's and cuDNN's SDPA: 114 us per layer at Kimi's
dims with a 4K context (90 us of it the attention: one CTA per head walks all keys), 15 % of a Propose
(H200, 2026-11-30). Kernel: the G·Bk ≤ 64 queries of a kv head share each 128-key chunk, read from the pool
pages directly; one block per (chunk, kv head, sequence), bf16 MMAs, fp32 softmax; chunks merged by their
row maxima and sums. hd 64 or 128.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from kernels._compile import cuda_source, get_kernels, launch

CODE = "dflash_attention.cu"
HEAD_DIMS = (64, 128)
NAMES = tuple(f"{k}<{hd}>" for hd in HEAD_DIMS for k in ("dflash_attn", "dflash_merge"))
QR, KC = 64, 128  # query rows and keys per block (the .cu's)
PDL = True  # the merge by programmatic dependent launch: resident while the chunks run (sm_90+)


def supports(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> bool:
    """Shapes the kernel takes: bf16, hd 64 or 128, the block's queries of one kv head in one 64-row tile."""
    return (dtype == torch.bfloat16 and head_dim in HEAD_DIMS and num_heads % num_kv_heads == 0
            and block_size * (num_heads // num_kv_heads) <= QR)


def _smem(hd: int) -> int:  # sizeof(DflashSmem<HD>) in the .cu
    return (QR + 2 * KC) * hd * 2 + QR * KC


def dflash_attention(q, k_pool, v_pool, page_table, page_size: int, k_blk, v_blk, mask,
                     softmax_scale: float) -> torch.Tensor:
    B, Bk, nh, hd = q.shape
    nkv, P = k_pool.shape[1], page_table.shape[1]
    L = P * page_size + Bk
    assert supports(nh, nkv, hd, Bk, q.dtype) and q.is_cuda and q.is_contiguous()
    for t in (k_pool, v_pool):
        assert t.dtype == q.dtype and t.dim() == 3 and t.shape[1:] == (nkv, hd) and t.is_contiguous()
    for t in (k_blk, v_blk):
        assert t.dtype == q.dtype and t.shape == (B, Bk, nkv, hd) and t.stride()[2:] == (hd, 1), (t.shape, t.stride())
    assert k_blk.is_contiguous() and v_blk.stride(0) == Bk * v_blk.stride(1) and v_blk.stride(1) % 8 == 0
    assert v_blk.data_ptr() % 16 == 0  # 16-byte cp.async pieces of each value row
    assert page_table.dtype == torch.int64 and page_table.is_contiguous() and page_table.shape[0] == B
    assert mask.dtype == torch.bool and mask.shape == (B, Bk, L) and mask.stride(2) == 1
    out = torch.empty_like(q)
    if B == 0 or Bk == 0:
        return out
    chunks = math.ceil(L / KC)
    o_part = torch.empty(B, nkv, chunks, QR, hd, dtype=torch.float32, device=q.device)
    ml = torch.empty(B, nkv, chunks, QR, 2, dtype=torch.float32, device=q.device)
    ker = get_kernels(cuda_source(CODE), NAMES)
    launch(ker[f"dflash_attn<{hd}>"], (chunks, nkv, B), 128, q, k_pool, v_pool, page_table, P, page_size, k_blk,
           v_blk, np.int64(v_blk.stride(1)), mask, np.int64(mask.stride(0)), np.int64(mask.stride(1)), Bk, nh, nkv,
           softmax_scale * math.log2(math.e), o_part, ml, smem=_smem(hd))
    launch(ker[f"dflash_merge<{hd}>"], (QR, nkv, B), hd, o_part, ml, chunks, Bk, nh, nkv, out, pdl=PDL)
    return out


def dflash_attention_ref(q, k_pool, v_pool, page_table, page_size: int, k_blk, v_blk, mask,
                         softmax_scale: float) -> torch.Tensor:
    """fp32 torch: the context keys gathered by page, the block's appended, each query head against its
    kv head's keys; a query that sees no key gets 0."""
    B, Bk, nh, hd = q.shape
    G = nh // k_pool.shape[1]
    offsets = torch.arange(page_size, device=q.device)
    slots = (page_table[:, :, None] * page_size + offsets).flatten(1)  # [B, Lc]
    k = torch.cat([k_pool[slots], k_blk], dim=1).float().repeat_interleave(G, dim=2)  # [B, L, nh, hd]
    v = torch.cat([v_pool[slots], v_blk], dim=1).float().repeat_interleave(G, dim=2)
    v = torch.where(mask.any(1)[:, :, None, None], v, 0.0)  # keys nobody sees: never read (NaN-safe)
    scores = torch.einsum("bthd,bjhd->bhtj", q.float(), k) * softmax_scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = F.softmax(scores, dim=-1).nan_to_num(0.0)  # a row of -inf only: no key seen
    return torch.einsum("bhtj,bjhd->bthd", probs, v).to(q.dtype)
