"""Routed-expert SwiGLU MLP over packed INT4 experts (W4A16), and its torch reference.

Same signature as verifier_service.moe.moe_experts_ref, so the model switches with one flag:

    moe_w4a16(x, topk_ids, topk_weights, experts) -> [T, H] bf16

x: bf16 [T, H]. topk_ids: int64 [T, k] global expert ids. topk_weights: fp32 [T, k] (router weights,
already renormalized and scaled). experts: this rank's `ExpertStack` (duck-typed: `.first` and
`.gate_proj/.up_proj/.down_proj`, each with `.packed` and `.scale`):

    gate_proj/up_proj.packed  int32 [E, I, H/8]   word j of a row = inputs 8j..8j+7, input 8j+i in bits
    down_proj.packed          int32 [E, H, I/8]   [4i, 4i+3] (LSB first), nibble = q + 8, q in [-8, 7]
    *.scale                   bf16  [E, out, in/32]  W[n, k] = q[n, k] * scale[n, k // 32]

Pairs routed to experts outside [first, first + E) contribute 0 (expert parallelism: ranks sum).
Kernel: fp32 accumulation; gate/up/SiLU in fp32, act rounded to bf16 once; output bf16.
Requires H % 128 == 0 and I % 128 == 0 (K is split over up to 8 warps in 128-input chunks).
Graph-safe: no host sync; workspace comes from torch's caching allocator.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels._compile import cuda_source, get_kernels, launch

CODE = "moe_w4a16.cu"
NAMES = ("moe_route", "moe_gemm<0, 1>", "moe_gemm<0, 2>", "moe_gemm<1, 1>", "moe_gemm<1, 2>", "moe_combine")
STAGES, CHUNK = 4, 128  # must match the .cu (STAGES, 32 * CG)
# Warps splitting K in a gate/up block. None: 8 when at most 8 pairs are routed (decode; few experts
# per rank, so more bytes in flight per block pay), else 4 (more, smaller blocks per SM). H200, 1 vs
# 3 vs 8 experts: 8 warps 31/53/112 us, 4 warps 35/58/108 us (docs/BENCHMARKS.md).
GATE_UP_WARPS: int | None = None


def _stage_bytes(mt: int) -> int:
    return mt * 16 * 20 * 4 + mt * 16 * 4 * 2  # Stage<MT>: words (ROWW = 20) + scales


def _warps(k: int, most: int) -> int:
    """Warps splitting K in a block: more warps = more bytes in flight when few experts are active."""
    return next(w for w in (8, 4, 2, 1) if w <= most and k % (CHUNK * w) == 0)


def moe_w4a16(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts) -> torch.Tensor:
    gate, up, down = experts.gate_proj, experts.up_proj, experts.down_proj
    T, H = x.shape
    E, I = gate.packed.shape[:2]
    k = topk_ids.shape[1]
    assert x.is_cuda and x.dtype == torch.bfloat16 and x.is_contiguous()
    assert topk_ids.dtype == torch.int64 and topk_ids.shape == (T, k) and topk_ids.is_contiguous()
    assert topk_weights.dtype == torch.float32 and topk_weights.shape == (T, k) and topk_weights.is_contiguous()
    for w, shape in ((gate, (E, I, H)), (up, (E, I, H)), (down, (E, H, I))):
        assert w.packed.dtype == torch.int32 and w.packed.shape == (*shape[:2], shape[2] // 8)
        assert w.scale.dtype == torch.bfloat16 and w.scale.shape == (*shape[:2], shape[2] // 32)
        assert w.packed.is_contiguous() and w.scale.is_contiguous()
    assert H % CHUNK == 0 and I % CHUNK == 0 and H % 16 == 0 and I % 16 == 0, (H, I)
    out = torch.empty_like(x)
    if T * k == 0:
        return out.zero_()
    ker = get_kernels(cuda_source(CODE), NAMES)
    dev, P = x.device, T * k
    offsets = torch.empty(E + 1, dtype=torch.int32, device=dev)
    order = torch.empty(P, dtype=torch.int32, device=dev)
    active = torch.empty(E + 1, dtype=torch.int32, device=dev)  # [E] list, [E] = count
    act = torch.empty(P, I, dtype=torch.bfloat16, device=dev)  # rows in expert-sorted order
    y = torch.empty(P, H, dtype=torch.float32, device=dev)  # rows by pair index t*k + s
    first = np.int64(experts.first)
    launch(ker["moe_route"], 1, 1024, topk_ids, P, first, E, offsets, order, active, active[E:], smem=8 * E)
    nt = 1 if T <= 8 else 2  # token tiles of 8 per weight pass: a pass streams the expert's weights once
    blocks_y = min(E, P)
    for mode, (w0, w1, kdim, n, b, dst) in enumerate(((gate, up, H, I, x, act), (down, down, I, H, act, y))):
        most = (GATE_UP_WARPS or (8 if P <= 8 else 4)) if mode == 0 else 4
        nw, mt = _warps(kdim, most), 2 - mode
        launch(ker[f"moe_gemm<{mode}, {nt}>"], (n // 16, blocks_y), (32, nw),
               w0.packed, w0.scale, w1.packed, w1.scale, b, kdim, n, k, offsets, order, active, active[E:], dst,
               smem=nw * STAGES * _stage_bytes(mt))
    launch(ker["moe_combine"], (T, -(-H // 1024)), 128, y, topk_ids, topk_weights, first, E, k, H, out)
    return out


def moe_w4a16_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts) -> torch.Tensor:
    """fp32 torch reference: per local expert with tokens, exact fp32 dequantization, SwiGLU, weighted sum."""
    def dequant(w, e: int) -> torch.Tensor:  # -> fp32 [out, in]
        shifts = torch.arange(0, 32, 4, device=w.packed.device, dtype=torch.int32)
        q = ((w.packed[e].unsqueeze(-1) >> shifts) & 0xF).flatten(-2).float() - 8  # [out, in]
        return q * w.scale[e].float().repeat_interleave(32, dim=-1)

    local = topk_ids - experts.first  # [T, k]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    for e in range(experts.gate_proj.packed.shape[0]):
        tok, slot = torch.where(local == e)  # [n], [n]
        if tok.numel() == 0:
            continue
        h = x[tok].float()  # [n, H]
        act = torch.nn.functional.silu(h @ dequant(experts.gate_proj, e).T) * (h @ dequant(experts.up_proj, e).T)
        y = act @ dequant(experts.down_proj, e).T  # [n, H]
        out.index_add_(0, tok, y * topk_weights[tok, slot, None])
    return out.to(x.dtype)
