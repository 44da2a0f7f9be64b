"""The target model on a GPU with the CUDA kernels vs the torch reference path (same weights).

The kernels are built for K2.6's shapes (576-wide latent, H and I multiples of 128), so the tiny
checkpoint runs the reference path even with the flag on (checked: its greedy output is unchanged);
the kernel checks use random full-dimension K2.6 weights (2 layers, one EP rank's 55 experts, 10 heads).
"""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from verifier_service.kv_cache import PagedKVCache  # noqa: E402
from verifier_service.model import K2Model  # noqa: E402
from verifier_service.plan import SeqRows, build_plan, chain_parents  # noqa: E402
from verifier_service.weights import load_target_weights  # noqa: E402

# bf16 end to end: 1e-2 relative on logits is the dtype's noise after a few layers.
BF16_REL = 2e-2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from service_kit.tools import make_tiny
    from verifier_service.model_config import K2Config

    d = make_tiny(tmp_path_factory.mktemp("tiny"))
    cfg = K2Config.from_json(d)
    w = load_target_weights(d, cfg, dtype=torch.bfloat16, device="cuda")
    return cfg, w


def new_cache(cfg, pages=64):
    return PagedKVCache(num_layers=cfg.num_hidden_layers, width=cfg.kv_cache_width, num_pages=pages,
                        page_size=16, dtype=torch.bfloat16, device="cuda")


def greedy(model: K2Model, cfg, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Plain AR decoding through prefill + one-row steps -> tokens and each step's top-2 logit gap."""
    cache = new_cache(cfg)
    t = cache.table
    t.open("s")
    slots = t.extend("s", len(prompt))
    plan = build_plan([SeqRows(prompt, chain_parents(len(prompt)), 0, t.pages("s"), slots)],
                      logit_rows=[len(prompt) - 1], device="cuda")
    tokens, gaps = [], []
    logits = model.forward(plan, cache.kv).logits[0]
    for _ in range(n):
        top2 = logits.topk(2).values
        gaps.append(float(top2[0] - top2[1]))
        tok = int(logits.argmax())
        tokens.append(tok)
        pos = t.length("s")
        slot = t.extend("s", 1)
        plan = build_plan([SeqRows([tok], [-1], pos, t.pages("s"), slot)], device="cuda")
        logits = model.forward(plan, cache.kv).logits[0]
    return tokens, gaps


def test_tiny_greedy_unchanged_by_kernels(tiny):
    cfg, w = tiny
    for prompt in ([1, 2, 3, 4, 5], list(range(40, 77)), [7] * 19):
        ref, gaps = greedy(K2Model(cfg, w, use_kernels=False), cfg, prompt, 32)
        got, _ = greedy(K2Model(cfg, w, use_kernels=True), cfg, prompt, 32)
        if got != ref:  # allowed only at a numerical tie (top-2 gap below bf16 noise)
            i = next(j for j, (a, b) in enumerate(zip(got, ref)) if a != b)
            assert gaps[i] < 0.05, f"diverged at {i} with top-2 gap {gaps[i]:.4f}: {got} vs {ref}"


def test_k26_dims_greedy_unchanged_by_kernels():
    from verifier_service.synthetic import k26_config, random_target

    cfg = k26_config(2)
    w = random_target(cfg, experts=range(0, 55), heads=range(0, 10), seed=3)
    prompt = [(7919 * i) % cfg.vocab_size for i in range(1, 40)]
    ref, gaps = greedy(K2Model(cfg, w, use_kernels=False), cfg, prompt, 16)
    got, _ = greedy(K2Model(cfg, w, use_kernels=True), cfg, prompt, 16)
    if got != ref:
        i = next(j for j, (a, b) in enumerate(zip(got, ref)) if a != b)
        assert gaps[i] < 0.05, f"diverged at {i} with top-2 gap {gaps[i]:.4f}: {got} vs {ref}"


def test_full_dimension_step_kernels_match_reference():
    from verifier_service.bench_verify import tree_plan
    from verifier_service.synthetic import k26_config, random_target
    import random

    cfg = k26_config(2)
    w = random_target(cfg, experts=range(0, 55), heads=range(0, 10))
    cache = PagedKVCache(num_layers=2, width=cfg.kv_cache_width, num_pages=40, page_size=64,
                         dtype=torch.bfloat16, device="cuda")
    cache.table.open("s")
    cache.table.extend("s", 2000)
    cache.kv.normal_()
    plan = tree_plan(cache, 17, 2000, cfg.vocab_size, random.Random(1))
    ref = K2Model(cfg, w, use_kernels=False).forward(plan, cache.kv).logits
    got = K2Model(cfg, w, use_kernels=True).forward(plan, cache.kv).logits
    rel = float((got - ref).norm() / ref.norm())
    assert rel < BF16_REL, f"full-dimension logits differ by {rel:.3e} relative"


def test_graph_replay_matches_eager():
    """Plans of several sizes and sessions, padded into row buckets and replayed from CUDA graphs."""
    import random

    from verifier_service.graphs import GraphRunner
    from verifier_service.plan import tree_parents
    from verifier_service.synthetic import k26_config, random_target

    cfg = k26_config(2)
    w = random_target(cfg, experts=range(0, 55), heads=range(0, 10), seed=5)
    model = K2Model(cfg, w, use_kernels=True)
    cache = PagedKVCache(num_layers=2, width=cfg.kv_cache_width, num_pages=80, page_size=64,
                         dtype=torch.bfloat16, device="cuda")
    cache.kv.normal_()
    graphs = GraphRunner(model, cache, max_seqs=4, max_pages=40)
    t, rng = cache.table, random.Random(0)
    for sid, prefix in (("a", 300), ("b", 1000), ("c", 64)):
        t.open(sid)
        t.extend(sid, prefix)
    for sizes in ([1], [5], [17, 3], [40, 1, 9], [1, 1, 1]):
        seqs = []
        for sid, n in zip("abc", sizes):
            parents = [rng.randrange(i) for i in range(1, n)]
            seqs.append(SeqRows([rng.randrange(cfg.vocab_size) for _ in range(n)], tree_parents(parents),
                                t.length(sid), t.pages(sid), t.scratch(sid, n)))
        plan = build_plan(seqs, device="cuda")
        assert graphs.fits(plan)
        eager = model.forward(plan, cache.kv, (0, 1)).logits
        replay = graphs.forward(plan, (0, 1)).logits
        # Same padded inputs run eagerly: the replay must reproduce them (same kernels, same shapes).
        g = graphs.graphs[(next(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b >= plan.num_rows), (0, 1))]
        padded = model.forward(g.plan, cache.kv, (0, 1)).logits[: plan.num_rows]
        same = float((replay - padded).norm() / padded.norm())
        assert same < 1e-3, f"sizes {sizes}: replay vs eager on the padded plan {same:.3e} relative"
        # Padding changes the kernels' tiling (split-K, tokens per expert): bf16 noise only.
        rel = float((replay - eager).norm() / eager.norm())
        agree = float((replay.argmax(-1) == eager.argmax(-1)).float().mean())
        print(f"sizes {sizes}: padded vs unpadded {rel:.3e} relative, argmax agreement {agree:.2f}")
        assert rel < 5e-2 and agree >= 0.9, f"sizes {sizes}: padded vs unpadded {rel:.3e}, agreement {agree}"
    assert len(graphs.graphs) >= 4  # buckets 1, 8, 32, 64 were captured
