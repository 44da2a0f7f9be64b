"""Absorbed-MLA tree attention over the paged latent cache, and its torch reference.

    mla_tree_attention(q, kv_cache, page_table, prefix_lens, row_starts, tree_mask, write_slots,
                       softmax_scale, pad_last=False, rope=None) -> o_lat bf16 [T, h, 512]

q            bf16 [T, h, 576]  per row and head: [W_UKᵀ q_nope (512) ; rotated q_rope (64)]; with rope,
             [T, h, 512]: the absorbed part only
rope         None, or (q_pe, cos, sin): the query's rope part before rotation, bf16 [T, h, 64] (last dim
             contiguous, any token and head strides, 16-byte aligned: the rope columns of q_b's output, no
             copy), and its angles, fp32 [T, 32] contiguous (one per interleaved pair, amplitude folded in).
             The kernel rotates it as it loads the query (kernels/mla_rope's rounding, bit for bit)
kv_cache     bf16 [num_pages, page_size, 576]  one layer of PagedKVCache.kv; slot s = page * page_size
             + offset is row s of the flat view; row = [ĉ (512, RMSNorm'ed latent) ; rotated k_rope (64)]
page_table   int64 [B, P]   page ids of sequence b in position order (tail unused)
prefix_lens  int64 [B]      committed keys of sequence b (read through page_table)
row_starts   int64 [B+1]    rows of sequence b: row_starts[b] .. row_starts[b+1]-1
tree_mask    bool  [T, R]   row t sees row row_starts[b]+j of its own sequence iff tree_mask[t, j]
write_slots  int64 [T]      slot already holding each row's own latent (scratch for tree rows)
pad_last     the last sequence holds only pad rows over prefix 0 (a CUDA graph's padded plan, whose live
             sessions, rows and prefixes only the device sees). One session (B = 2): the host's split count
             counts that session's blocks only; more: the kernel deals its blocks and picks its split count
             on the device (the device schedule). The result is the same

Row t of sequence b attends its prefix (keys 0..L-1) and its visible tree rows, values = the keys'
first 512 dims: o_lat = softmax(scale · q·k) ĉ. The caller applies W_UV and o_proj. Same arguments as
verifier_service/plan.py BatchPlan fields. Kernel: bf16 MMAs, fp32 softmax/accumulation, split-K
over long prefixes merged by LSE; the split count comes from shapes and the SM count on the host, or for a
graph of several sessions from the plan on the device (one wave of blocks over the live sequences); the (row,
head) queries of a sequence share each key tile load, up to 64 per block. On Hopper, sequences with
more than 32 queries run mla_attn_wgmma (warpgroup MMA). On sm_90+ both kernels load whole-prefix tiles
by TMA through a tensor map of kv_cache, made on the first, eager call for that cache, since a graph
capture cannot copy it to the device.
"""

from __future__ import annotations

import ctypes
import functools
import math

import numpy as np
import torch

from kernels._compile import cuda_source, device_limits, get_kernels, launch
from kernels.mla_rope import rotate_pairs_ref

CODE = ("mla_tree_attention.cu", "mla_tree_attention_sm90.cu")
# mla_attn<MT, NSTAGE> (mma.sync): MT query rows per block, NSTAGE cp.async stages of 64-key tiles (73.7 KB).
# (64, 2) needs 225 KB of smem, one block per SM; (16, 1) is 94 KB and fits sm_120's 99 KB.
# "wgmma": mla_attn_wgmma, 64 query rows on Hopper's warpgroup MMA (sm_90 only), 2 stages, 227 KB.
CONFIGS = ((16, 2), (32, 2), (64, 2), (16, 1), "wgmma")
# each attention kernel with the host schedule (<..., false>) and the device schedule (<..., true>, a graph's plan)
NAMES = tuple(f"mla_attn<{mt}, {ns}, {flag}>" for mt, ns in CONFIGS[:4] for flag in ("false", "true")) + (
    "mla_attn_wgmma<false>", "mla_attn_wgmma<true>", "mla_merge", "mla_merge32")
MERGE32_MAX_QUERIES = 20  # up to this many (row, head) queries mla_merge32 merges the splits, else mla_merge
D, DV, KT = 576, 512, 64
MAX_SPLITS = 1024  # the merges' limit (their wz[1024])
CONFIG = None  # a CONFIGS entry forced by the bench / tests; None: _config picks
SPLITS = None  # split count forced by the bench (host schedule); None: _split picks
TMA = True  # mla_attn (MT <= 32) and mla_attn_wgmma load whole-prefix tiles by TMA (page_size % 64 == 0); False: cp.async only
PDL = True  # the split merge by programmatic dependent launch: resident while mla_attn runs (sm_90+)
# mla_attn and mla_attn_wgmma by programmatic dependent launch too: whole-prefix tiles are issued before their
# griddepcontrol.wait, overlapping the kernel before them (W_UK's projection as served, the rope given).
ATTN_PDL = True


def _smem(config) -> int:
    """Dynamic smem bytes of a config: sizeof(SmemWG) or sizeof(Smem<MT, NSTAGE>), + 1 KB of alignment slack
    (the wgmma operands and the TMA-written K stages sit on 1024-byte swizzle atoms)."""
    if config == "wgmma":
        return 3 * 9 * 8192 + 8192 + 16 + (4 * 64 + 4) * 4 + 1024
    mt, nstage = config
    return mt * 1152 + nstage * KT * 1152 + mt * 128 + 8 * nstage + (128 + 2 * mt + 4) * 4 + 1024


def _kernel(config, device_schedule: bool) -> str:
    flag = "true" if device_schedule else "false"
    return f"mla_attn_wgmma<{flag}>" if config == "wgmma" else f"mla_attn<{config[0]}, {config[1]}, {flag}>"


def _config(q_rows: int, smem_block: int, wgmma: bool):
    """Query tile: the smallest of 16/32/64 rows holding a sequence's (row, head) queries, else 64
    (more query rows per key tile: fewer smem bytes per MMA), on wgmma where the device has it. Two key
    stages where they fit."""
    if CONFIG is not None:
        config = CONFIG
    elif q_rows > 32:
        config = "wgmma" if wgmma else (64, 2)
    else:
        config = (16 if q_rows <= 16 else 32, 2)
    if config == "wgmma" and not wgmma:
        config = (64, 2)
    return config if _smem(config) <= smem_block else (16, 1)


@functools.lru_cache(maxsize=1024)
def _tensor_map(ptr: int, rows: int, device: int) -> torch.Tensor:
    """CUtensorMap (128 B, in device memory) of one layer's cache viewed as [rows, 576] bf16: boxes of 64 dims x
    64 keys, 128-byte swizzle = mla_attn_wgmma's slab layout. Cached per allocation, so it is made in the eager
    run before a graph capture and stays alive with the cache."""
    from cuda.bindings import driver as cu

    from kernels._compile import _check

    u32, u64 = cu.cuuint32_t, cu.cuuint64_t
    err, tmap = cu.cuTensorMapEncodeTiled(
        cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, ptr, [u64(D), u64(rows)], [u64(D * 2)],
        [u32(64), u32(KT)], [u32(1), u32(1)],
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    _check(err)
    raw = bytearray(ctypes.string_at(tmap.getPtr(), 128))
    return torch.frombuffer(raw, dtype=torch.uint8).to(f"cuda:{device}")


# _split's cost unit: a "tile step", the time every block slot takes to stream one 64-key tile (64 x 1152 B =
# 73.7 KB; ~2.9 us on the H200 with all 132 SMs streaming). Bytes of other traffic convert at the same rate.
TILE_BYTES = KT * D * 2
# A block's fixed cost in tile steps: its launch, the page-table round trip before its first key tile, the Q
# load and its epilogue. Blocks of the first wave hide part of it behind the kernel before (PDL), later waves
# pay it whole. Fitted to session 22's forced split counts (H200, 8 sessions x 1 row x 4K / 16K keys: a second
# wave of 2 / 8 tiles a block cost 3.3-3.8 us more than one wave of 5 / 17 tiles, i.e. ~1.1-1.7 tile steps).
BLOCK_FIXED_TILES = 1.0


@functools.lru_cache(maxsize=4096)
def _split(blocks: int, block_rows: int, queries: int, max_keys: int, slots: int, forced: int | None = None,
           exact: bool = True) -> int:
    """-> split count from shapes only (graph-safe): for the page table's capacity `max_keys`, minimizes the
    predicted time in tile steps (TILE_BYTES) of `blocks` blocks per split (`slots` run at once), each with up
    to `block_rows` (row, head) queries, `queries` in all:
        waves x (tiles per split + BLOCK_FIXED_TILES + partial write) + merge read,
    where for splits > 1 a block writes block_rows x 512 fp32 partials (128 KB at 64 rows: 1.8 tiles) and the
    merge reads all splits x queries x 512 x 4 B back, spread over every slot. Ties go to fewer splits. The
    kernel spreads each sequence's actual keys over that many splits (split_chunk in the .cu).
    `exact` False: not every one of the `blocks` need hold queries. The CUDA graphs pad a step to a session bucket
    + 1 sequences of up to `bucket` rows each; how many are live is device-side. Costed as if all were busy, the
    model above picks too few splits for a lightly loaded step (H200, max_seqs 8, 16-row bucket, one live
    sequence: 9 splits 26.9 us, 19 splits 18.8), so those calls keep session 18's cost, waves x (tiles per
    split + 0.5): its overcounted waves happen to favour more splits. `forced`: the bench's split count."""
    tiles = max(1, math.ceil(max_keys / KT))
    part = block_rows * DV * 4 / TILE_BYTES if exact else 0.5  # one block's partial O, tiles (else: session 18's)
    merge = queries * DV * 4 / (slots * TILE_BYTES) if exact else 0.0  # the merge's read of one split, tile steps
    fixed = BLOCK_FIXED_TILES if exact else 0.0
    best = (math.inf, 1, tiles)
    for s in range(1, min(tiles, MAX_SPLITS) + 1) if forced is None else (min(forced, tiles, MAX_SPLITS),):
        per = math.ceil(tiles / s)
        waves = math.ceil(blocks * s / slots)
        cost = waves * (per + fixed) + ((waves * part + s * merge) if s > 1 else 0.0)
        if cost < best[0]:
            best = (cost, s, per)
    return math.ceil(max_keys / (best[2] * KT))


def _busy_blocks(B: int, T: int, R: int, h: int, mt: int, pad_last: bool) -> int:
    """-> an upper bound on the blocks of one split (past the first) that hold queries, for B sequences of T rows in
    all, at most R each, in blocks of mt (row, head) queries.
    B * ceil(R h / mt) blocks all hold queries only where every sequence has R rows, not in eager plans of uneven
    trees. There at most ceil(T h / mt) + B do (each sequence's queries in blocks of mt, one partly filled block a
    sequence).
    pad_last with B = 2 (a graph of the one-session bucket, verifier_service/graphs.py): the pad sequence's rows have
    no prefix, so their keys sit in split 0, and the live session's ceil(R h / mt) blocks are the busy ones. Counted as
    5 blocks (+B), one session's 16-row tree over 64K keys was split 26 ways: 78 of 132 SMs (H200, K2.6 rank 0; at
    the 44 splits it gets now the 16-layer step took 10.5 % less at 64K, 1.5 % at 16K). Graphs of more sessions take
    the device schedule."""
    q_blocks = math.ceil(R * h / mt)
    if pad_last and B == 2:
        return q_blocks
    return min(B * q_blocks, math.ceil(T * h / mt) + B)


def _device_grid(T: int, B: int, h: int, mt: int, slots: int) -> int:
    """Blocks of the device schedule's 1-D grid (plan_splits / sched_block in the .cu): one wave of `slots`, or one
    block per query tile where those are more (at one split each, B sequences of T rows in all have at most
    ceil(T h / mt) + B tiles)."""
    return max(slots, math.ceil(T * h / mt) + B)


def _device_splits(T: int, h: int, mt: int, slots: int) -> int:
    """o_part's split count under the device schedule. plan_splits gives at most slots // Q, Q the query tiles of
    the sequences with a prefix; a graph's live rows are more than half its row bucket T (graphs.BUCKETS: powers of
    two), so Q >= ceil((T // 2 + 1) h / mt) when every live session has a prefix. A plan below that gets fewer
    splits than it could (plan_splits caps s at this count), never a wrong result."""
    live_min = T // 2 + 1 if T > 1 else 1
    return max(1, min(MAX_SPLITS, slots // math.ceil(live_min * h / mt)))


def mla_tree_attention(q, kv_cache, page_table, prefix_lens, row_starts, tree_mask, write_slots,
                       softmax_scale: float, pad_last: bool = False, rope=None) -> torch.Tensor:
    T, h, d = q.shape
    B, R = prefix_lens.shape[0], tree_mask.shape[1]
    assert d == (D if rope is None else DV) and q.dtype == torch.bfloat16 and q.is_cuda and q.is_contiguous()
    rope_args = _rope_args(rope, T, h)
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
    lim = device_limits(q.device.index or 0)
    sms, smem_block, smem_sm, wgmma = lim.sms, lim.smem_block, lim.smem_sm, lim.major == 9
    config = _config(R * h, smem_block, wgmma)
    smem = _smem(config)
    per_sm = max(1, min(smem_sm // (smem + 1024), 2 if config == (16, 1) else 1))  # 1 KB: per-block reserve
    mt = 64 if config == "wgmma" else config[0]  # query rows a block takes
    slots = sms * per_sm  # blocks that run at once
    if pad_last and B > 2:  # a graph of 2+ sessions: the device deals the blocks and picks the split count
        grid, sched = (_device_grid(T, B, h, mt, slots), 1, 1), slots
        splits = _device_splits(T, h, mt, slots)
    else:  # the host: one split count for every sequence, from shapes and the page table's capacity (graph-safe)
        splits = _split(_busy_blocks(B, T, R, h, mt, pad_last), min(mt, R * h), T * h,
                        page_table.shape[1] * page_size + R, slots, SPLITS, exact=B * R == T)
        grid, sched = (math.ceil(R * h / mt), B, splits), 0
    o_part = torch.empty(splits, T * h, DV, dtype=torch.float32, device=q.device) if splits > 1 else out
    lse = torch.empty(splits, T * h, dtype=torch.float32, device=q.device) if splits > 1 else out
    args = [q, kv_cache, page_table, page_table.shape[1], page_size, prefix_lens, row_starts, tree_mask, R,
            write_slots, h, softmax_scale * math.log2(math.e), T * h, out, o_part, lse, B, splits, sched]
    # TMA for whole-page tiles where pages hold whole 64-key tiles (sm_90+; mla_attn<64, 2> ignores it)
    tma = page_size % KT == 0 and TMA and lim.major >= 9
    args.append(_tensor_map(kv_cache.data_ptr(), kv_cache.shape[0] * page_size, q.device.index or 0) if tma else None)
    args += [d, *rope_args]
    launch(ker[_kernel(config, sched > 0)], grid, 256, *args, smem=smem, pdl=ATTN_PDL)
    if splits > 1:
        # the merge kernel and the columns of a query row each of its blocks takes
        merge, cols = ("mla_merge32", 32) if T * h <= MERGE32_MAX_QUERIES else ("mla_merge", 128)
        launch(ker[merge], (T * h, DV // cols), 256, o_part, lse, prefix_lens, row_starts, B, h, splits, T * h, out,
               mt, sched, pdl=PDL)
    return out


def _rope_args(rope, T: int, h: int) -> list:
    """The kernels' (q_pe, pe_t, pe_h, cos, sin) arguments: all null / 0 without rope."""
    if rope is None:
        return [None, np.int64(0), 0, None, None]
    q_pe, cos, sin = rope
    assert q_pe.shape == (T, h, D - DV) and q_pe.dtype == torch.bfloat16 and q_pe.stride(2) == 1, (q_pe.shape,
                                                                                                  q_pe.stride())
    assert q_pe.data_ptr() % 16 == 0 and q_pe.stride(0) % 8 == 0 and q_pe.stride(1) % 8 == 0, q_pe.stride()
    for t in (cos, sin):
        assert t.shape == (T, (D - DV) // 2) and t.dtype == torch.float32 and t.is_contiguous(), (t.shape, t.dtype)
    return [q_pe, np.int64(q_pe.stride(0)), q_pe.stride(1), cos, sin]


def mla_tree_attention_ref(q, kv_cache, page_table, prefix_lens, row_starts, tree_mask, write_slots,
                           softmax_scale: float, pad_last: bool = False, rope=None) -> torch.Tensor:
    """fp32 torch, one sequence at a time (pad_last: a launch hint, no effect here)."""
    if rope is not None:
        q_pe, cos, sin = rope
        q = torch.cat([q, rotate_pairs_ref(q_pe, cos[:, None, :], sin[:, None, :])], dim=-1)
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
