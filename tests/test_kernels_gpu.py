"""GPU: every kernel against its torch reference on adversarial sizes (odd token counts, shuffled
page tables, NaN in unwritten cache slots, experts of other ranks, one expert taking every token)."""

from __future__ import annotations

import pytest
import torch

from kernels.bench import mla_case, random_experts
from kernels.ddtree_build import (ddtree_build, ddtree_build_ref, ddtree_topk, ddtree_topk_ref, ddtree_tree,
                                  ddtree_tree_ref)
from kernels.kv_commit import kv_commit, kv_commit_ref
from kernels import mla_tree_attention as mla_mod
from kernels.mla_tree_attention import mla_tree_attention, mla_tree_attention_ref
from kernels.moe_w4a16 import moe_w4a16, moe_w4a16_ref
from kernels.rms_norm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_pair, rms_norm_pair_ref, rms_norm_ref
from kernels.silu_mul import silu_mul, silu_mul_ref
from kernels.tree_accept import tree_accept, tree_accept_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def _sync_every_launch(monkeypatch):
    monkeypatch.setenv("DDTREE_KERNEL_SYNC", "1")  # a device fault fails the launching test


def poison_allocator() -> None:
    """Leave NaN in torch's cached blocks so a kernel output it never writes shows up."""
    junk = torch.full((64 << 20,), float("nan"), device="cuda")
    del junk


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float, cos: float) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    o, r = out.double(), ref.double()
    assert torch.isfinite(o).all(), f"non-finite output at {torch.nonzero(~torch.isfinite(o))[:5].tolist()}"
    err = (o - r).norm() / r.norm()
    similarity = torch.nn.functional.cosine_similarity(o.flatten(), r.flatten(), dim=0)
    worst = (o - r).abs().argmax()
    idx = torch.unravel_index(worst, o.shape)
    assert err < rel and similarity > cos, (
        f"rel {err:.2e} cos {similarity:.8f}; worst at {[int(i) for i in idx]}: {o[idx]:.5f} vs {r[idx]:.5f}")


@pytest.mark.parametrize("down_mt", [1, 2])  # 16-row pieces per down warp (moe_w4a16.DOWN_MT, T > 1)
@pytest.mark.parametrize("T", [1, 3, 17, 63, 300])
@pytest.mark.parametrize("H,I", [(512, 256), (384, 128), (7168, 2048)])  # 384/128: 3 and 1 K chunks
def test_moe_w4a16(T, H, I, down_mt, monkeypatch):
    import kernels.moe_w4a16 as moe

    monkeypatch.setattr(moe, "DOWN_MT", down_mt)
    E, first, k = 12, 5, 8
    experts = random_experts(E, H, I, first=first, seed=T)
    g = torch.Generator("cuda").manual_seed(T)
    ids = torch.stack([torch.randperm(24, generator=g, device="cuda")[:k] for _ in range(T)])  # some not ours
    w = torch.rand(T, k, generator=g, device="cuda")
    x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
    poison_allocator()
    out = moe_w4a16(x, ids, w, experts)
    # bf16 act and output against an fp32 reference: ~3e-3 relative; cosine catches a wrong group/nibble.
    assert_close(out, moe_w4a16_ref(x, ids, w, experts), rel=1e-2, cos=0.9999)


# (FEW_DOWN, DOWN_MT_T1): moe_few_down, or moe_gemm's down with 0 (the kernel picks from the active count), 1, 2 pieces
@pytest.mark.parametrize("few_down,down_mt", [(True, 0), (False, 0), (False, 1), (False, 2)])
@pytest.mark.parametrize("n_local", [0, 1, 2, 8])
@pytest.mark.parametrize("H,I", [(512, 256), (7168, 2048)])
def test_moe_w4a16_decode(n_local, H, I, few_down, down_mt, monkeypatch):
    """T = 1 with 0, 1, 2 and 8 of its experts on this rank: moe_few_down; moe_gemm's down with one and two pieces
    (chosen on the device when DOWN_MT_T1 = 0); the no-local-expert zeros."""
    import kernels.moe_w4a16 as moe

    monkeypatch.setattr(moe, "FEW_DOWN", few_down)
    monkeypatch.setattr(moe, "DOWN_MT_T1", down_mt)
    E, first = 12, 5
    experts = random_experts(E, H, I, first=first, seed=n_local)
    g = torch.Generator("cuda").manual_seed(n_local)
    local = torch.randperm(E, generator=g, device="cuda")[:n_local] + first
    ids = torch.cat([local, torch.arange(100, 108 - n_local, device="cuda")])[torch.randperm(8, device="cuda")]
    ids, w = ids[None].contiguous(), torch.rand(1, 8, generator=g, device="cuda")
    x = torch.randn(1, H, generator=g, device="cuda").bfloat16()
    poison_allocator()
    out = moe_w4a16(x, ids, w, experts)
    if n_local == 0:
        assert torch.equal(out, torch.zeros_like(out))
    else:
        assert_close(out, moe_w4a16_ref(x, ids, w, experts), rel=1e-2, cos=0.9999)


@pytest.mark.parametrize("cpw,warps", [(2, 8), (4, 4), (2, 1)])  # FEW_DOWN_CPW, FEW_DOWN_WARPS
# T·k up to 256 local pairs (its tables); (33, 8) and (24, 12) are past them: moe_gemm's down serves those
@pytest.mark.parametrize("T,k", [(1, 8), (1, 1), (1, 32), (2, 8), (3, 8), (9, 8), (16, 8), (32, 8), (33, 8), (24, 12)])
@pytest.mark.parametrize("H,I", [(384, 128), (7168, 2048)])  # one input chunk of down; K2.6
def test_moe_w4a16_few_down(T, k, H, I, cpw, warps, monkeypatch):
    """moe_few_down (few tokens, whole experts) against the fp32 reference, with `add`. Routing: about half of each
    token's experts on this rank; one expert takes every token (several work items of 8 rows, an odd last one); token
    0 holds that expert in two slots (two rows of one token in one item); the last token (T >= 3) has no local expert
    (its output is `add`). The down units in one or several batches a warp."""
    import kernels.moe_w4a16 as moe

    monkeypatch.setattr(moe, "FEW_DOWN", True)
    monkeypatch.setattr(moe, "FEW_DOWN_T", 32)  # the kernel's whole range, not only the default's
    monkeypatch.setattr(moe, "FEW_DOWN_CPW", cpw)
    monkeypatch.setattr(moe, "FEW_DOWN_WARPS", warps)
    E, first, hot = 40, 3, 10
    experts = random_experts(E, H, I, first=first, seed=T * 100 + k)
    g = torch.Generator("cuda").manual_seed(T * 100 + k)
    ids = torch.stack([torch.randperm(2 * E, generator=g, device="cuda")[:k] for _ in range(T)])  # local: 3..42
    ids[:, 0] = hot
    if k >= 2:
        ids[0, 1] = hot
    if T >= 3:
        ids[T - 1] = torch.arange(100, 100 + k, device="cuda")
    w = torch.rand(T, k, generator=g, device="cuda")
    x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
    add = torch.randn(T, H, generator=g, device="cuda").bfloat16()
    poison_allocator()
    assert_close(moe_w4a16(x, ids, w, experts, add=add), moe_w4a16_ref(x, ids, w, experts, add=add), rel=1e-2,
                 cos=0.9999)


@pytest.mark.parametrize("split", [2, 3, 4, 8])
@pytest.mark.parametrize("T,H,I", [(1, 7168, 2048), (5, 7168, 2048), (3, 512, 256), (17, 384, 128)])
def test_moe_w4a16_split_k(T, H, I, split, monkeypatch):
    """Gate/up K split over blocks (fp32 partials, last block of a tile finishes): forced split counts,
    ragged chunk shares (56 chunks over 16/24/32/64 warps; 3 or 4 chunks leave whole blocks empty),
    and T = 17 (two token tiles, separate partial rows per token tile)."""
    import kernels.moe_w4a16 as moe

    monkeypatch.setattr(moe, "SPLIT", split)
    experts = random_experts(6, H, I, first=2, seed=split)
    g = torch.Generator("cuda").manual_seed(10 + T)
    ids = torch.stack([torch.randperm(16, generator=g, device="cuda")[:8] for _ in range(T)])
    w = torch.rand(T, 8, generator=g, device="cuda")
    x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
    poison_allocator()
    out = moe_w4a16(x, ids, w, experts)
    assert_close(out, moe_w4a16_ref(x, ids, w, experts), rel=1e-2, cos=0.9999)


@pytest.mark.parametrize("few_down", [False, True])  # moe_w4a16.FEW_DOWN: the down kernel up to FEW_DOWN_T tokens
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("graph", [False, True])
def test_moe_w4a16_back_to_back(graph, pdl, few_down, monkeypatch):
    """Calls queued without a host sync in between (the gate/up and down kernels overlap their
    predecessors through programmatic dependent launch; the sync-every-launch fixture would hide a
    missing wait), eagerly and replayed from a CUDA graph: every result still matches. K2.6 shapes,
    some experts outside the local range, T from 1 to 40 (one and two token tiles)."""
    import kernels.moe_w4a16 as moe

    monkeypatch.setattr(moe, "PDL", pdl)
    monkeypatch.setattr(moe, "FEW_DOWN", few_down)
    monkeypatch.setattr(moe, "FEW_DOWN_T", 32)  # T = 1..16 through it, 40 through moe_gemm
    monkeypatch.delenv("DDTREE_KERNEL_SYNC", raising=False)
    experts = random_experts(16, 7168, 2048, first=3, seed=7)
    g = torch.Generator("cuda").manual_seed(7)
    cases = []
    for T in (1, 4, 9, 16, 40, 2):
        ids = torch.stack([torch.randperm(24, generator=g, device="cuda")[:8] for _ in range(T)])
        cases.append((torch.randn(T, 7168, generator=g, device="cuda").bfloat16(), ids,
                      torch.rand(T, 8, generator=g, device="cuda")))
    outs = [moe_w4a16(*c, experts) for c in cases]
    if graph:
        cg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cg):
            outs = [moe_w4a16(*c, experts) for c in cases]
        for x, ids, w in cases:  # new inputs in place, then replay
            x.copy_(torch.randn(x.shape, generator=g, device="cuda").bfloat16())
            ids.copy_(torch.stack([torch.randperm(24, generator=g, device="cuda")[:8] for _ in range(len(ids))]))
        cg.replay()
    torch.cuda.synchronize()
    for out, c in zip(outs, cases):
        assert_close(out, moe_w4a16_ref(*c, experts), rel=1e-2, cos=0.9999)


@pytest.mark.parametrize("E", [55, 100])
@pytest.mark.parametrize("T", [1, 7, 40])
def test_moe_w4a16_many_local_experts(T, E):
    """One EP rank's 55 experts (and 100): moe_route's warp scan runs over several 32-expert steps."""
    k, first = 8, 20
    experts = random_experts(E, 512, 256, first=first, seed=E + T)
    g = torch.Generator("cuda").manual_seed(E + T)
    ids = torch.stack([torch.randperm(E + 40, generator=g, device="cuda")[:k] for _ in range(T)])  # some not ours
    w = torch.rand(T, k, generator=g, device="cuda")
    x = torch.randn(T, 512, generator=g, device="cuda").bfloat16()
    poison_allocator()
    assert_close(moe_w4a16(x, ids, w, experts), moe_w4a16_ref(x, ids, w, experts), rel=1e-2, cos=0.9999)


@pytest.mark.parametrize("S,world", [(2, 7), (4, 7), (8, 7), (4, 3)])
@pytest.mark.parametrize("T", [1, 5, 16, 32, 40, 100])
# the down GEMM: moe_down_cat, moe_gemm per item, or moe_few_down (up to 32 tokens; 40 and 100 take moe_gemm)
@pytest.mark.parametrize("down_cat", ["slices", False, "few"])
def test_moe_w4a16_expert_slices(T, S, world, down_cat, monkeypatch):
    """Experts cut into S slices dealt over the ranks (verifier_service.expert_shard.ExpertShard): the ranks' kernel outputs
    sum to the fp32 reference of the whole experts (an independent layout: whole matrices, one rank). T = 100
    takes the separate combine; S = 8 puts two slices of some experts on one rank."""
    from verifier_service.int4 import Int4Weight
    from verifier_service.expert_shard import ExpertShard, cut_experts
    from verifier_service.moe import ExpertStack
    import kernels.moe_w4a16 as moe

    monkeypatch.setattr(moe, "DOWN_CAT", down_cat != "few" and down_cat)
    monkeypatch.setattr(moe, "FEW_DOWN", down_cat == "few")
    monkeypatch.setattr(moe, "FEW_DOWN_T", 32)
    n, H, I, k = 24, 512, 1024, 8
    full = random_experts(n, H, I, seed=T + S)
    whole = ExpertStack(Int4Weight(full.gate_proj.packed, full.gate_proj.scale, (I, H), True),
                        Int4Weight(full.up_proj.packed, full.up_proj.scale, (I, H), True),
                        Int4Weight(full.down_proj.packed, full.down_proj.scale, (H, I), True), 0)
    g = torch.Generator("cuda").manual_seed(T)
    ids = torch.stack([torch.randperm(n, generator=g, device="cuda")[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g, device="cuda")
    x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
    poison_allocator()
    parts = [moe_w4a16(x, ids, w, cut_experts(whole, ExpertShard(r, world, S))).float() for r in range(world)]
    # each rank rounds its partial sum to bf16 once: ~3e-3 relative, as one rank of whole experts
    assert_close(sum(parts), moe_w4a16_ref(x, ids, w, whole).float(), rel=1e-2, cos=0.9999)


@pytest.mark.parametrize("with_add", [False, True])
# n_ids 200: mostly not ours; 9: most of a token's experts are ours, and past 8 tokens an expert's rows span
# several items and token tiles
@pytest.mark.parametrize("T,n_ids", [(1, 24), (3, 24), (8, 24), (8, 9), (5, 200), (16, 24), (17, 9), (32, 9),
                                     (29, 200)])
def test_moe_w4a16_down_cat(T, n_ids, with_add, monkeypatch):
    """moe_down_cat (DOWN_CAT True) on whole experts: the down GEMM over every local item's chunks at once per token
    tile, router weights applied per item in fp32, `add` summed, tokens with no local expert get `add` (or 0)."""
    import kernels.moe_w4a16 as moe

    monkeypatch.setattr(moe, "DOWN_CAT", True)
    monkeypatch.setattr(moe, "FEW_DOWN", False)  # moe_few_down would take T <= FEW_DOWN_T before moe_down_cat
    E, first, k = 12, 5, 8
    experts = random_experts(E, 512, 256, first=first, seed=T + n_ids)
    g = torch.Generator("cuda").manual_seed(T + n_ids)
    ids = torch.stack([torch.randperm(n_ids, generator=g, device="cuda")[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g, device="cuda")
    x = torch.randn(T, 512, generator=g, device="cuda").bfloat16()
    add = torch.randn(T, 512, generator=g, device="cuda").bfloat16() if with_add else None
    poison_allocator()
    out = moe_w4a16(x, ids, w, experts, add=add)
    ref = moe_w4a16_ref(x, ids, w, experts, add=add)
    local = ((ids >= first) & (ids < first + E)).any(1)
    if (~local).any():  # exactly add (or 0) where nothing is local
        want = add[~local] if add is not None else torch.zeros_like(out[~local])
        assert torch.equal(out[~local], want)
    if local.any():
        assert_close(out[local], ref[local], rel=1e-2, cos=0.9999)


@pytest.mark.parametrize("T", [1, 17, 63, 200])
def test_moe_w4a16_one_expert_takes_all(T):
    """n tokens on one expert: several token passes per weight tile; unowned tokens must be 0."""
    experts = random_experts(4, 512, 256, first=0, seed=1)
    ids = torch.full((T, 8), 100, device="cuda")  # other ranks' experts...
    ids[:, 3] = 2  # ...except slot 3 of every token
    ids[0] = 100  # token 0: nothing local -> exact zeros
    w = torch.rand(T, 8, device="cuda")
    x = torch.randn(T, 512, device="cuda").bfloat16()
    poison_allocator()
    out = moe_w4a16(x, ids, w, experts)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    if T > 1:
        assert_close(out[1:], moe_w4a16_ref(x, ids, w, experts)[1:], rel=1e-2, cos=0.9999)


@pytest.mark.parametrize("T", [3, 100])
def test_moe_w4a16_nothing_local(T):
    """No pair routed to this rank: every output is an exact 0 (fused and separate combine)."""
    experts = random_experts(4, 512, 256, first=0, seed=2)
    ids = torch.randint(4, 50, (T, 8), device="cuda")
    x = torch.randn(T, 512, device="cuda").bfloat16()
    poison_allocator()
    out = moe_w4a16(x, ids, torch.rand(T, 8, device="cuda"), experts)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("T,local", [(1, True), (3, True), (100, True), (3, False), (100, False)])
def test_moe_w4a16_add_from_another_stream(T, local, graph, monkeypatch):
    """`add` (the shared expert's output) starts each token's sum: fused combine (T <= 64), moe_combine (T = 100)
    and no local pair (the output is `add` exactly). It is written on another stream ~1 ms late, and the kernel
    must read it only after `add_ready`: NaN before that, eagerly and replayed from a CUDA graph."""
    monkeypatch.delenv("DDTREE_KERNEL_SYNC", raising=False)  # a sync per launch would hide a missing wait
    H, I = 7168, 2048
    experts = random_experts(12, H, I, first=5, seed=T)
    g = torch.Generator("cuda").manual_seed(T)
    span = 24 if local else 8  # ids 0..23 (some local) or 100..107 (none)
    ids = torch.stack([torch.randperm(span, generator=g, device="cuda")[:8] for _ in range(T)]) + (0 if local else 100)
    w = torch.rand(T, 8, generator=g, device="cuda")
    x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
    src = torch.randn(T, H, generator=g, device="cuda").bfloat16()
    add = torch.full_like(src, float("nan"))
    side = torch.cuda.Stream()

    def call():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000)  # cycles: ~1 ms
            add.copy_(src)
        ready = torch.cuda.Event()
        ready.record(side)
        out = moe_w4a16(x, ids, w, experts, add, ready)
        torch.cuda.current_stream().wait_stream(side)
        return out

    torch.cuda.synchronize()
    out = call()
    if graph:
        cg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cg):
            out = call()
        add.fill_(float("nan"))
        cg.replay()
    torch.cuda.synchronize()
    if local:
        assert_close(out, moe_w4a16_ref(x, ids, w, experts, src), rel=1e-2, cos=0.9999)
    else:
        assert torch.equal(out, src)


@pytest.mark.parametrize("rows,prefixes,heads,page_size", [
    ([1], [0], 10, 64),  # first token: only itself
    ([3], [5], 1, 16),
    ([17], [1000], 10, 64),
    ([1, 3, 17], [5, 300, 4097], 10, 16),
    ([63, 2], [2000, 33], 9, 64),
    ([64] * 4, [130, 64, 700, 1], 64, 64),  # many query blocks: single split, direct bf16 output
    ([16], [20000], 64, 64),  # long prefix: many splits, LSE merge
    ([1], [40000], 10, 64),  # decode, long prefix: ~130 splits over the SMs, merge
    ([16, 1], [40000, 9000], 9, 64),  # unequal sessions: the short one leaves its tail splits empty
    ([16, 3], [5000, 129], 10, 128),  # two 64-key tiles per page (TMA boxes at a page offset)
])
def test_mla_tree_attention(rows, prefixes, heads, page_size):
    args = mla_case(rows, prefixes, heads, page_size, seed=sum(rows))
    poison_allocator()
    out = mla_tree_attention(*args, 0.14467963)
    ref = mla_tree_attention_ref(*args, 0.14467963)
    # bf16 P and output, fp32 softmax: FlashMLA-style bounds.
    assert_close(out, ref, rel=1e-2, cos=0.99995)


@pytest.mark.parametrize("splits", [None, 1000])  # the launcher's count, or one per tile: 626, three rounds of loads
@pytest.mark.parametrize("merge32_max", [0, 1 << 20])  # every split merge by mla_merge, or by mla_merge32
def test_mla_tree_attention_merges(merge32_max, splits, monkeypatch):
    """Both split merges on unequal sessions (the short one leaves its tail splits without keys: -inf LSE)."""
    monkeypatch.setattr(mla_mod, "MERGE32_MAX_QUERIES", merge32_max)
    monkeypatch.setattr(mla_mod, "SPLITS", splits)
    args = mla_case([1, 2], [40000, 900], 10, 64, seed=5)
    poison_allocator()
    assert_close(mla_tree_attention(*args, 0.14467963), mla_tree_attention_ref(*args, 0.14467963),
                 rel=1e-2, cos=0.99995)


@pytest.mark.parametrize("capacity", [8192, 131072])  # page-table width in keys, as the served graphs size it
@pytest.mark.parametrize("rows,prefixes", [([16], [4096]), ([1], [0]), ([1, 16, 3], [700, 4097, 64])])
def test_mla_tree_attention_wide_page_table(rows, prefixes, capacity):
    """A page table far wider than the prefixes (max_context's pages, unused tail = a huge page id): the
    split count follows the capacity, each sequence's actual keys are spread over the splits."""
    args = mla_case(rows, prefixes, 10, 64, seed=len(rows), capacity=capacity)
    poison_allocator()
    assert_close(mla_tree_attention(*args, 0.14467963), mla_tree_attention_ref(*args, 0.14467963),
                 rel=1e-2, cos=0.99995)


@pytest.mark.parametrize("rows,prefixes", [([16, 3], [40000, 0]), ([1, 1], [65536, 0]), ([8, 8, 0], [20000, 3000, 0]),
                                           ([64, 0], [9000, 0])])
def test_mla_tree_attention_pad_last(rows, prefixes):
    """A CUDA graph's padded plan: the last sequence holds the pad rows (or none) over prefix 0, and pad_last lets the
    split count assume only the live sequences fill the splits past the first. The result must be the same."""
    args = mla_case(rows, prefixes, 10, 64, seed=len(rows), capacity=131072)
    poison_allocator()
    assert_close(mla_tree_attention(*args, 0.14467963, pad_last=True), mla_tree_attention_ref(*args, 0.14467963),
                 rel=1e-2, cos=0.99995)


@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("page_size", [16, 64, 128])  # 128: two TMA tiles a page, one at a page offset
@pytest.mark.parametrize("config", mla_mod.CONFIGS)
def test_mla_tree_attention_configs(config, page_size, tma, monkeypatch):
    """Every compiled (query tile, key stages) instance, whatever the launcher would pick here;
    (16, 1) is the sm_120 path. At page size 64 the wgmma kernel (sm_90) and mla_attn with up to 32 query rows
    (sm_90+) load whole-prefix tiles by TMA, the tiles holding the prefix's end and the tree rows by cp.async."""
    monkeypatch.setattr(mla_mod, "CONFIG", config)
    monkeypatch.setattr(mla_mod, "TMA", tma)
    args = mla_case([5, 17, 2], [3000, 700, 0], 10, page_size, seed=11)
    poison_allocator()
    out = mla_tree_attention(*args, 0.14467963)
    assert_close(out, mla_tree_attention_ref(*args, 0.14467963), rel=1e-2, cos=0.99995)


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("graph", [False, True])
def test_mla_tree_attention_back_to_back(graph, pdl, monkeypatch):
    """Split calls queued without a host sync (the merge becomes resident while mla_attn runs through
    programmatic dependent launch and must wait before reading its partials; the sync-every-launch
    fixture would hide a missing wait), eagerly and replayed from a CUDA graph."""
    monkeypatch.setattr(mla_mod, "PDL", pdl)
    monkeypatch.delenv("DDTREE_KERNEL_SYNC", raising=False)
    cases = [mla_case(r, p, 10, 64, seed=i) for i, (r, p) in
             enumerate([([1], [40000]), ([16], [20000]), ([3, 1], [9000, 30000]), ([1], [5000])])]
    outs = [mla_tree_attention(*c, 0.14467963) for c in cases]
    if graph:
        cg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cg):
            outs = [mla_tree_attention(*c, 0.14467963) for c in cases]
        for c in cases:  # new queries in place, then replay
            c[0].copy_(torch.randn_like(c[0], dtype=torch.float32).bfloat16())
        cg.replay()
    torch.cuda.synchronize()
    for out, c in zip(outs, cases):
        assert_close(out, mla_tree_attention_ref(*c, 0.14467963), rel=1e-2, cos=0.99995)


@pytest.mark.parametrize("S,N", [(1, 1), (3, 17), (5, 63), (2, 300)])
def test_tree_accept(S, N):
    g = torch.Generator().manual_seed(N)
    parents = torch.stack([torch.tensor([int(torch.randint(0, i, (1,), generator=g)) for i in range(1, N + 1)])
                           for _ in range(S)])
    parents[:, N - N // 4:] = -1  # padding nodes: never children
    tokens = torch.randint(0, 3, (S, N), generator=g)  # few distinct tokens: duplicate children, long walks
    target = torch.randint(0, 3, (S, N + 1), generator=g)
    out = tree_accept(tokens.cuda(), parents.cuda(), target.cuda())
    for got, want in zip(out, tree_accept_ref(tokens, parents, target)):
        assert torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("n", [1, 3, 17, 63])
def test_kv_commit(n):
    kv = torch.randn(5, 40, 16, 576, device="cuda").bfloat16()
    perm = torch.randperm(40 * 16, device="cuda")
    src, dst = perm[:n].contiguous(), perm[n: 2 * n].contiguous()
    want = kv.clone()
    kv_commit_ref(want, src, dst)
    kv_commit(kv, src, dst)
    assert torch.equal(kv, want)  # data movement: bit-exact


def ddtree_logits(kind: str, S: int, L: int, V: int, dtype, seed: int) -> torch.Tensor:
    """randn: continuous; ties: thousands of exact ties at the top of row (0, 0); ints: every logit in
    {0, 1, 2, 3} (massive ties in every row, also across rows); same: one such row repeated for all;
    zeros: -0.0 and +0.0 (equal for torch) with a few negatives."""
    g = torch.Generator("cuda").manual_seed(seed)
    if kind == "zeros":
        x = torch.zeros(S, L, V, device="cuda")
        x[..., ::2] = -0.0
        x[..., 3::5] = -torch.rand(S, L, len(range(3, V, 5)), generator=g, device="cuda")
    elif kind in ("ints", "same"):
        x = torch.randint(0, 4, (1, 1, V) if kind == "same" else (S, L, V), generator=g, device="cuda").float()
        x = x.expand(S, L, V).contiguous()
    else:
        x = torch.randn(S, L, V, generator=g, device="cuda") * 4
        if kind == "ties":
            x[0, 0, ::7] = x[0, 0].max()
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S,L,V,k,kind", [
    (1, 1, 1, 1, "randn"), (1, 7, 163840, 8, "randn"), (3, 15, 163840, 64, "ties"), (2, 3, 1000, 17, "ties"),
    (8, 7, 163840, 16, "randn"), (8, 7, 163840, 64, "randn"), (2, 7, 163840, 64, "ints"), (1, 2, 70001, 64, "ints"),
    (2, 2, 5000, 64, "zeros"), (1, 3, 8193, 64, "same"), (2, 2, 300, 64, "ints")])
def test_ddtree_topk(S, L, V, k, kind, dtype):
    logits = ddtree_logits(kind, S, L, V, dtype, seed=V + k)
    ids, lps = ddtree_topk(logits, k)
    # -0.0 == +0.0: a tie, lower id first, as the CPU's comparison sort has it (CUDA's radix sort may not)
    want_ids, want_lps = ddtree_topk_ref(logits.cpu() if kind == "zeros" else logits, k)
    assert torch.equal(ids.cpu(), want_ids.cpu())
    assert torch.allclose(lps.cpu(), want_lps.cpu(), atol=1e-5, rtol=1e-5)  # fp32 log-sum-exp, other order


@pytest.mark.parametrize("S,L,k,budget", [(1, 1, 1, 1), (2, 7, 4, 16), (3, 15, 8, 64), (1, 2, 3, 50), (4, 16, 64, 1024),
                                          (8, 7, 16, 64), (8, 7, 64, 95), (2, 7, 64, 96), (3, 16, 64, 95)])
@pytest.mark.parametrize("kind", ["randn", "ints"])
def test_ddtree_tree(S, L, k, budget, kind):
    if kind == "randn":
        logits = torch.randn(S, L, 5000, device="cuda") * 3
    else:
        logits = ddtree_logits("ints", S, L, 300, torch.float32, seed=1)
    ids, lps = ddtree_topk_ref(logits, k)
    lps[0, 0, 1:] = lps[0, 0, 0]  # equal scores: depth, then rank path, must break the ties
    for got, want in zip(ddtree_tree(ids.contiguous(), lps.contiguous(), budget), ddtree_tree_ref(ids, lps, budget)):
        assert torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("S,L,k,budget,dtype", [(2, 7, 8, 32, torch.float32), (8, 7, 8, 16, torch.bfloat16),
                                                (8, 7, 16, 64, torch.bfloat16), (8, 7, 64, 64, torch.bfloat16),
                                                (8, 15, 16, 64, torch.float32), (1, 15, 8, 16, torch.bfloat16),
                                                (3, 16, 64, 200, torch.bfloat16), (2, 7, 16, 0, torch.bfloat16),
                                                (8, 7, 64, 64, torch.float32)])
def test_ddtree_build_end_to_end(S, L, k, budget, dtype):
    """ids exactly torch's; the tree exactly tree.py's on the kernel's own log-probs; with fp32 logits
    also exactly ddtree_build_ref. bf16 logits sit on a coarse grid, so sums of two log-probs tie in
    exact arithmetic often, and which fp64 sum comes out ahead then rests on the last bit of log-sum-exp,
    where any other summation order than torch's (this kernel's, the earlier kernel's) differs."""
    torch.manual_seed(0)
    logits = (torch.randn(S, L, 163840, device="cuda") * 5).to(dtype)
    poison_allocator()
    got = ddtree_build(logits, k, budget)
    ids, lps = ddtree_topk(logits, k)
    want_ids, want_lps = ddtree_topk_ref(logits, k)
    assert torch.equal(ids, want_ids) and torch.allclose(lps, want_lps, atol=1e-5, rtol=1e-5)
    for g, want in zip(got, ddtree_tree_ref(ids, lps, budget)):
        assert torch.equal(g.cpu(), want.cpu())
    if dtype == torch.float32:  # a near-tie of two fp64 scores below the fp32 log-prob noise: a false alarm
        tokens, parents, depths, logprobs, count = ddtree_build_ref(logits, k, budget)
        for g, want in zip(got, (tokens, parents, depths, None, count)):
            if want is not None:
                assert torch.equal(g.cpu(), want.cpu())
        assert torch.allclose(got[3].cpu(), logprobs.cpu(), atol=1e-5, rtol=1e-5)  # torch's log-softmax: last bits


@pytest.mark.parametrize("kind", ["ints", "same", "ties", "zeros"])
@pytest.mark.parametrize("S,L,k,budget", [(8, 7, 16, 64), (3, 7, 64, 95), (2, 16, 4, 50)])
def test_ddtree_build_ties(S, L, k, budget, kind):
    """Exact ties everywhere: ids as torch's stable sort; the tree exactly tree.py's on the kernel's own
    log-probs (torch's differ in the last bit, which can make or break a tie of two fp64 sums)."""
    logits = ddtree_logits(kind, S, L, 20000, torch.bfloat16, seed=S * k)
    ids, lps = ddtree_topk(logits, k)
    assert torch.equal(ids.cpu(), ddtree_topk_ref(logits.cpu(), k)[0])  # CPU: -0.0 == +0.0, see test_ddtree_topk
    for g, want in zip(ddtree_build(logits, k, budget), ddtree_tree_ref(ids, lps, budget)):
        assert torch.equal(g.cpu(), want.cpu())


def test_ddtree_build_replays_in_cuda_graph():
    """The self-resetting counters: many launches of one graph, inputs changed in place."""
    logits = (torch.randn(4, 7, 163840, device="cuda") * 3).bfloat16()
    ddtree_build(logits, 16, 64)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [ddtree_build(logits, 16, 64) for _ in range(3)]
    for seed in range(3):
        logits.copy_((torch.randn(4, 7, 163840, generator=torch.Generator("cuda").manual_seed(seed), device="cuda")
                      * 3).bfloat16())
        g.replay()
        want = ddtree_tree(*ddtree_topk(logits, 16), 64)
        for out in outs:
            for a, b in zip(out, want):
                assert torch.equal(a, b)


def test_moe_and_mla_replay_in_cuda_graph():
    """Launchers are graph-safe: capture once, change the inputs in place, replay."""
    experts = random_experts(8, 512, 256, seed=3)
    ids = torch.randint(0, 8, (5, 8), device="cuda")
    w, x = torch.rand(5, 8, device="cuda"), torch.randn(5, 512, device="cuda").bfloat16()
    args = list(mla_case([9, 4], [300, 70], 10, 16, seed=4))
    moe_w4a16(x, ids, w, experts), mla_tree_attention(*args, 0.1)  # compile and load outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        moe_out = moe_w4a16(x, ids, w, experts)
        mla_out = mla_tree_attention(*args, 0.1)
    ids.copy_(torch.randint(0, 8, (5, 8), device="cuda"))
    x.copy_(torch.randn(5, 512, device="cuda").bfloat16())
    args[0].copy_(torch.randn_like(args[0]))
    args[3].sub_(torch.tensor([17, 1], device="cuda"))  # shorter prefixes, same page tables
    g.replay()
    assert_close(moe_out, moe_w4a16_ref(x, ids, w, experts), rel=1e-2, cos=0.9999)
    assert_close(mla_out, mla_tree_attention_ref(*args, 0.1), rel=1e-2, cos=0.99995)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, rope", [((1, 64), False), ((3, 96), False), ((17, 384), False), ((63, 7168), False),
                                         ((2, 8, 1536), False), ((5, 100), False), ((2, 40000), False),
                                         ((1, 1, 64), True), ((3, 6, 64), True), ((17, 2, 128), True),
                                         ((4, 8, 6, 64), True), ((3, 2, 96), True)])
def test_rms_norm(shape, rope, dtype):
    g = torch.Generator("cuda").manual_seed(len(shape) * 100 + shape[-1])
    x = (torch.randn(shape, generator=g, device="cuda") * 3).to(dtype)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g, device="cuda")).to(dtype)
    cos = sin = None
    if rope:  # one angle table per position (row of x without its heads), as the drafter builds it
        angles = torch.rand((*shape[:-2], 1, shape[-1] // 2), generator=g, device="cuda") * 100
        cos, sin = (f(torch.cat([angles, angles], dim=-1)).to(dtype) for f in (torch.cos, torch.sin))
    poison_allocator()
    got, want = rms_norm(x, w, 1e-6, cos, sin), rms_norm_ref(x, w, 1e-6, cos, sin)
    scale = float(want.float().abs().max())
    err = float((got.float() - want.float()).abs().max())
    if dtype == torch.float32:  # summation order and rsqrtf: a few fp32 ulps
        assert err <= 1e-5 * scale, (err, scale)
    else:  # the bf16-rounded normed value can land one ulp apart: ~2^-8 of the largest output
        assert err <= 2**-7 * scale, (err, scale)
        assert float((got == want).float().mean()) >= 0.95
    assert not got.isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead, heads, D, offset", [((3,), 6, 64, 0), ((2, 5), 8, 128, 64 * 8), ((4,), 1, 96, 96)])
def test_rms_norm_rope_of_a_column_block(lead, heads, D, offset, dtype):
    """q_norm / k_norm + RoPE of a fused projection's column block unflattened into heads (tokens further apart than
    heads·D), read in place: bit for bit the result of the same kernel on a contiguous copy, and near the reference."""
    g = torch.Generator("cuda").manual_seed(heads * D)
    wide = (torch.randn(*lead, offset + heads * D + 3 * D, generator=g, device="cuda") * 3).to(dtype)
    x = wide[..., offset: offset + heads * D].unflatten(-1, (heads, D))
    assert not x.is_contiguous()
    w = (1 + 0.5 * torch.randn(D, generator=g, device="cuda")).to(dtype)
    angles = torch.rand((*lead, 1, D // 2), generator=g, device="cuda") * 100
    cos, sin = (f(torch.cat([angles, angles], dim=-1)).to(dtype) for f in (torch.cos, torch.sin))
    got = rms_norm(x, w, 1e-6, cos, sin)
    assert torch.equal(got, rms_norm(x.contiguous(), w, 1e-6, cos, sin))
    want = rms_norm_ref(x, w, 1e-6, cos, sin)
    assert float((got.float() - want.float()).abs().max()) <= 2**-7 * float(want.float().abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_unaligned_rows(dtype):
    """A contiguous view that starts 2 or 4 bytes into its storage cannot take the 16-byte path (it takes
    the scalar loop): still the reference's result, within test_rms_norm's tolerances."""
    base = torch.randn(17 * 7168 + 1, device="cuda").to(dtype)
    x = base[1:].view(17, 7168)
    w = torch.randn(7168, device="cuda").to(dtype)
    assert x.data_ptr() % 16 != 0
    got, want = rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)
    err, scale = float((got.float() - want.float()).abs().max()), float(want.float().abs().max())
    assert err <= (1e-5 if dtype == torch.float32 else 2**-7) * scale, (err, scale)


def test_rms_norm_row_does_not_depend_on_its_batch():
    """Each row alone equals the same row inside a batch of 33, bit for bit: a tree row and the AR row
    of the same token normalize identically (the verifier's output must not depend on the tree size)."""
    x = torch.randn(33, 7168, device="cuda").bfloat16()
    w = torch.randn(7168, device="cuda").bfloat16()
    batch = rms_norm(x, w, 1e-6)
    assert all(torch.equal(rms_norm(x[r: r + 1].contiguous(), w, 1e-6)[0], batch[r]) for r in (0, 5, 32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 7168), (17, 7168), (63, 384), (3, 100), (5, 7)])  # 100, 7: torch's path
def test_add_rms_norm(shape, dtype):
    """The residual add and the norm in one launch: h equals torch's add bit for bit (same rounding), the
    norm of h is the reference's within test_rms_norm's tolerances; NaN-poisoned outputs all written."""
    g = torch.Generator("cuda").manual_seed(shape[0] * shape[1])
    x = (torch.randn(shape, generator=g, device="cuda") * 4).to(dtype)
    delta = (torch.randn(shape, generator=g, device="cuda") * 3).to(dtype)
    w = (1 + 0.5 * torch.randn(shape[1], generator=g, device="cuda")).to(dtype)
    poison_allocator()
    h, got = add_rms_norm(x, delta, w, 1e-6)
    h_ref, want = add_rms_norm_ref(x, delta, w, 1e-6)
    assert torch.equal(h, h_ref)
    err, scale = float((got.float() - want.float()).abs().max()), float(want.float().abs().max())
    assert err <= (1e-5 if dtype == torch.float32 else 2**-7) * scale, (err, scale)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 17, 63])
@pytest.mark.parametrize("blocks", [((0, 1536), (1536, 2048)), ((0, 512), (512, 2048)), ((0, 64), (64, 2112)),
                                    ((3, 515), (1536, 2048))])  # (3, 515): off the 16-byte path, two launches
def test_rms_norm_pair(rows, blocks, dtype):
    """Two column blocks of the fused q/kv latent projection's output normed in one launch (K2.6: q 1536 and
    kv 512 wide, other widths give the two blocks different thread counts): each equals its own rms_norm
    launch bit for bit and the reference within test_rms_norm's tolerances; NaN-poisoned outputs all written."""
    g = torch.Generator("cuda").manual_seed(rows * 1000 + blocks[0][1])
    wide = (torch.randn(rows, 2112, generator=g, device="cuda") * 3).to(dtype)
    (a0, a1), (b0, b1) = blocks
    x1, x2 = wide[:, a0:a1], wide[:, b0:b1]
    w1, w2 = ((1 + 0.5 * torch.randn(x.shape[1], generator=g, device="cuda")).to(dtype) for x in (x1, x2))
    poison_allocator()
    got = rms_norm_pair(x1, w1, x2, w2, 1e-6)
    for y, x, w, want in zip(got, (x1, x2), (w1, w2), rms_norm_pair_ref(x1, w1, x2, w2, 1e-6)):
        assert y.is_contiguous() and y.shape == x.shape
        assert torch.equal(y, rms_norm(x, w, 1e-6))
        err, scale = float((y.float() - want.float()).abs().max()), float(want.float().abs().max())
        assert err <= (1e-5 if dtype == torch.float32 else 2**-7) * scale, (err, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [(0, 1536), (1536, 2048), (3, 515)])  # (3, 515): rows not 16-byte aligned
def test_rms_norm_column_block_of_wider_rows(dtype, cols):
    """A [T, D] column block of wider rows (the fused q/kv latent projection's output) is normed in place
    of a copy: equal to the reference of the same block made contiguous, and to the kernel on that copy."""
    g = torch.Generator("cuda").manual_seed(cols[0])
    wide = (torch.randn(17, 2112, generator=g, device="cuda") * 3).to(dtype)
    x = wide[:, cols[0]: cols[1]]
    w = (1 + 0.5 * torch.randn(x.shape[1], generator=g, device="cuda")).to(dtype)
    poison_allocator()
    got, want = rms_norm(x, w, 1e-6), rms_norm_ref(x.contiguous(), w, 1e-6)
    assert got.is_contiguous() and got.shape == x.shape
    if x.data_ptr() % 16 == 0:  # the same 16-byte path as on the copy (unaligned rows take the scalar loop)
        assert torch.equal(got, rms_norm(x.contiguous(), w, 1e-6))
    err, scale = float((got.float() - want.float()).abs().max()), float(want.float().abs().max())
    assert err <= (1e-5 if dtype == torch.float32 else 2**-7) * scale, (err, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, I", [(1, 2048), (3, 18432), (17, 384), (63, 100), (5, 7)])  # I = 100, 7: scalar path
def test_silu_mul(T, I, dtype):
    """Against torch's two-launch path over the column views; both round silu to the dtype before the product."""
    g = torch.Generator("cuda").manual_seed(T * 1000 + I)
    gate_up = (torch.randn(T, 2 * I, generator=g, device="cuda") * 4).to(dtype)
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # exp overflow / underflow, zero
    poison_allocator()
    got, want = silu_mul(gate_up), silu_mul_ref(gate_up)
    assert got.shape == (T, I) and got.dtype == dtype and torch.isfinite(got).all()
    if dtype == torch.bfloat16:  # expf may differ from torch's exp by an ulp of fp32: rarely a bf16 ulp
        assert float((got == want).float().mean()) >= 0.999
        assert torch.allclose(got.float(), want.float(), rtol=2**-7, atol=0)
    else:
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
