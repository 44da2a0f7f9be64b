"""The verifier's model owner on one rank: loads this rank's slice of the target, allocates the paged
latent KV cache once, runs forwards and KV copies.

At world size N every rank holds its heads and experts (verifier_service/ranks.py); rank 0 sends each
op (forward plan, commit copy) to the others before running it, and they `apply` the same op, so the
collectives inside the forward line up and the replicated caches stay identical.
"""

from __future__ import annotations

import functools
import math

import torch

from service_kit.logs import get_logger
from verifier_service import ranks
from verifier_service.graphs import GraphRunner
from verifier_service.kv_cache import PagedKVCache
from verifier_service.model import ForwardOutput, K2Model, TargetWeights, identity
from verifier_service.model_config import K2Config
from verifier_service.expert_shard import ExpertShard
from verifier_service.plan import BatchPlan, PackedPlan, SeqRows, build_plan, chain_parents, packed_of, plan_to
from verifier_service.synthetic import preset_config, random_target
from verifier_service.weights import Split, expert_range, load_target_weights

log = get_logger("verifier.runner")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FORWARD, COPY = "forward", "copy"


def rank_device(config, rank: int) -> torch.device:
    if config.device.startswith("cuda"):
        gpus = config.gpus or tuple(range(config.world_size))
        return torch.device("cuda", gpus[rank])
    return torch.device(config.device)


class Runner:
    def __init__(self, config, info: ranks.RankInfo | None = None):
        self.info = info or ranks.RankInfo(0, 1, 0)
        self.cfg = (preset_config(config.synthetic, config.synthetic_layers) if config.synthetic
                    else K2Config.from_json(config.model))
        self.device = rank_device(config, self.info.rank)
        self.dtype = DTYPES[config.dtype]
        self.bind_thread()
        self.control = None
        if self.info.world_size > 1:
            self.control = ranks.Control(self.info, self.device, config.collective_timeout_s)
        world = self.info.world_size
        split = config.split_replicated and world > 1
        weights = self._weights(config, split)
        vocab_sizes = [len(ranks.split_rows(self.cfg.vocab_size, r, world)) for r in range(world)]
        peers = None if self.control is None else ranks.open_peers(
            self.control, self.device, config.one_shot_all_reduce_kb, config.collective_timeout_s)
        reduce = functools.partial(ranks.all_reduce, peers=peers) if world > 1 else identity
        self.model = K2Model(self.cfg, weights, all_reduce=reduce,
                             all_gather=ranks.all_gather_columns(vocab_sizes) if split else identity,
                             use_kernels=config.kernels and self.device.type == "cuda")
        self.weight_bytes = weight_nbytes(weights)
        self.cache = PagedKVCache.from_budget(
            config.kv_cache_mb * 2**20, num_layers=self.cfg.num_hidden_layers, width=self.cfg.kv_cache_width,
            page_size=config.page_size, dtype=self.dtype, device=self.device, prefix_cache=config.prefix_cache)
        self.kv_bytes = self.cache.kv.numel() * self.cache.kv.element_size()
        self.cache.use_kernel = (config.kernels and self.device.type == "cuda"
                                 and self.cfg.kv_cache_width * self.cache.kv.element_size() % 16 == 0)
        self.graphs = None
        if config.cuda_graphs and self.model.graph_safe(self.cache.kv):
            self.graphs = GraphRunner(self.model, self.cache, max_seqs=config.max_batch,
                                      max_pages=math.ceil(config.max_context / config.page_size) + 1)
        if self.control is not None and self.info.rank == 0:
            self.cache.on_copy = lambda src, dst: self.control.send((COPY, src, dst))
        self.target_layer_ids: tuple[int, ...] = ()  # set from the drafter's GetInfo
        mine = (self.info.rank, str(self.device), self.weight_bytes, self.kv_bytes)
        self.memory = self.control.gather(mine) if self.control is not None else [mine]
        log.info("rank_ready", rank=self.info.rank, world_size=self.info.world_size, device=str(self.device),
                 weight_bytes=self.weight_bytes, kv_pages=self.cache.table.num_pages, kv_bytes=self.kv_bytes)

    def _weights(self, config, split: bool) -> TargetWeights:
        rank, world = self.info.rank, self.info.world_size
        if not config.synthetic:
            return load_target_weights(config.model, self.cfg, dtype=self.dtype, device=self.device,
                                       ep_rank=rank, ep_size=world, split_replicated=split,
                                       expert_slices=config.expert_slices)
        # No checkpoint (benchmarks): this rank's experts and heads (and with `split`, its share of the
        # replicated parts) drawn on its device; every part is seeded by its name, so ranks agree.
        experts = (expert_range(self.cfg.n_routed_experts, rank, world) if config.expert_slices == 1
                   else ExpertShard(rank, world, config.expert_slices))
        heads = ranks.split_range(self.cfg.num_attention_heads, rank, world)
        return random_target(self.cfg, experts=experts, heads=heads, device=self.device, dtype=self.dtype,
                             split=Split(rank, world) if split else None)

    def forward(self, plan: BatchPlan) -> ForwardOutput:
        """Rank 0: broadcast the plan (its packed host buffer, or CPU tensors), then run it here. A host
        plan from build_plan is padded for a CUDA graph on the host or moved to the device in one copy."""
        if self.control is not None:
            packed = packed_of(plan)
            self.control.send((FORWARD, packed if packed is not None else plan_to(plan, "cpu"), self.target_layer_ids))
        return self._forward(plan, self.target_layer_ids)

    def warm_up(self, max_rows: int) -> int:
        """Capture the CUDA graphs of every row and session bucket up to `max_rows` at every page width
        (graphs.warm_keys) before serving, so no stream pays a capture (tens of ms each) mid-generation.
        Rank 0 runs padding-only plans through `forward`, so every rank captures the same graphs in the same
        order; returns how many graphs exist."""
        if self.graphs is None:
            return 0
        self.bind_thread()
        pad_slot = self.graphs.pad_slot
        pad_page = pad_slot // self.cache.page_size
        for rows, sessions, width in self.graphs.warm_keys(max_rows):  # rows write the pad slot, read no prefix
            sizes = [rows // sessions + (i < rows % sessions) for i in range(sessions)]
            seqs = [SeqRows([0] * n, chain_parents(n), 0, [pad_page] * width, [pad_slot] * n) for n in sizes]
            self.forward(build_plan(seqs, pin=self.device.type == "cuda"))
        self.cache.copy_rows([pad_slot], [pad_slot])  # the commit kernel compiles and loads now, not in step 1
        self.sync()
        return len(self.graphs.graphs)

    def bind_thread(self) -> None:
        """Make this rank's GPU the calling thread's current device (CUDA's current device is per thread):
        graph capture and the kernels use the current device's stream. Called by every thread that runs
        steps: __init__'s, warm-up's and the engine loop's."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def sync(self) -> None:
        """Wait for this rank's device (kernels and graph replays return before the GPU is done)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _forward(self, plan: BatchPlan, layer_ids) -> ForwardOutput:
        if self.graphs is not None and self.graphs.fits(plan):
            return self.graphs.forward(plan, layer_ids)
        return self.model.forward(plan_to(plan, self.device), self.cache.kv, layer_ids)

    def apply(self, op: tuple) -> None:
        """Ranks 1..N-1: replay one of rank 0's ops."""
        if op[0] == FORWARD:
            _, plan, layer_ids = op
            self._forward(plan.unpack("cpu") if isinstance(plan, PackedPlan) else plan, layer_ids)
        elif op[0] == COPY:
            self.cache.copy_rows(op[1], op[2])
        else:
            raise ValueError(f"unknown op {op[0]!r}")

    def shutdown(self) -> None:
        if self.control is not None:
            if self.info.rank == 0:
                self.control.send((ranks.STOP,))
            self.control.close()


def weight_nbytes(obj) -> int:
    """Bytes held by the tensors reachable from a (nested) dataclass of weights: each storage once, so views
    (a fused projection's row blocks, tied embeddings) are not counted again."""
    seen, total, stack = set(), 0, [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif hasattr(x, "__dataclass_fields__"):
            stack.extend(getattr(x, f) for f in x.__dataclass_fields__)
    return total
