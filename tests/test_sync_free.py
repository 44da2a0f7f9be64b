"""The sync-free torch path (batched attention over per-row key slots, every-expert MoE) equals the
reference path on CPU in fp32: per attention call, per MoE call, for the whole model, and for plans
padded into CUDA-graph buffers (graphs.static_plan / fill_plan). Unused cache slots hold NaN, so any
key that leaks into a row's softmax or values shows up as NaN in its output."""

from __future__ import annotations

import types

import pytest
import torch
from model_fixtures import (grouped_dir, load_model, new_cache, prefill, single_thread, tiny_dir,  # noqa: F401
                            tiny_model)

from verifier_service import model as model_mod
from verifier_service.graphs import empty_plan, fill_plan, page_bucket, static_plan
from verifier_service.int4 import Int4Weight
from verifier_service.mla import mla_forward, rms_norm, row_keys
from verifier_service.model import REFERENCE, SYNC_FREE, K2Model
from verifier_service.moe import (DENSE_MAX_PAIRS, ExpertStack, MoEWeights, dense_fits, dense_stack,
                                  moe_experts_dense, moe_experts_ref, route)
from verifier_service.plan import SeqRows, build_plan, chain_parents, key_groups, tree_parents
from verifier_service.rope import rope_cos_sin

PAGE = 4
TOL = 1e-5
# (committed prefix, tree rows incl. the root); prefixes on and off page boundaries, an empty sequence
# (0 rows: a batch slot with nothing to run), a lone root, a 1-page tree.
SESSIONS = [(4, 7), (0, 0), (5, 1), (13, 12), (8, 3), (0, 4)]


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).norm() / ref.norm()).item()


def sync_free(model: K2Model) -> K2Model:
    return K2Model(model.cfg, model.weights, sync_free=True)


def poisoned_session_plan(model: K2Model, seed: int = 0, chunk: int = 6):
    """A NaN-filled cache (page 0 held by a session that never writes, so every page-table pad points at
    NaN) with the SESSIONS' prefixes prefilled, then one plan: each session's random tree (or nothing)
    plus a new session's prefill chunk."""
    g = torch.Generator().manual_seed(seed)
    cache = new_cache(model, num_pages=64, page_size=PAGE)
    cache.kv.fill_(float("nan"))
    cache.table.open("poison")
    assert cache.table.extend("poison", 1) == [0]
    seqs = []
    for i, (prefix, n) in enumerate(SESSIONS):
        sid = f"s{i}"
        cache.table.open(sid)
        if prefix:
            prefill(model, cache, sid, torch.randint(4, 500, (prefix,), generator=g).tolist())
        parents = [int(torch.randint(0, j, (1,), generator=g)) for j in range(1, n)]
        seqs.append(SeqRows(torch.randint(4, 500, (n,), generator=g).tolist(), tree_parents(parents)[:n], prefix,
                            cache.table.pages(sid), cache.table.scratch(sid, n) if n else []))
    cache.table.open("new")
    slots = cache.table.extend("new", chunk)
    seqs.append(SeqRows(torch.randint(4, 500, (chunk,), generator=g).tolist(), chain_parents(chunk), 0,
                        cache.table.pages("new"), slots))
    return cache, build_plan(seqs)


@pytest.mark.parametrize("explicit", [False, True])
def test_attention_equals_per_session_reference(tiny_model, explicit):
    model = tiny_model
    cache, plan = poisoned_session_plan(model)
    cfg, w = model.cfg, model.weights.layers[1].self_attn
    x = torch.randn(plan.num_rows, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    cos, sin = rope_cos_sin(model.inv_freq, plan.positions, cfg.rope_amplitude)

    def run(keys):
        kv = cache.kv[1].view(-1, cfg.kv_cache_width).clone()
        return mla_forward(x, w, cfg, cos, sin, kv, plan.write_slots, keys, explicit), kv

    ref, kv_ref = run(key_groups(plan, PAGE))
    got, kv_got = run(row_keys(plan, PAGE))
    assert torch.isfinite(ref).all() and torch.isfinite(got).all()
    assert rel(got, ref) < TOL
    assert torch.equal(kv_got.nan_to_num(7.0), kv_ref.nan_to_num(7.0))


def test_row_keys_layout(tiny_model):
    """Valid keys per row = exactly the reference group's visible keys (as multisets of slots)."""
    cache, plan = poisoned_session_plan(tiny_model, seed=3)
    keys = row_keys(plan, PAGE)
    assert keys.slots.shape == (plan.num_rows, plan.page_table.shape[1] * PAGE + plan.tree_mask.shape[1])
    for gr in key_groups(plan, PAGE):
        for r in range(gr.rows.start, gr.rows.stop):
            want = sorted(gr.key_slots[gr.mask[r - gr.rows.start]].tolist())
            assert sorted(keys.slots[r][keys.valid[r]].tolist()) == want
    assert (keys.slots[~keys.valid] == 0).all()


def test_attention_head_slices_sum_to_full(tiny_model):
    """Head-parallel ranks (one of them without heads) add up to the full sync-free attention."""
    from test_mla import _head_slice

    cache, plan = poisoned_session_plan(tiny_model, seed=4)
    cfg, w = tiny_model.cfg, tiny_model.weights.layers[2].self_attn
    x = torch.randn(plan.num_rows, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    cos, sin = rope_cos_sin(tiny_model.inv_freq, plan.positions, cfg.rope_amplitude)
    keys = row_keys(plan, PAGE)

    def run(weights):
        kv = cache.kv[2].view(-1, cfg.kv_cache_width).clone()
        return mla_forward(x, weights, cfg, cos, sin, kv, plan.write_slots, keys, False)

    parts = [run(_head_slice(w, cfg, s)) for s in (slice(0, 3), slice(3, 4), slice(4, 4))]
    assert parts[2].abs().max() == 0
    assert rel(sum(parts), run(w)) < TOL


def test_attention_chunks_equal_one_pass(tiny_model, monkeypatch):
    """Row chunking (memory cap) does not change the result."""
    cache, plan = poisoned_session_plan(tiny_model, seed=5)
    cfg, w = tiny_model.cfg, tiny_model.weights.layers[1].self_attn
    x = torch.randn(plan.num_rows, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    cos, sin = rope_cos_sin(tiny_model.inv_freq, plan.positions, cfg.rope_amplitude)
    keys = row_keys(plan, PAGE)
    kv = cache.kv[1].view(-1, cfg.kv_cache_width).clone()
    whole = mla_forward(x, w, cfg, cos, sin, kv, plan.write_slots, keys, False)
    monkeypatch.setattr("verifier_service.mla.ATTN_CHUNK_BYTES", 1)  # one row per chunk
    assert rel(mla_forward(x, w, cfg, cos, sin, kv, plan.write_slots, keys, False), whole) < TOL


@pytest.mark.parametrize("fixture", ["tiny_dir", "grouped_dir"])
def test_whole_model_equals_reference(fixture, request):
    ref_model = load_model(request.getfixturevalue(fixture))
    model = sync_free(ref_model)
    assert model.attention_path(torch.zeros(1)) == SYNC_FREE and ref_model.attention_path(torch.zeros(1)) == REFERENCE
    cache, plan = poisoned_session_plan(ref_model, seed=7)
    kv_ref, kv_got = cache.kv.clone(), cache.kv.clone()
    ref = ref_model.forward(plan, kv_ref, (0, 2))
    got = model.forward(plan, kv_got, (0, 2))
    assert torch.isfinite(got.logits).all()
    assert rel(got.logits, ref.logits) < TOL and rel(got.hidden, ref.hidden) < TOL
    assert torch.equal(got.logits.argmax(-1), ref.logits.argmax(-1))
    assert torch.allclose(kv_got.nan_to_num(7.0), kv_ref.nan_to_num(7.0), atol=1e-5, rtol=0)


def test_decode_steps_after_commit_equal_reference(tiny_model):
    """Tree verify -> commit -> one-row decode steps, both paths on their own caches."""
    runs = []
    for model in (tiny_model, sync_free(tiny_model)):
        cache = new_cache(model, num_pages=64, page_size=PAGE)
        prefill(model, cache, "a", list(range(10, 21)), explicit=True)
        slots = cache.table.scratch("a", 5)
        plan = build_plan([SeqRows([5, 6, 7, 8, 9], tree_parents([0, 0, 1, 3]), 11, cache.table.pages("a"), slots)])
        logits = [model.forward(plan, cache.kv).logits]
        cache.commit("a", [0, 1, 3])
        for tok in (40, 41, 42, 43, 44, 45):
            logits.append(prefill(model, cache, "a", [tok], explicit=False).logits)
        runs.append(torch.cat(logits))
    assert rel(runs[1], runs[0]) < TOL


def _moe_inputs(model: K2Model, layer: int = 2, rows: int = 11, dtype=torch.float32):
    cfg, w = model.cfg, model.weights.layers[layer].mlp
    x = torch.randn(rows, cfg.hidden_size, generator=torch.Generator().manual_seed(layer))
    x = rms_norm(x, torch.ones(cfg.hidden_size), cfg.rms_norm_eps).to(dtype)
    ids, weights = route(x, w, cfg)
    return x, ids, weights, w.experts


def _slice(ex: ExpertStack, lo: int, hi: int) -> ExpertStack:
    """What an expert-parallel rank holds: experts lo .. hi-1."""
    part = lambda m: Int4Weight(m.packed[lo:hi], m.scale[lo:hi], m.shape, m.tiled)  # noqa: E731
    return ExpertStack(part(ex.gate_proj), part(ex.up_proj), part(ex.down_proj), first=ex.first + lo)


def test_dense_moe_equals_reference(tiny_model):
    x, ids, weights, ex = _moe_inputs(tiny_model)
    ref = moe_experts_ref(x, ids, weights, ex)
    assert rel(moe_experts_dense(x, ids, weights, dense_stack(ex, x.dtype)), ref) < TOL
    assert rel(moe_experts_dense(x, ids, weights, ex), ref) < TOL  # INT4 stack dequantized per call
    # Expert parallelism: uneven rank slices (one empty) each equal the reference slice and sum to all.
    cuts = [0, 5, 5, 11, ex.count]
    parts = [moe_experts_dense(x, ids, weights, dense_stack(_slice(ex, a, b), x.dtype))
             for a, b in zip(cuts, cuts[1:])]
    for (a, b), part in zip(zip(cuts, cuts[1:]), parts):
        want = moe_experts_ref(x, ids, weights, _slice(ex, a, b))
        assert torch.allclose(part, want, atol=1e-6, rtol=TOL)
    assert rel(sum(parts), ref) < TOL
    empty = moe_experts_dense(x[:0], ids[:0], weights[:0], dense_stack(ex, x.dtype))
    assert empty.shape == (0, x.shape[1])


def test_dense_stack_down_by_row(tiny_model):
    """The by-row down layout holds the same values, reads as [H, E·I] without a copy, and the dense path
    over it still equals the reference."""
    x, ids, weights, ex = _moe_inputs(tiny_model)
    plain, by_row = dense_stack(ex, x.dtype), dense_stack(ex, x.dtype, down_by_row=True)
    assert torch.equal(plain.down_proj, by_row.down_proj)
    E, H, I = by_row.down_proj.shape
    flat = by_row.down_proj.permute(1, 0, 2).reshape(H, E * I)
    assert flat.data_ptr() == by_row.down_proj.data_ptr() and flat.is_contiguous()
    assert rel(moe_experts_dense(x, ids, weights, by_row), moe_experts_ref(x, ids, weights, ex)) < TOL


def test_dense_moe_bf16_close_to_reference(tiny_model):
    x, ids, weights, ex = _moe_inputs(tiny_model, layer=3, rows=40, dtype=torch.bfloat16)
    got = moe_experts_dense(x, ids, weights, dense_stack(ex, torch.bfloat16))
    ref = moe_experts_ref(x, ids, weights, ex)
    assert got.dtype == torch.bfloat16 and rel(got.float(), ref.float()) < 1e-2


def test_selection_rule(tiny_model, monkeypatch):
    cuda_kv = types.SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)  # graph_safe reads only these
    cpu = tiny_model
    assert not cpu.sync_free and cpu.dense_experts == {} and not cpu.graph_safe(torch.zeros(1))
    assert not K2Model(cpu.cfg, cpu.weights, use_kernels=True).sync_free  # auto: GPU only
    model = sync_free(cpu)
    moe_layers = [i for i, layer in enumerate(cpu.weights.layers) if isinstance(layer.mlp, MoEWeights)]
    assert sorted(model.dense_experts) == moe_layers
    assert model.graph_safe(cuda_kv) and not model.graph_safe(torch.zeros(1))  # CPU caches: no graphs
    count = model.dense_experts[moe_layers[0]].count
    assert dense_fits(DENSE_MAX_PAIRS // count, model.dense_experts[moe_layers[0]])
    assert not model.graph_safe(cuda_kv, max_rows=DENSE_MAX_PAIRS // count + 1)  # too many pairs for a graph
    monkeypatch.setattr(model_mod, "DENSE_EXPERTS_MAX_BYTES", 1000)  # dense copies do not fit: reference MoE
    big = sync_free(cpu)
    assert big.dense_experts == {} and not big.graph_safe(cuda_kv)
    cache, plan = poisoned_session_plan(cpu, seed=9)
    ref = cpu.forward(plan, cache.kv.clone()).logits
    assert rel(big.forward(plan, cache.kv.clone()).logits, ref) < TOL


def test_no_host_reads(tiny_model, monkeypatch):
    """The sync-free forward never reads a tensor back to the host (which on a GPU would sync)."""
    model = sync_free(tiny_model)
    cache, plan = poisoned_session_plan(tiny_model, seed=2)

    def host_read(*_a, **_k):
        raise AssertionError("host read of a tensor")

    names = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy", "cpu")
    with monkeypatch.context() as m:
        for name in names:
            m.setattr(torch.Tensor, name, host_read)
        model.forward(plan, cache.kv.clone(), (1,))
        with pytest.raises(AssertionError, match="host read"):
            tiny_model.forward(plan, cache.kv.clone(), (1,))  # the reference path does read


# Graph padding without CUDA: the static buffers GraphRunner replays, filled on CPU.
@pytest.mark.parametrize(("bucket", "max_seqs", "pages"), [(64, 8, 8), (64, 7, 4), (33, 7, 16)])
def test_padded_plan_equals_unpadded(tiny_model, bucket, max_seqs, pages):
    model = sync_free(tiny_model)
    cache, plan = poisoned_session_plan(tiny_model, seed=11, chunk=33 - sum(n for _, n in SESSIONS))
    assert plan.num_rows == 33 and plan.prefix_lens.shape[0] == 7 and plan.page_table.shape[1] == 4
    pad_slot = cache.table.withhold(1)[0] * cache.page_size
    static = static_plan(bucket, max_seqs, pages, "cpu")
    fill_plan(static, empty_plan(static), pad_slot)  # what a capture runs first
    model.forward(static, cache.kv.clone(), (0,))
    fill_plan(static, plan, pad_slot)
    kv_ref, kv_pad = cache.kv.clone(), cache.kv.clone()
    ref = tiny_model.forward(plan, kv_ref, (0, 3))
    padded = model.forward(static, kv_pad, (0, 3))
    T = plan.num_rows
    assert torch.isfinite(padded.logits).all()
    assert rel(padded.logits[:T], ref.logits) < TOL and rel(padded.hidden[:T], ref.hidden) < TOL
    flat = lambda kv: kv.view(kv.shape[0], -1, kv.shape[-1]).nan_to_num(7.0)  # noqa: E731
    keep = torch.ones(flat(kv_pad).shape[1], dtype=torch.bool)
    keep[pad_slot] = False  # pad rows write only there
    assert torch.allclose(flat(kv_pad)[:, keep], flat(kv_ref)[:, keep], atol=1e-5, rtol=0)


def test_padded_plan_pad_rows_route_to_no_expert(tiny_model):
    """A graph's pad rows (rows from the live count on) choose no expert in any MoE layer on the paths that read
    experts per id (here the reference loop; on GPU the INT4 kernel), so no rank reads expert weights for them; the
    live rows choose what they choose in the unpadded plan. (The every-expert path keeps the ids: it computes every
    expert anyway.)"""
    model = K2Model(tiny_model.cfg, tiny_model.weights)  # reference path, its own skip_pad_rows switch
    cache, plan = poisoned_session_plan(tiny_model, seed=5, chunk=3)
    pad_slot = cache.table.withhold(1)[0] * cache.page_size
    static = static_plan(64, 8, 8, "cpu")
    fill_plan(static, plan, pad_slot)
    T = plan.num_rows

    def routed(m: K2Model, p) -> dict[int, torch.Tensor]:
        seen: dict[int, torch.Tensor] = {}
        m.on_experts = lambda layer, ids: seen.__setitem__(layer, ids.clone())
        try:
            m.forward(p, cache.kv.clone())
        finally:
            m.on_experts = None
        return seen

    want, got = routed(tiny_model, plan), routed(model, static)
    assert want and got.keys() == want.keys() and T < 64
    for layer, ids in got.items():
        assert torch.equal(ids[:T].sort(-1).values, want[layer].sort(-1).values), layer
        assert ids[T:].eq(-1).all(), layer
    model.skip_pad_rows = False  # the pad rows do route somewhere when not skipped
    assert all(ids[T:].ge(0).all() for ids in routed(model, static).values())


def test_padded_decode_rows(tiny_model):
    """Single-row decode plans of several sessions padded into a larger bucket (most rows are pad)."""
    model = sync_free(tiny_model)
    cache = new_cache(tiny_model, num_pages=64, page_size=PAGE)
    seqs = []
    for sid, n in (("a", 9), ("b", 4), ("c", 1)):
        prefill(tiny_model, cache, sid, list(range(30, 30 + n)))
        seqs.append(SeqRows([7], [-1], n, cache.table.pages(sid), cache.table.scratch(sid, 1)))
    plan = build_plan(seqs)
    pad_slot = cache.table.withhold(1)[0] * cache.page_size
    static = static_plan(8, 4, page_bucket(plan.page_table.shape[1], 16, True), "cpu")
    fill_plan(static, plan, pad_slot)
    ref = tiny_model.forward(plan, cache.kv.clone()).logits
    assert rel(model.forward(static, cache.kv.clone()).logits[:3], ref) < TOL


def test_page_bucket():
    assert [page_bucket(p, 129, True) for p in (0, 1, 2, 3, 4, 5, 64, 65, 129)] == [1, 1, 2, 4, 4, 8, 64, 128, 129]
    assert page_bucket(3, 129, False) == 129

