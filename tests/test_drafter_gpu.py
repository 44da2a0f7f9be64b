"""The drafter on a GPU: trees from the CUDA builder equal the torch top-K + host heap trees."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from drafter_service.engine import DraftMode, DrafterEngine, EngineOptions, Proposal, ProposeItem  # noqa: E402
from drafter_service.graphs import INJECT_BUCKETS  # noqa: E402


@pytest.mark.parametrize("mode, budget", [(DraftMode.DDTREE, 16), (DraftMode.DDTREE, 64), (DraftMode.CHAIN, 8)])
def test_device_trees_equal_host_trees(tmp_path, mode, budget):
    from service_kit.tools import make_tiny

    d = make_tiny(tmp_path / "tiny")
    engines = {use: DrafterEngine.load(d / "drafter", d, device="cuda", dtype=torch.float32,
                                       options=EngineOptions(cache_bytes=64 << 20, window=1024, use_kernels=use))
               for use in (False, True)}
    engines[True].model.use_kernels(False)  # the same logits on both sides: only the tree builder differs
    width = len(engines[True].cfg.target_layer_ids) * engines[True].cfg.hidden_size
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        items = [ProposeItem(f"s{i}", 6 * step, torch.randn(6, width, generator=g), root_token=17 + i + step,
                             tree_budget=budget, mode=mode) for i in range(4)]
        host = engines[False].propose(items)
        dev = engines[True].propose(items)
        for h, k in zip(host, dev):
            assert isinstance(h, Proposal) and isinstance(k, Proposal)
            assert h.tree.tokens.tolist() == k.tree.tokens.tolist()
            assert h.tree.parents.tolist() == k.tree.parents.tolist()
            assert h.tree.depths.tolist() == k.tree.depths.tolist()
            # each node's log q at its depth; the kernel's log-sum-exp may differ from torch's in the last bits
            assert h.tree.logprobs.tolist() == pytest.approx(k.tree.logprobs.tolist(), abs=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norms_match_torch_norms(tmp_path, dtype):
    """kernels/rms_norm in every drafter norm (RoPE fused into q/k norms) against the torch math: the draft
    distributions agree to rounding (fp32: 1e-4 in log-prob; bf16: a few bf16 ulps of the logits)."""
    from service_kit.tools import make_tiny

    d = make_tiny(tmp_path / "tiny")
    engines = {use: DrafterEngine.load(d / "drafter", d, device="cuda", dtype=dtype,
                                       options=EngineOptions(cache_bytes=64 << 20, window=1024, use_kernels=use))
               for use in (False, True)}
    assert all(n.fused for n in engines[True].model.modules() if hasattr(n, "fused"))
    assert_same_drafts(engines[False], engines[True], seed=1, tol=1e-4 if dtype == torch.float32 else 0.1,
                       agree=1.0 if dtype == torch.float32 else 0.8)


def assert_same_drafts(want_engine, got_engine, seed: int, tol: float, agree: float) -> None:
    """Three Proposes of 3 sessions (5 new feature rows each): every depth's top-1 log-prob within `tol` and its
    token the same in at least the fraction `agree` of depths."""
    width = want_engine.cfg.feature_width
    g = torch.Generator().manual_seed(seed)
    for step in range(3):
        items = [ProposeItem(f"s{i}", 5 * step, torch.randn(5, width, generator=g), root_token=11 + i + step,
                             tree_budget=8, return_draft_logprobs=True) for i in range(3)]
        for want, got in zip(want_engine.propose(items), got_engine.propose(items)):
            assert isinstance(want, Proposal) and isinstance(got, Proposal)
            err = float(abs(want.topk_logprobs[:, 0] - got.topk_logprobs[:, 0]).max())
            assert err < tol, f"step {step}: top-1 log-prob differs by {err} (limit {tol})"
            same = float((want.topk_ids[:, 0] == got.topk_ids[:, 0]).mean())
            assert same >= agree, f"step {step}: top-1 agreement {same}"


def test_graph_replay_equals_eager(tmp_path):
    """Inject and block forward replayed from CUDA graphs (padded rows, sessions and page tables) give the
    trees of the eager path, across inject sizes inside and beyond the buckets and batches of 1-5 sessions."""
    from service_kit.tools import make_tiny

    d = make_tiny(tmp_path / "tiny")
    engines = {g: DrafterEngine.load(d / "drafter", d, device="cuda", dtype=torch.float32,
                                     options=EngineOptions(cache_bytes=64 << 20, window=256, page_size=16,
                                                           cuda_graphs=g))
               for g in (False, True)}
    assert engines[True].graphs is not None and engines[False].graphs is None
    width = engines[True].cfg.feature_width
    g = torch.Generator().manual_seed(1)
    lengths = {}
    for step, (sessions, n) in enumerate([(1, 100), (3, 1), (5, 3), (2, 8), (5, 17), (1, 70), (4, 2), (2, 30), (1, 1),
                                                   (5, 300)]):
        items = []
        for i in range(sessions):
            sid = f"s{i}"
            start = lengths.get(sid, 0)
            items.append(ProposeItem(sid, start, torch.randn(n, width, generator=g), root_token=5 + i + step,
                                     tree_budget=16))
            lengths[sid] = start + n
        eager, graphed = engines[False].propose(items), engines[True].propose(items)
        for e, r in zip(eager, graphed):
            assert isinstance(e, Proposal) and isinstance(r, Proposal), (step, e, r)
            assert e.cache_len == r.cache_len
            assert e.tree.tokens.tolist() == r.tree.tokens.tolist(), step
            assert e.tree.parents.tolist() == r.tree.parents.tolist(), step
            # through the packed int64 copy: equal up to rounding (the padded graph's block forward may run other
            # GEMM kernels than the eager one, so a log-prob can move in its last bits: 5e-7 seen on an H200)
            assert e.tree.logprobs.tolist() == pytest.approx(r.tree.logprobs.tolist(), rel=0, abs=1e-5), step
    graphs = engines[True].graphs
    assert set(graphs.inject_graphs) == {1, 4, 8, 16, 64} and graphs.block_graphs  # the graphs did run
    assert set(graphs.tree_graphs) == {(b, 16, 16) for b in (1, 2, 4, 8)}  # trees of batches 1, 2, 3-4, 5
    assert engines[True].warm_up() == len(INJECT_BUCKETS) + 4 * 6  # batches 1-8 x page widths 1..16, 17
    assert engines[False].warm_up() == 0


def test_int8_drafter_kernel_matches_dequantized_weights(tmp_path, monkeypatch):
    """`--quantization int8` on a GPU: the Propose's projections and lm_head on kernels/w8a16_gemm (CUDA graphs)
    draft what the unquantized architecture drafts from the dequantized weights (bf16 nn.Linear weights
    overwritten, cuBLAS, eager), up to bf16 rounding."""
    import kernels.w8a16_gemm as w8
    from drafter_service import int8
    from service_kit.tools import make_tiny

    d = make_tiny(tmp_path / "tiny")
    engines = {graphs: DrafterEngine.load(d / "drafter", d, device="cuda", dtype=torch.bfloat16,
                                          options=EngineOptions(cache_bytes=64 << 20, window=1024, cuda_graphs=graphs))
               for graphs in (False, True)}
    twin = engines[False].model
    for m in twin.modules():
        if isinstance(m, torch.nn.Linear):
            m.weight.copy_(w8.dequantize_int8(*w8.quantize_int8(m.weight), m.weight.dtype))
    twin.lm_head = w8.dequantize_int8(*w8.quantize_int8(twin.lm_head), twin.lm_head.dtype)
    int8.quantize_drafter(engines[True].model)
    calls = []
    kernel = w8.w8a16_gemm
    monkeypatch.setattr(w8, "w8a16_gemm", lambda *a, **k: calls.append(a[0].shape[0]) or kernel(*a, **k))
    assert_same_drafts(engines[False], engines[True], seed=2, tol=0.1, agree=0.8)
    assert calls  # the kernel ran (eagerly while the graphs were captured)
