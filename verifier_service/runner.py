"""The verifier's model owner: loads the target, allocates the paged latent KV cache once, runs forwards.

World size 1 here; the SPMD ranks of issue 6 hang off this class (rank 0 broadcasts each plan).
"""

from __future__ import annotations

import torch

from service_kit.logs import get_logger
from verifier_service.kv_cache import PagedKVCache
from verifier_service.model import ForwardOutput, K2Model
from verifier_service.model_config import K2Config
from verifier_service.plan import BatchPlan
from verifier_service.weights import load_target_weights

log = get_logger("verifier.runner")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Runner:
    def __init__(self, config):
        self.cfg = K2Config.from_json(config.model)
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        weights = load_target_weights(config.model, self.cfg, dtype=self.dtype, device=self.device)
        self.model = K2Model(self.cfg, weights)
        self.weight_bytes = _nbytes(weights)
        self.cache = PagedKVCache.from_budget(
            config.kv_cache_mb * 2**20, num_layers=self.cfg.num_hidden_layers, width=self.cfg.kv_cache_width,
            page_size=config.page_size, dtype=self.dtype, device=self.device)
        self.target_layer_ids: tuple[int, ...] = ()  # set from the drafter's GetInfo
        log.info("model_ready", layers=self.cfg.num_hidden_layers, weight_bytes=self.weight_bytes,
                 kv_pages=self.cache.table.num_pages, kv_bytes=self.cache.kv.numel() * self.cache.kv.element_size())

    def forward(self, plan: BatchPlan) -> ForwardOutput:
        return self.model.forward(plan, self.cache.kv, self.target_layer_ids)


def _nbytes(obj) -> int:
    """Bytes of every tensor reachable from a (nested) dataclass of weights, shared tensors once."""
    seen, total, stack = set(), 0, [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            if x.data_ptr() not in seen:
                seen.add(x.data_ptr())
                total += x.numel() * x.element_size()
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif hasattr(x, "__dataclass_fields__"):
            stack.extend(getattr(x, f) for f in x.__dataclass_fields__)
    return total
