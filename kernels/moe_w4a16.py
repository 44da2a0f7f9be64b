"""Routed-expert SwiGLU MLP over packed INT4 experts (W4A16), and its torch reference.

The signature of verifier_service.moe.moe_experts_ref (so the model switches with one flag), plus two optional
arguments:

    moe_w4a16(x, topk_ids, topk_weights, experts, add=None, add_ready=None) -> [T, H] bf16

add: optional bf16 [T, H] that each token's sum starts from (the shared expert's output, so that it needs no
launch after the routed experts). add_ready: when `add` is written on another stream, an event recorded after
it; only the launch that reads `add` (down with the fused combine, or moe_combine) waits for it, so routing and
gate/up overlap add's producer.

x: bf16 [T, H]. topk_ids: int64 [T, k] global expert ids. topk_weights: fp32 [T, k] (router weights,
already renormalized and scaled). experts: this rank's `ExpertStack` (duck-typed: `.first`, `.slices`, `.rank`,
`.world` and `.gate_proj/.up_proj/.down_proj`, each with `.packed`, `.scale` and `.tiled`):

    gate_proj/up_proj.packed  int32 [E, I, H/8]   word j of a row = inputs 8j..8j+7, input 8j+i in bits
    down_proj.packed          int32 [E, H, I/8]   [4i, 4i+3] (LSB first), nibble = q + 8, q in [-8, 7]
    *.scale                   bf16  [E, out, in/32]  W[n, k] = q[n, k] * scale[n, k // 32]

The kernel reads each matrix in the tiled order (`.tiled`, verifier_service/int4.py: tile_int4): the same
shapes and words, each 16-row tile's 128-input chunks stored contiguously (1 KB of words, 128 B of scales),
made once at load (the loader tiles as it reads; `Int4Weight.tile` for others). The reference reads either.

Pairs routed to experts outside [first, first + E) contribute 0 (expert parallelism: ranks sum). With
`slices` S > 1 each expert is cut into S slices of I/S intermediate rows (gate/up rows, down columns; SwiGLU is
per row, so the slices' down outputs sum to the expert's): global slice g = e·S + s is local expert g // world of
rank g % world, and a token's k experts are k·S pairs, each weighted by its expert's router weight.
Kernel: fp32 accumulation; gate/up/SiLU in fp32, act rounded to bf16 once; output bf16.
Requires H % 128 == 0 and I % 128 == 0 (K is streamed in 128-input chunks); ldmatrix hands each lane its
word of a 16-byte group piece.
Launches: moe_route (pairs grouped by local expert into work items of up to 8·NT tokens each: an expert
with more tokens gets several items, which run in parallel block rows and read its weights from DRAM
about once), gate/up, down (+ combine fused into its last block per 16-row output tile when
T <= FUSE_COMBINE_T), and a separate moe_combine only for larger T. With expert slices (`DOWN_CAT`, up to
CAT_MAX_T tokens) down and combine are one moe_down_cat instead: a GEMM per output tile over the concatenated
K of every local item, each product weighted by its token's router weight (the sliced items' K = I/S is too
short a work unit for moe_gemm's down). With `PDL` (on by default) moe_route
and the two GEMMs use programmatic dependent launch (sm_90+): each becomes resident while its predecessor runs;
moe_route waits for the router's ids after zeroing its shared counts, gate/up waits for moe_route at its
start, down streams its first weight stages before it waits for act.
Few tokens (T <= FEW_DOWN_T = 2 by default, at most 256 local pairs; `FEW_DOWN`), whole or sliced experts: down and
combine are one moe_few_down (moe_w4a16_few.cu) instead, each block summing w·down(act) over every local item for its 16
output rows of every token, each lane's weights loaded straight into registers (no ring, no y, no arrival counters).
Once enough experts are active, a block streams two 16-row tiles (GATE_UP_TPB, DOWN_TPB), half its warps
on each, so every warp's cp.async stream runs twice as long; the kernel decides from the active count.
Optionally (SPLIT_MAX > 1, off by default: slower on the H200) the gate/up K is split over blocks for
few active experts, decided on the device from the active count since the host never syncs: fp32
partials, the last block per tile sums them in a fixed order, so results are deterministic. Graph-safe: no host
sync; workspace comes from torch's caching allocator; the arrival counters are zeroed by moe_route in
the same call.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels._compile import cuda_source, device_limits, get_kernels, launch

CODE = ("moe_w4a16.cu", "moe_w4a16_few.cu")
# moe_gemm<MODE, NT, OCC, DMT, ST>: every kernel with 3 stages; with 2, those of one token tile (T <= STAGES_FEW_T)
_GEMMS_1T = ("0, 1, 2, 1", "1, 1, 2, 1", "1, 1, 4, 1", "1, 1, 2, 2", "1, 1, 2, 0")  # one token tile (NT = 1)
NAMES = ("moe_route", *(f"moe_gemm<{m}, 3>" for m in (*_GEMMS_1T, "0, 2, 2, 1", "1, 2, 2, 1", "1, 2, 2, 2")),
         *(f"moe_gemm<{m}, 2>" for m in _GEMMS_1T), "moe_combine", "moe_down_cat<2, 2>", "moe_down_cat<2, 3>",
         "moe_few_down<2>", "moe_few_down<4>")
CHUNK = 128  # inputs per chunk: must match the .cu (32 * CG)
# cp.async stages per warp (ST): 3; 2 up to STAGES_FEW_T tokens. H200, tiled weights: 3 beats 4 by 1-3 % and 5 loses
# 2-5 % (session 19); 2 gains 1-3 % at 1-8 experts with few tokens but loses 1-2 % at 55 experts and routed 16-64 rows.
STAGES, STAGES_FEW, STAGES_FEW_T = 3, 2, 4
# Warps per block, splitting K. Gate/up: 4 (4 blocks/SM) from 3 tokens; 8 (2 blocks/SM) up to
# GATE_UP_FEW_T tokens, where an EP rank holds 1-2 experts and a tile keeps 8 warps (H200, session 20:
# 4 warps 55 x 16 570 -> 527 us, 1 x 16 40 -> 35, 8 x 16 150 -> 142; but 2 x 1 28.5 -> 30.0).
# Down: 4, which the kernel splits into two tiles of 2 warps when >= 2 experts are active (4 per tile is
# best for one expert, 2 for more).
GATE_UP_WARPS, GATE_UP_WARPS_FEW, GATE_UP_FEW_T, DOWN_WARPS = 4, 8, 2, 4
# 16-row tiles per block once enough experts are active (the block's warps split into one group per
# tile; H200, T = 4-110 over 8-55 experts: 4-10 % faster than one tile per block; 4 per block is slower).
GATE_UP_TPB, DOWN_TPB = 2, 2
# 16-row pieces of the down matrix per warp for T > 1 (1 or 2): two pieces share each act fragment and
# double the bytes a warp has in flight over the short K = I (H200, 2026-11-30: down at 8 experts 46.5 ->
# 41.7 us, 55 x 16 tokens 743 -> 689 us).
DOWN_MT = 2
# The same at T = 1, where the expert count decides (1-2 experts lose with half the blocks): 0 lets the
# down kernel choose two pieces on the device once its blocks with work fill every slot (see the .cu).
DOWN_MT_T1 = 0
SPLIT_MAX = 1  # most gate/up K-split blocks per tile (when P <= SPLIT_MAX_P). 1: off; on the H200 a
# split of 2 or 4 measured slower at 1, 3 and 8 experts (per-block latency, not idle SMs, limits them)
SPLIT_MAX_P = 64
SPLIT: int | None = None  # force this split (tests); None: the kernel picks from the active-expert count
# Up to this many tokens the GEMMs take one 8-token tile per weight pass (NT = 1, lighter kernels: 64-128
# registers without spills) and stream an expert's weights again for each further 8 of its tokens; above
# it, two tiles (NT = 2). Tree verifies route 1-4 tokens to each local expert at EP 7, so NT = 1 wins
# there (H200, T = 16/32/64 rows routed over 384 experts: 149/258/390 us vs 181/316/478 with NT = 2);
# 16 tokens on each of 8 experts (T = 16) costs 171 vs 142 us.
NT1_MAX_T = 64
FUSE_COMBINE_T = 64  # up to this many tokens the down kernel's last block per tile does the combine
# Programmatic dependent launch of the two GEMMs; saves 3-6 us per call at 1-8 experts (H200). Cleared
# 2026-11-30: the full-dimension test failures once blamed on it were the bf16 torch reference's own
# routing flips (rows 8 and 16 of that test chose another 8th expert than fp32; the kernels matched
# fp32 on every row with PDL on and off, bit-identical).
PDL = True
# The down GEMM over the concatenated K of every local item (moe_down_cat): "slices" for sliced experts only (K = I/S:
# moe_gemm's per-item work units are short there), True always, False never. H100, slowest of 7 ranks, whole
# experts: moe_down_cat gains 4-5 % of the MoE at 4-8 tokens, but loses 18 % at 16 tokens routed alike (each token
# tile reads the experts again) and 7 % at 32 (session 43).
DOWN_CAT = "slices"
CAT_ZMAX = 8  # most K-split blocks per output tile
CAT_MAX_TABLES = 40 << 10  # its shared item tables (_cat_tables): two blocks of 8 warps, 3 stages, fit an SM
CAT_MAX_T = 64  # above, moe_gemm's down (H100, 4 slices, slowest rank: moe_down_cat 1452 us at 256 tokens)
# Few tokens (T <= FEW_DOWN_T, whole or sliced experts): moe_few_down (moe_w4a16_few.cu) replaces moe_gemm's down
# (or moe_down_cat) and its combine. FEW_DOWN_CPW: chunks a warp loads per batch (2 or 4); FEW_DOWN_WARPS: warps a
# block (<= 8). H100, slowest of 7 ranks, moe_w4a16 with add (session 46), us, moe_gemm's down -> 4 x 4:
# T = 1 (1 / 3 / 8 experts) 22.2 -> 20.3, 46.9 -> 41.2, 100.7 -> 94.0; T = 2 / 4 / 8 57.8 -> 52.5, 90.0 -> 81.7,
# 149.0 -> 142.1; but T = 16 242.5 -> 251.0 and 32 314.3 -> 337.8 (its n-tiles of two rows re-read act and redo the
# MMAs where experts hold more tokens). 2 x 8, 2 x 4, 4 x 8 and 4 x 2 were slower than 4 x 4. Those T = 2-8 rows spread
# 1-2 tokens over each expert; with 4 tokens on each of 8 experts (`bench kernels`, T=4 experts=8) its down took
# 70.8 us, moe_gemm's ~40. Up to 2 tokens no routing gives an expert more than one n-tile (two rows), hence
# FEW_DOWN_T = 2 until the kernel handles more rows per expert (docs/kernel-notes/moe_w4a16.md, session 46).
FEW_DOWN = True
FEW_DOWN_T = 2  # <= FEW_T (32) of the .cu
FEW_DOWN_CPW, FEW_DOWN_WARPS = 4, 4
_FEW_ROWS = 256  # FEW_ROWS of the .cu: most local pairs


def _stage_bytes(mt: int) -> int:
    return mt * 16 * 20 * 4 + mt * 16 * 4 * 2  # Stage<MT>: words (ROWW = 20) + scales


def moe_w4a16(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts,
              add: torch.Tensor | None = None, add_ready: torch.cuda.Event | None = None) -> torch.Tensor:
    gate, up, down = experts.gate_proj, experts.up_proj, experts.down_proj
    T, H = x.shape
    E, I = gate.packed.shape[:2]
    k = topk_ids.shape[1]
    assert x.is_cuda and x.dtype == torch.bfloat16 and x.is_contiguous()
    assert add is None or (add.dtype == torch.bfloat16 and add.shape == (T, H) and add.is_contiguous())
    assert topk_ids.dtype == torch.int64 and topk_ids.shape == (T, k) and topk_ids.is_contiguous()
    assert topk_weights.dtype == torch.float32 and topk_weights.shape == (T, k) and topk_weights.is_contiguous()
    for w, shape in ((gate, (E, I, H)), (up, (E, I, H)), (down, (E, H, I))):
        assert w.packed.dtype == torch.int32 and w.packed.shape == (*shape[:2], shape[2] // 8)
        assert w.scale.dtype == torch.bfloat16 and w.scale.shape == (*shape[:2], shape[2] // 32)
        assert w.packed.is_contiguous() and w.scale.is_contiguous() and w.tiled, "moe_w4a16 reads tiled experts"
    assert H % CHUNK == 0 and I % CHUNK == 0, (H, I)
    # block_sum: tiles per block x NT <= warps
    assert min(GATE_UP_WARPS, GATE_UP_WARPS_FEW) >= 2 and DOWN_WARPS >= 4 and DOWN_WARPS % 2 == 0
    assert 1 <= FEW_DOWN_WARPS <= 8 and FEW_DOWN_CPW in (2, 4)  # moe_few_down: red[8][..], the CPWs compiled
    assert FEW_DOWN_T <= 32  # red[..][FEW_T][16]
    out = torch.empty_like(x)
    if T * k == 0:
        _wait(add_ready)
        return out.zero_() if add is None else out.copy_(add)
    ker = get_kernels(cuda_source(CODE), NAMES)
    S, W = getattr(experts, "slices", 1), getattr(experts, "world", 1)
    first = np.int64(experts.first if S == 1 else experts.rank)  # the kernels' `first`: the rank when S > 1
    dev, P, k = x.device, T * k * S, k * S  # pairs (t, j, s) = slice s of token t's j-th expert
    nt = 1 if T <= NT1_MAX_T else 2  # token tiles of 8 per weight pass: a pass streams the expert's weights once
    # work items (one per 8·nt tokens of an expert): at most one per expert with pairs plus one per 8·nt pairs
    # local pairs: every pair whole; with slices at most ceil(S / W) of an expert's S slices are this rank's
    local = P if S == 1 else T * topk_ids.shape[1] * -(-S // W)
    blocks_y = min(local, min(E, local) + local // (8 * nt))
    smax = max(SPLIT or 1, SPLIT_MAX if P <= SPLIT_MAX_P else 1)
    fuse = T <= FUSE_COMBINE_T
    # items (e, first row) pairs first (8-byte aligned), then offsets, the item count, order, and the arrival
    # counters (gate/up tiles, then down tiles)
    few = FEW_DOWN and T <= FEW_DOWN_T and local <= _FEW_ROWS
    cat = not few and ((DOWN_CAT is True or (DOWN_CAT == "slices" and S > 1))
                       and T <= CAT_MAX_T and _cat_tables(blocks_y) <= CAT_MAX_TABLES)
    cat_tiles = H // 32 * -(-T // 8)  # moe_down_cat's row tiles x token tiles, one arrival counter each
    down_cnt = max(H // 16, cat_tiles) if cat else H // 16
    sizes = (2 * blocks_y, E + 1, 1, P, blocks_y * (I // 16) + down_cnt)
    items, offsets, num_items, order, counters = torch.empty(sum(sizes), dtype=torch.int32, device=dev).split(sizes)
    act = torch.empty(P, I, dtype=torch.bfloat16, device=dev)  # rows in expert-sorted order
    y = None if cat or few else torch.empty(P, H, dtype=torch.float32, device=dev)  # rows by pair index t*k + s
    part = torch.empty(smax * P * 2 * I if smax > 1 else 1, dtype=torch.float32, device=dev)
    launch(ker["moe_route"], 1, 1024, topk_ids, P, first, E, S, W, 8 * nt, offsets, order, items, num_items,
           counters, counters.numel(), smem=8 * E, pdl=PDL)
    sms = device_limits(dev.index if dev.index is not None else torch.cuda.current_device()).sms
    gate_up_warps = GATE_UP_WARPS_FEW if T <= GATE_UP_FEW_T else GATE_UP_WARPS
    st = STAGES_FEW if T <= STAGES_FEW_T else STAGES
    # the resident blocks the kernels' tile rules count: 256 threads per SM twice (their register budget)
    slots = (2 * sms * (8 // gate_up_warps), 2 * sms)
    gate_cnt = blocks_y * (I // 16)
    for mode, (w0, w1, kdim, n, b, dst, nw, z) in enumerate((
            (gate, up, H, I, x, act, gate_up_warps, smax), (down, down, I, H, act, y, DOWN_WARPS, 1))):
        if mode == 1 and cat:
            _wait(add_ready)
            _down_cat(ker, down, act, x, T, k, offsets, order, items, num_items, blocks_y, 8 * nt, cat_tiles,
                      counters[gate_cnt:], 2 * slots[1], topk_weights, S, add, out, st)
            return out
        if mode == 1 and few:
            _wait(add_ready)
            launch(ker[f"moe_few_down<{FEW_DOWN_CPW}>"], (H // 16,), (32, FEW_DOWN_WARPS), down.packed, down.scale,
                   act, topk_weights, offsets, order, items, num_items, 8 * nt, k, S, E, T, H, I, add, out, pdl=PDL)
            return out
        mt = 1 if mode == 0 else DOWN_MT if T > 1 else DOWN_MT_T1
        if mode == 1:
            _wait(add_ready)
        occ = 4 if mode == 1 and nt == 1 and T > 1 and mt == 1 else 2  # register budget, see the .cu
        launch(ker[f"moe_gemm<{mode}, {nt}, {occ}, {mt}, {st}>"], (n // (16 * max(mt, 1)), blocks_y, z), (32, nw),
               w0.packed, w0.scale, w1.packed, w1.scale, b, kdim, n, k, P, offsets, order, items, num_items,
               dst, part, counters if mode == 0 else counters[gate_cnt:], slots[mode], smax, SPLIT or 0,
               topk_ids, topk_weights, out, add, first, E, S, W, T, int(fuse), GATE_UP_TPB if mode == 0 else DOWN_TPB,
               smem=nw * st * _stage_bytes(2 if mode == 0 else mt or 2), pdl=PDL)
    if not fuse:
        _wait(add_ready)  # again, a plain edge: down's blocks without work exit without waiting for add
        launch(ker["moe_combine"], (T, -(-H // 1024)), 128, y, topk_ids, topk_weights, first, E, S, W, k, H, add,
               out)
    return out


def _cat_tables(cap: int) -> int:
    """Bytes of moe_down_cat's shared CatTables for `cap` items: e, row [8], w [8], the count, the kept item ids."""
    return 72 * cap + 4


def _down_cat(ker, down, act, x, T, k, offsets, order, items, num_items, cap, tt, tiles, counters, slots,
              topk_weights, S, add, out, st) -> None:
    """moe_down_cat: out = add + Σ over local items of w · down(act), one GEMM over the items' chunks per token
    tile of 8 (see the .cu); `cap` bounds the items, `tt` is the most rows an item holds, `tiles` the grid's row
    tiles x token tiles."""
    H, I = x.shape[1], act.shape[1]
    zmax = min(CAT_ZMAX, -(-slots // tiles))  # the kernel's Z never exceeds it
    part = torch.empty(zmax * T * H if zmax > 1 else 1, dtype=torch.float32, device=x.device)
    launch(ker[f"moe_down_cat<2, {st}>"], (tiles, zmax), (32, DOWN_WARPS), down.packed, down.scale, act, I, H, k,
           offsets, order, items, num_items, cap, tt, part, counters, slots, zmax, topk_weights, S, add, out, T,
           smem=DOWN_WARPS * st * _stage_bytes(2) + _cat_tables(cap), pdl=PDL)


def _wait(event: torch.cuda.Event | None) -> None:
    if event is not None:
        torch.cuda.current_stream().wait_event(event)


def moe_w4a16_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts,
                  add: torch.Tensor | None = None, add_ready: torch.cuda.Event | None = None) -> torch.Tensor:
    """fp32 torch reference: per local expert with tokens, exact fp32 dequantization, SwiGLU, weighted sum
    (+ add). Reads the row order and the tiled one (`.tiled`)."""
    _wait(add_ready)
    from verifier_service.int4 import untile_int4  # the tiled order's definition

    def dequant(w, e: int) -> torch.Tensor:  # -> fp32 [out, in]
        packed, scale = untile_int4(w.packed[e], w.scale[e]) if w.tiled else (w.packed[e], w.scale[e])
        shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
        q = ((packed.unsqueeze(-1) >> shifts) & 0xF).flatten(-2).float() - 8  # [out, in]
        return q * scale.float().repeat_interleave(32, dim=-1)

    from verifier_service.expert_shard import local_pairs  # the slices' placement

    local, weights = local_pairs(topk_ids, topk_weights, experts)  # [T, k·S], -1: another rank's
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    for e in range(experts.gate_proj.packed.shape[0]):
        tok, slot = torch.where(local == e)  # [n], [n]
        if tok.numel() == 0:
            continue
        h = x[tok].float()  # [n, H]
        act = torch.nn.functional.silu(h @ dequant(experts.gate_proj, e).T) * (h @ dequant(experts.up_proj, e).T)
        y = act @ dequant(experts.down_proj, e).T  # [n, H]
        out.index_add_(0, tok, y * weights[tok, slot, None])
    return (out if add is None else out + add.float()).to(x.dtype)
