"""Absorbed-MLA tree attention over the paged latent cache, and its torch reference.

    mla_tree_attention(q, kv_cache, page_table, prefix_lens, row_starts, tree_mask, write_slots,
                       softmax_scale) -> o_lat bf16 [T, h, 512]

q            bf16 [T, h, 576]  per row and head: [W_UKᵀ q_nope (512) ; rotated q_rope (64)]
kv_cache     bf16 [num_pages, page_size, 576]  one layer of PagedKVCache.kv; slot s = page * page_size
             + offset is row s of the flat view; row = [ĉ (512, RMSNorm'ed latent) ; rotated k_rope (64)]
page_table   int64 [B, P]   page ids of sequence b in position order (tail unused)
prefix_lens  int64 [B]      committed keys of sequence b (read through page_table)
row_starts   int64 [B+1]    rows of sequence b: row_starts[b] .. row_starts[b+1]-1
tree_mask    bool  [T, R]   row t sees row row_starts[b]+j of its own sequence iff tree_mask[t, j]
write_slots  int64 [T]      slot already holding each row's own latent (scratch for tree rows)

Row t of sequence b attends its prefix (keys 0..L-1) and its visible tree rows, values = the keys'
first 512 dims: o_lat = softmax(scale · q·k) ĉ. The caller applies W_UV and o_proj. Same arguments as
verifier_service/plan.py BatchPlan fields. Kernel: bf16 MMAs, fp32 softmax/accumulation, split-K
over long prefixes merged by LSE; all (row, head) queries of a sequence share each key tile load.
"""

from __future__ import annotations

import functools
import math

import torch

from kernels._compile import cuda_source, get_kernels, launch

CODE = "mla_tree_attention.cu"
NAMES = ("mla_tree_attn<1>", "mla_tree_attn<2>", "mla_combine")
D, DV, KT, QT = 576, 512, 32, 32


def _smem(nbuf: int) -> int:  # sizeof(Smem<NBUF>) in the .cu
    return QT * 584 * 2 + nbuf * KT * 584 * 2 + QT * 36 * 4 + QT * 40 * 2 + 3 * QT * 4


# Key-tile buffers per block. 1: 80 KB of shared memory, two blocks per SM (fits sm_120's 99 KB);
# that beat a 2-deep ring at one block per SM by 25-35% on H200 (docs/BENCHMARKS.md).
RING = 1


@functools.cache
def _sms(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split(q_blocks: int, max_keys: int, sms: int) -> tuple[int, int]:
    """-> (splits, keys per split): enough blocks for ~2 waves, at least two key tiles per split
    (a split also pays for its query tile and its share of the merge)."""
    tiles = max(1, math.ceil(max_keys / KT))
    splits = min(math.ceil(tiles / 2), max(1, math.ceil(2 * sms / q_blocks)), 256)  # 256: mla_combine's limit
    chunk = math.ceil(tiles / splits) * KT
    return math.ceil(max_keys / chunk), chunk


def mla_tree_attention(q, kv_cache, page_table, prefix_lens, row_starts, tree_mask, write_slots,
                       softmax_scale: float) -> torch.Tensor:
    T, h, d = q.shape
    B, R = prefix_lens.shape[0], tree_mask.shape[1]
    assert d == D and q.dtype == torch.bfloat16 and q.is_cuda and q.is_contiguous()
    assert kv_cache.dtype == torch.bfloat16 and kv_cache.dim() == 3 and kv_cache.shape[2] == D
    assert kv_cache.is_contiguous()
    for ix, shape in ((page_table, (B, page_table.shape[1])), (prefix_lens, (B,)), (row_starts, (B + 1,)),
                      (write_slots, (T,))):
        assert ix.dtype == torch.int64 and ix.shape == shape and ix.is_contiguous() and ix.device == q.device
    assert tree_mask.dtype == torch.bool and tree_mask.shape == (T, R) and tree_mask.is_contiguous()
    out = torch.empty(T, h, DV, dtype=torch.bfloat16, device=q.device)
    if T == 0:
        return out
    ker = get_kernels(cuda_source(CODE), NAMES)
    page_size = kv_cache.shape[1]
    q_blocks = math.ceil(R * h / QT)
    splits, chunk = _split(B * q_blocks, page_table.shape[1] * page_size + R, _sms(q.device.index or 0))
    o_part = torch.empty(splits, T * h, DV, dtype=torch.float32, device=q.device) if splits > 1 else out
    lse = torch.empty(splits, T * h, dtype=torch.float32, device=q.device) if splits > 1 else out
    launch(ker[f"mla_tree_attn<{RING}>"], (q_blocks, B, splits), 256, q, kv_cache, page_table, page_table.shape[1],
           page_size, prefix_lens, row_starts, tree_mask, R, write_slots, h, softmax_scale * math.log2(math.e),
           chunk, T * h, out, o_part, lse, smem=_smem(RING))
    if splits > 1:
        launch(ker["mla_combine"], T * h, 512, o_part, lse, prefix_lens, row_starts, B, h, chunk, T * h, out)
    return out


def mla_tree_attention_ref(q, kv_cache, page_table, prefix_lens, row_starts, tree_mask, write_slots,
                           softmax_scale: float) -> torch.Tensor:
    """fp32 torch, one sequence at a time."""
    page_size = kv_cache.shape[1]
    flat = kv_cache.reshape(-1, D)  # [slots, 576]
    out = torch.empty(*q.shape[:2], DV, dtype=torch.bfloat16, device=q.device)  # [T, h, 512]
    starts = row_starts.tolist()
    for b, prefix in enumerate(prefix_lens.tolist()):
        r0, r1 = starts[b], starts[b + 1]
        pos = torch.arange(prefix, device=q.device)
        slots = torch.cat([page_table[b, pos // page_size] * page_size + pos % page_size, write_slots[r0:r1]])
        keys = flat[slots].float()  # [S, 576]
        seen = torch.ones(r1 - r0, prefix, dtype=torch.bool, device=q.device)
        mask = torch.cat([seen, tree_mask[r0:r1, : r1 - r0]], dim=1)  # [R_b, S]
        scores = torch.einsum("rhd,sd->rhs", q[r0:r1].float(), keys) * softmax_scale  # [R_b, h, S]
        probs = scores.masked_fill(~mask[:, None, :], float("-inf")).softmax(-1)
        out[r0:r1] = (probs @ keys[:, :DV]).to(torch.bfloat16)  # [R_b, h, 512]
    return out
