"""The drafter on a GPU: trees from the CUDA builder equal the torch top-K + host heap trees."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from drafter_service.engine import DraftMode, DrafterEngine, EngineOptions, Proposal, ProposeItem  # noqa: E402


@pytest.mark.parametrize("mode, budget", [(DraftMode.DDTREE, 16), (DraftMode.DDTREE, 64), (DraftMode.CHAIN, 8)])
def test_device_trees_equal_host_trees(tmp_path, mode, budget):
    from service_kit.tools import make_tiny

    d = make_tiny(tmp_path / "tiny")
    engines = {use: DrafterEngine.load(d / "drafter", d, device="cuda", dtype=torch.float32,
                                       options=EngineOptions(cache_bytes=64 << 20, window=1024, use_kernels=use))
               for use in (False, True)}
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
