"""Dense SwiGLU MLP and the DeepSeek-V3 MoE block (reference/k26.md §3.7, §3.8), torch reference.

Expert parallelism: a rank holds a contiguous range of routed experts (`ExpertStack.first` ..
`first + count - 1`), or with `slices` S > 1 a slice of I/S intermediate rows of many experts (`ExpertShard`).
Routing is computed on every rank (the router is replicated); tokens routed to experts (slices) another rank
holds contribute 0 here, so the ranks' routed outputs sum to the full output.
`moe_experts_ref` is the signature the fused INT4 MoE kernel implements (kernels/moe_w4a16.py), and
`moe_experts_dense` the sync-free torch path for shapes the kernel does not cover (see `moe_forward`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from verifier_service.expert_shard import local_pairs
from verifier_service.int4 import Int4Weight, linear, tileable
from verifier_service.linear import fuse_rows, on_kernel, project
from verifier_service.model_config import K2Config

ExpertMatrix = Int4Weight | torch.Tensor  # INT4 stack, or a dense [E_local, out, in] tensor
# Rows up to which the routed experts run beside a replicated shared expert on a side stream (beside a split one
# always: `_kernel_with_shared`). H200, 61-layer K2.6 verify step, graph ms, side stream / one stream. Session 15:
# 1 row 5.88-5.90 / 6.03-6.05, but 2 rows 6.55 / 6.38-6.44 and 16 rows 8.62 / 8.33-8.46. Session 18, with the
# router, moe_route, norms and SwiGLU launched by PDL, both streams' chains overlap better: 1 row 5.28-5.33 /
# 5.38-5.39; 2 rows 5.70-5.71 / 5.75-5.86; 8 rows 6.30-6.32 / 6.50-6.59; 16 rows 7.45-7.49 / 7.54-7.55. 32 rows
# were too noisy to say (9.13, 9.70 / 9.24, 9.30).
SIDE_STREAM_MAX_ROWS = 16
# Rows from which the split layout's router and routed experts stay on the main stream, right after the norm that
# feeds them, and the shared MLP takes a side stream of default priority (`_kernel_with_shared`). On the main stream
# the router launches by PDL while the norm runs, so its weights are in flight when the norm ends; on a side stream
# it starts only after the norm's grid has completed (a plain graph edge). Below it the routed chain keeps the
# high-priority side stream. H200, 16 full-dimension layers, rank 0 of 7, graph ms, median of 4 alternated rounds
# (model / uniform routing), routed chain on the side -> on the main stream: 1 row 1.327 -> 1.328 / 1.282 -> 1.295;
# 2 rows 1.482 -> 1.492 / 1.534 -> 1.537; 16 rows 1.975 -> 1.945 / 3.360 -> 3.297. Two rounds: 4 rows -0.9 / -1.4 %,
# 8 rows -2.0 / -0.8 %, 32 rows -1.9 / -1.6 %, 64 rows +0.1 / -0.1 %. With the shared MLP on the high-priority
# stream instead, 1-2 and 32-64 rows lost 1-3 % more. 61 layers, from 4 rows on the main stream: 4 rows -2.0 / -1.7 %,
# 16 rows -2.2 / -2.3 %, 64 rows +0.1 / 0 % (docs/BENCHMARKS.md, "Session 34").
ROUTED_ON_MAIN_MIN_ROWS = 4


@dataclass(frozen=True)
class MLPWeights:
    """SwiGLU MLP: the dense layers' `mlp.*` and the MoE layers' `mlp.shared_experts.*`. Gate and up read the
    same x: they are the row blocks of one tensor `gate_up_proj` [2I, H] and run as one GEMM; `gate_proj` and
    `up_proj` are views of it."""

    gate_proj: torch.Tensor  # [I, H]
    up_proj: torch.Tensor  # [I, H]
    down_proj: torch.Tensor  # [H, I]
    gate_up_proj: torch.Tensor = field(init=False, repr=False)  # [gate_proj ; up_proj]

    def __post_init__(self) -> None:
        fuse_rows(self, "gate_up_proj", "gate_proj", "up_proj")


@dataclass(frozen=True)
class ExpertStack:
    """This rank's routed experts, stacked along dim 0: global ids first .. first + count - 1, or with
    slices > 1 the slices `ExpertShard(rank, world, slices).pieces` lists (I = the slice's rows)."""

    gate_proj: ExpertMatrix  # [E_local, I, H] logical
    up_proj: ExpertMatrix  # [E_local, I, H] logical
    down_proj: ExpertMatrix  # [E_local, H, I] logical
    first: int  # global id of local expert 0 (slices = 1)
    slices: int = 1
    rank: int = 0
    world: int = 1

    @property
    def count(self) -> int:
        w = self.gate_proj
        return (w.packed if isinstance(w, Int4Weight) else w).shape[0]


@dataclass(frozen=True)
class MoEWeights:
    gate: torch.Tensor  # [n_routed_experts, H] router, bf16 as stored or fp32; logits are computed in fp32
    e_score_correction_bias: torch.Tensor  # fp32 [n_routed_experts], used for selection only
    experts: ExpertStack
    shared_experts: MLPWeights | None  # [I·n_shared, H] etc.; None when n_shared_experts == 0


def mlp(x: torch.Tensor, w: MLPWeights, kernel: bool = False, add: torch.Tensor | None = None) -> torch.Tensor:
    """down(silu(gate x) ⊙ up x) (+ add): [T, H] -> [T, H]. kernel (CUDA): few-row projections by
    kernels/skinny_linear, the activation by kernels/silu_mul, `add` summed in the down projection (`project`)."""
    return project(swiglu(x, w, kernel), w.down_proj, kernel, add)


def swiglu(x: torch.Tensor, w: MLPWeights, kernel: bool = False) -> torch.Tensor:
    """silu(gate x) ⊙ up x: [T, H] -> [T, I], the MLP before its down projection."""
    gate_up = project(x, w.gate_up_proj, kernel)  # [T, 2I]
    if kernel and gate_up.is_cuda:
        from kernels.silu_mul import fits, silu_mul

        if fits(gate_up):
            return silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
    return F.silu(gate) * up


def route(x: torch.Tensor, w: MoEWeights, cfg: K2Config, use_kernel: bool = False,
          live_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (topk_ids int64 [T, k] global expert ids, topk_weights fp32 [T, k]).

    sigmoid scores in fp32; bias added for choosing only; group-limited top-k (group score = sum of
    the group's top-2 biased scores); weights = unbiased scores renormalized × routed_scaling_factor.
    use_kernel: kernels/moe_gate (two launches instead of ~12) where it applies: a GPU, one group (Kimi).
    live_rows: int64 [1] on x's device, or None: rows from live_rows[0] on are a CUDA graph's pad rows and
    route to no expert (ids -1, weights 0; kernels/moe_gate's module doc).
    """
    from kernels import moe_gate

    if use_kernel and cfg.n_group <= 1 and moe_gate.fits(x, w.gate, cfg.num_experts_per_tok):
        return moe_gate.moe_gate(x.contiguous(), w.gate, w.e_score_correction_bias, cfg.num_experts_per_tok,
                                 cfg.routed_scaling_factor, cfg.norm_topk_prob, live_rows)
    scores = F.linear(x.float(), w.gate.float()).sigmoid()  # [T, E] (the checkpoint's router weight is bf16)
    choice = scores + w.e_score_correction_bias  # [T, E]
    if cfg.n_group > 1:
        grouped = choice.view(x.shape[0], cfg.n_group, -1)  # [T, G, E/G]
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
        kept = group_scores.topk(cfg.topk_group, dim=-1).indices  # [T, topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)  # [T, G]
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(1)  # [T, E]
    topk_ids = choice.topk(cfg.num_experts_per_tok, dim=-1).indices  # [T, k]
    weights = scores.gather(1, topk_ids)  # [T, k]
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return moe_gate.skip_pad_rows(topk_ids, weights * cfg.routed_scaling_factor, live_rows)


def moe_experts_ref(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: ExpertStack
) -> torch.Tensor:
    """Σ_k w_k · E_k(x) over this rank's experts: x [T, H], topk_ids/weights [T, k] -> [T, H] (x's dtype).

    Reference: per local expert with tokens (bincount), dequantize, SwiGLU, weighted scatter-add in fp32.
    """
    local, weights = local_pairs(topk_ids, topk_weights, experts)  # [T, k·S]; -1 = another rank's
    counts = torch.bincount(local[local >= 0], minlength=experts.count).tolist()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok, slot = torch.where(local == e)  # [n] token rows, [n] which of its k·S pairs
        h = x[tok]  # [n, H]
        act = F.silu(linear(h, _one(experts.gate_proj, e))) * linear(h, _one(experts.up_proj, e))
        y = linear(act, _one(experts.down_proj, e))  # [n, H]
        out.index_add_(0, tok, y.float() * weights[tok, slot, None])
    return out.to(x.dtype)


def _one(w: ExpertMatrix, e: int) -> ExpertMatrix:
    return w.select(e) if isinstance(w, Int4Weight) else w[e]


# Sync-free path: every local expert runs on every token, so a call costs E_local/k times the routed
# FLOPs and holds [E_local, T, max(H, I)] activations. Allowed up to this many (token, local expert)
# pairs: 64 local experts x 256 rows (graphs.BUCKETS[-1]); bigger calls (long prefill chunks, many
# experts) take the reference loop instead.
DENSE_MAX_PAIRS = 64 * 256


def dense_fits(rows: int, experts: ExpertStack) -> bool:
    """Whether `moe_experts_dense` may run `rows` tokens over `experts` (see DENSE_MAX_PAIRS)."""
    return experts.count * rows <= DENSE_MAX_PAIRS


def dense_stack(experts: ExpertStack, dtype: torch.dtype, down_by_row: bool = False) -> ExpertStack:
    """The same experts as dense [E_local, out, in] tensors in `dtype` (dequantized once: E_local·3·H·I
    values, 4x the INT4 bytes at bf16), exactly what the reference dequantizes per call.
    down_by_row: down's [E, H, I] is a view of [H, E, I] storage, so that the projected path
    (`_experts_projected`) reads it as [H, E·I] without a copy per call."""
    def dense(w: ExpertMatrix) -> torch.Tensor:
        return w.dequantize(dtype) if isinstance(w, Int4Weight) else w.to(dtype)

    down = dense(experts.down_proj)
    if down_by_row:
        down = down.permute(1, 0, 2).contiguous().permute(1, 0, 2)
    return replace(experts, gate_proj=dense(experts.gate_proj), up_proj=dense(experts.up_proj), down_proj=down)


def moe_experts_dense(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: ExpertStack, kernel: bool = False
) -> torch.Tensor:
    """moe_experts_ref's contract without host syncs or data-dependent shapes: x [T, H] -> [T, H].

    Every local expert on every token (SwiGLU in x's dtype, like the reference), combined in fp32 with
    the router weights of the pairs routed to this rank; pairs of other ranks' experts weigh 0.
    `experts` should be a `dense_stack`: an INT4 stack is dequantized on every call, which also copies
    int4's shift table to the device (not capturable in a CUDA graph).
    kernel: where kernels/skinny_linear takes the rows (fp32, few rows), the experts run as three projections
    of all experts at once, the router weights folded into the activations before the down projection.
    """
    E = experts.count
    local, weights = local_pairs(topk_ids, topk_weights, experts)  # [T, k·S]; -1 matches no local expert
    hit = local[..., None] == torch.arange(E, device=x.device)  # [T, k·S, E]
    combine = (hit * weights[..., None]).sum(1)  # fp32 [T, E]; a token's pairs are distinct local experts
    d = dense_stack(experts, x.dtype)
    gate, up, down = d.gate_proj, d.up_proj, d.down_proj  # [E, I, H], [E, I, H], [E, H, I]
    if x.dtype == torch.float32 and on_kernel(x, gate.reshape(-1, gate.shape[-1]), kernel):  # fp32 (combine) act
        return _experts_projected(x, combine, gate, up, down)
    act = F.silu(torch.matmul(x, gate.transpose(1, 2))) * torch.matmul(x, up.transpose(1, 2))  # [E, T, I]
    y = torch.matmul(act, down.transpose(1, 2))  # [E, T, H]
    return torch.einsum("eth,te->th", y.float(), combine).to(x.dtype)


def _experts_projected(x, combine, gate, up, down) -> torch.Tensor:
    """moe_experts_dense as projections (kernels/skinny_linear): [T, E·I] gate and up of every expert in one
    launch each, then y = (combine ⊙ act) [T, E·I] @ down as [H, E·I] (a view of a `dense_stack(...,
    down_by_row=True)`, else a copy per call: 4.7 MB for the tiny target). cuBLAS's batched fp32 GEMMs at
    17 rows cost ~7.5 us each, 15 of them per tiny-target verify."""
    T, (E, I, H) = x.shape[0], gate.shape
    act = F.silu(project(x, gate.reshape(E * I, H), True)) * project(x, up.reshape(E * I, H), True)  # [T, E·I]
    act = (act.view(T, E, I) * combine[:, :, None]).view(T, E * I)
    return project(act, down.permute(1, 0, 2).reshape(H, E * I), True)


def moe_forward(
    x: torch.Tensor,
    w: MoEWeights,
    cfg: K2Config,
    all_reduce: Callable[[torch.Tensor], torch.Tensor],
    on_experts: Callable[[torch.Tensor], None] | None = None,
    use_kernel: bool = False,
    dense: ExpertStack | None = None,
    live_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H] -> routed (summed over ranks) + shared expert, unweighted. live_rows: see `route`.

    Routed experts: the INT4 kernel (`use_kernel` and `kernel_fits`) > the sync-free every-expert path
    (`dense` = this layer's `dense_stack`, given by the model when that path is on, and `dense_fits`) >
    the reference loop (one host sync per call: bincount().tolist()).
    On a GPU with the INT4 kernel, the router and routed experts run on a side stream beside the shared
    expert: for a shared expert split over the ranks (the served layout) at every row count, its output summed
    by the kernel's combine (`_kernel_with_shared`); for a replicated one up to SIDE_STREAM_MAX_ROWS rows, and it
    is added after the reduce by its down projection (on one rank that projection adds into the routed sum)."""
    shared = w.shared_experts
    if shared is None:
        return all_reduce(routed_experts(x, w, cfg, on_experts, use_kernel, dense, live_rows))
    split = shared.gate_proj.shape[0] < cfg.moe_intermediate_size * cfg.n_shared_experts
    if use_kernel and split and kernel_fits(x, w.experts):
        return all_reduce(_kernel_with_shared(x, w, cfg, on_experts, live_rows))
    if use_kernel and x.shape[0] <= SIDE_STREAM_MAX_ROWS and kernel_fits(x, w.experts):
        main, side = torch.cuda.current_stream(x.device), _side_stream(x.device)
        side.wait_stream(main)
        act = swiglu(x, shared, use_kernel)  # [T, I_shared], beside the router and routed experts
        with torch.cuda.stream(side):
            routed = routed_experts(x, w, cfg, on_experts, use_kernel, dense, live_rows)
        main.wait_stream(side)
    else:
        act, routed = swiglu(x, shared, use_kernel), routed_experts(x, w, cfg, on_experts, use_kernel, dense, live_rows)
    if split:
        return all_reduce(project(act, shared.down_proj, use_kernel, routed))  # split shared expert: partial
    # Replicated shared expert: added after the reduce so it is counted once.
    return project(act, shared.down_proj, use_kernel, all_reduce(routed))


def _kernel_with_shared(x: torch.Tensor, w: MoEWeights, cfg: K2Config,
                        on_experts: Callable[[torch.Tensor], None] | None,
                        live_rows: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's routed experts (INT4 kernel) + its part of the split shared expert: x [T, H] -> [T, H].
    The router and the routed experts run beside the whole shared MLP on two streams, and the kernel's combine
    starts each token's sum from the shared output: only its down launch waits for the shared MLP, and no launch
    follows the routed experts. H200, 61-layer step, rank 0 of 7, graph ms, against the shared down projection
    adding into the routed sum after the join (side stream up to 16 rows): model routing 1 / 16 / 32 / 64 rows
    4.918 / 7.217 / 9.090 / 13.160 -> 4.796 / 6.944 / 8.716 / 12.338; uniform routing 1 / 16 / 64 rows
    4.849 / 13.026 / 26.844 -> 4.734 / 12.856 / 26.049. On one stream from 32 rows it lost 1-2 %.
    Which chain takes the side stream: see ROUTED_ON_MAIN_MIN_ROWS."""
    main = torch.cuda.current_stream(x.device)
    on_main = x.shape[0] >= ROUTED_ON_MAIN_MIN_ROWS
    side = _shared_stream(x.device) if on_main else _side_stream(x.device)
    shared_on, routed_on = (side, main) if on_main else (main, side)
    side.wait_stream(main)
    with torch.cuda.stream(shared_on):
        shared = mlp(x, w.shared_experts, True)  # [T, H], beside the router and the routed experts
        ready = torch.cuda.Event()
        ready.record(shared_on)
    with torch.cuda.stream(routed_on):
        out = routed_experts(x, w, cfg, on_experts, True, None, live_rows, add=shared, add_ready=ready)
    main.wait_stream(side)
    return out


def routed_experts(x: torch.Tensor, w: MoEWeights, cfg: K2Config, on_experts: Callable[[torch.Tensor], None] | None,
                   use_kernel: bool, dense: ExpertStack | None, live_rows: torch.Tensor | None = None,
                   add: torch.Tensor | None = None, add_ready: torch.cuda.Event | None = None) -> torch.Tensor:
    """Router and this rank's routed experts: x [T, H] -> Σ_k w·expert(x) over local experts [T, H] (see
    `moe_forward` for the paths). add, add_ready: the INT4 kernel's (kernels/moe_w4a16); only that path
    takes them. live_rows (see `route`) is dropped on the every-expert path, which computes every expert for
    every row whatever the ids: there skipping pad rows saves nothing and its mask would add launches."""
    int4 = use_kernel and kernel_fits(x, w.experts)
    every_expert = not int4 and dense is not None and dense_fits(x.shape[0], dense)
    topk_ids, topk_weights = route(x, w, cfg, use_kernel, None if every_expert else live_rows)
    if on_experts is not None:
        on_experts(topk_ids)
    if int4:
        from kernels.moe_w4a16 import moe_w4a16

        return moe_w4a16(x, topk_ids, topk_weights, w.experts, add, add_ready)
    assert add is None, "only the INT4 kernel sums `add`"
    if every_expert:
        return moe_experts_dense(x, topk_ids, topk_weights, dense, use_kernel)
    return moe_experts_ref(x, topk_ids, topk_weights, w.experts)


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for the routed experts (below ROUTED_ON_MAIN_MIN_ROWS in the split layout; captured
    into the same CUDA graphs: it forks from and joins the capturing stream within each MoE layer). High priority:
    the router → experts chain is the layer's critical path, and the shared MLP beside it has slack, so the side's
    blocks are scheduled first (H200, 61-layer step, two A/B runs: 1 row 4.786 / 4.785 -> 4.728 / 4.707 ms with model
    routing, 4.694 / 4.704 -> 4.664 / 4.660 uniform; 16-64 rows within ±0.8 %)."""
    return torch.cuda.Stream(device, priority=-1)


@functools.cache
def _shared_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for the split shared MLP when the routed chain keeps the main stream (default
    priority: the shared MLP has slack, the routed chain does not)."""
    return torch.cuda.Stream(device)


def kernel_fits(x: torch.Tensor, experts: ExpertStack) -> bool:
    """kernels/moe_w4a16 takes bf16 CUDA activations, INT4 experts, H and I multiples of 128."""
    return kernel_fits_for(x.device, x.dtype, experts)


def kernel_fits_for(device: torch.device, dtype: torch.dtype, experts: ExpertStack, tiled: bool = True) -> bool:
    """`kernel_fits` for activations of this device and dtype (decided once per model, no tensor needed).
    `tiled`: also require the tiled order the kernel reads (K2Model tiles the stacks that fit otherwise)."""
    mats = (experts.gate_proj, experts.up_proj, experts.down_proj)
    return (torch.device(device).type == "cuda" and dtype == torch.bfloat16
            and all(isinstance(m, Int4Weight) and tileable(m.shape, m.group_size) and (m.tiled or not tiled)
                    for m in mats))


def tile_experts(experts: ExpertStack) -> ExpertStack:
    """The stack with its INT4 matrices in the tiled order kernels/moe_w4a16 reads (copies of those not tiled
    yet; the loader tiles K2.6's as it reads them, so a served model makes none)."""
    def tiled(m: ExpertMatrix) -> ExpertMatrix:
        return m.tile() if isinstance(m, Int4Weight) and tileable(m.shape, m.group_size) else m

    return replace(experts, gate_proj=tiled(experts.gate_proj), up_proj=tiled(experts.up_proj),
                   down_proj=tiled(experts.down_proj))
