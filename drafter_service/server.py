"""`ddtree.internal.v1.Drafter` servicer: proto in, one engine call, proto out.

Propose runs the engine inline on the event loop. A draft is ~1 ms of GPU work and the verifier
waits for it; handing it to a worker thread (asyncio.to_thread) measured 0.5 ms more per call on
loopback, a third of the whole step budget of a small target. Health checks and GetInfo wait at most
one Propose (a reset's inject of a full window: tens of ms).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from ddtree.internal.v1 import drafter_pb2 as dpb
from ddtree.internal.v1 import drafter_pb2_grpc as dpb_grpc
from drafter_service.config import DrafterConfig
from drafter_service.engine import (DraftMode, DrafterEngine, EngineOptions, ItemError, Proposal, ProposeItem,
                                    UnknownSessionError)
from drafter_service.int8 import quantize_drafter
from drafter_service.metrics import PROPOSE_SECONDS
from drafter_service.propose_socket import ProposeSocketServer
from drafter_service.weights import load_drafter
from service_kit import busy_poll
from service_kit.config import limit_torch_threads
from service_kit.errors import InvalidArgument, ServiceError, Unavailable
from service_kit.logs import configure_logging, get_logger
from service_kit.server import Service, run_server
from service_kit.tensors import from_proto

log = get_logger("drafter")
SERVICE_NAME = "ddtree.internal.v1.Drafter"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_MODES = {dpb.DRAFT_MODE_UNSPECIFIED: DraftMode.DDTREE, dpb.DRAFT_MODE_CHAIN: DraftMode.CHAIN,
          dpb.DRAFT_MODE_DDTREE: DraftMode.DDTREE}


def item_from_proto(i: int, msg: dpb.ProposeItem) -> ProposeItem | ItemError:
    """Wire decoding errors (bad tensor bytes, unknown mode) become this item's error only."""
    try:
        # Read-only rows (one copy less): the engine only reads features (validate, inject's copy to the device).
        features = from_proto(msg.features, f"items[{i}].features", writable=False)
    except ServiceError as e:
        return ItemError(msg.session_id, "features", e.message)
    if msg.mode not in _MODES:
        return ItemError(msg.session_id, "mode", f"unknown draft mode {msg.mode}")
    return ProposeItem(session_id=msg.session_id, start_position=msg.start_position, features=features,
                       root_token=msg.root_token, tree_budget=msg.tree_budget, mode=_MODES[msg.mode],
                       return_draft_logprobs=msg.return_draft_logprobs, reset=msg.reset)


def result_to_proto(r) -> dpb.ProposeResult:
    if isinstance(r, ItemError):
        return dpb.ProposeResult(session_id=r.session_id, error=dpb.ItemError(field=r.field, message=r.message))
    if not isinstance(r, Proposal):
        return dpb.ProposeResult(session_id=r.session_id, resync_required=dpb.ResyncRequired(cache_length=r.cache_len))
    out = dpb.ProposeResult(session_id=r.session_id, tree=dpb.DraftTree(
        tokens=r.tree.tokens.tolist(), parents=r.tree.parents.tolist(), depths=r.tree.depths.tolist(),
        logprobs=r.tree.logprobs.tolist()))
    if r.topk_ids is not None:
        out.draft_logprobs.k = r.topk_ids.shape[1]
        out.draft_logprobs.token_ids.extend(r.topk_ids.reshape(-1).tolist())
        out.draft_logprobs.logprobs.extend(r.topk_logprobs.reshape(-1).tolist())
    return out


class DrafterServicer(dpb_grpc.DrafterServicer):
    def __init__(self):
        self.engine: DrafterEngine | None = None
        self.propose_port = 0  # the framed Propose port once it listens (GetInfo advertises it)

    def _engine(self) -> DrafterEngine:
        if self.engine is None:
            raise Unavailable("drafter is still loading")
        return self.engine

    async def Propose(self, request, context):
        return self.propose(request)

    async def ProposeStream(self, request_iterator, context):
        async for request in request_iterator:
            yield self.propose(request)

    def propose(self, request: dpb.ProposeRequest) -> dpb.ProposeResponse:
        """One ProposeRequest answered (both transports: the RPCs and the framed port)."""
        engine = self._engine()
        with PROPOSE_SECONDS.labels("decode").time():
            decoded = [item_from_proto(i, m) for i, m in enumerate(request.items)]
            items = [d for d in decoded if isinstance(d, ProposeItem)]
        with PROPOSE_SECONDS.labels("draft").time():
            done = iter(engine.propose(items))
        with PROPOSE_SECONDS.labels("encode").time():
            results = [d if isinstance(d, ItemError) else next(done) for d in decoded]
            return dpb.ProposeResponse(results=[result_to_proto(r) for r in results])

    async def Release(self, request, context):
        try:
            self._engine().release(request.session_id)
        except UnknownSessionError:
            raise InvalidArgument("session_id", f"unknown session {request.session_id!r}") from None
        return dpb.ReleaseResponse()

    async def GetInfo(self, request, context):
        i = self._engine().info()
        return dpb.DrafterInfo(
            block_size=i.block_size, target_layer_ids=list(i.target_layer_ids), mask_token_id=i.mask_token_id,
            target_hidden_size=i.target_hidden_size, hidden_size=i.hidden_size, vocab_size=i.vocab_size,
            max_tree_budget=i.max_tree_budget, sessions=i.sessions, cache_bytes_used=i.bytes_used,
            cache_bytes_budget=i.bytes_total, window=i.window or 0, model_name=i.model_name,
            propose_port=self.propose_port)


def load_engine(config: DrafterConfig) -> DrafterEngine:
    options = EngineOptions(cache_bytes=config.cache_mb * 2**20, window=config.window or None,
                            max_tree_budget=config.max_tree_budget, use_kernels=config.kernels,
                            cuda_graphs=config.cuda_graphs)
    if config.synthetic:  # benchmarks without checkpoints: random weights drawn on the device
        from drafter_service.synthetic import random_drafter

        model = random_drafter(config.synthetic, target_layers=config.synthetic_layers, device=config.device,
                               dtype=DTYPES[config.dtype])
        name = f"synthetic-{config.synthetic}"
    else:
        model, name = load_drafter(config.model, config.target_model, device=config.device,
                                   dtype=DTYPES[config.dtype]), Path(config.model).name
    if config.quantization == "int8":
        quantize_drafter(model)
    return DrafterEngine(model, options, name=name)


def main(config: DrafterConfig) -> int:
    configure_logging("drafter", config.log_level, json=config.log_format == "json")
    limit_torch_threads(config.device, config.torch_threads)
    servicer = DrafterServicer()
    framed = ProposeSocketServer(servicer.propose, config.max_message_mb * 2**20)

    async def warmup() -> None:
        engine = await asyncio.to_thread(load_engine, config)
        graphs = await asyncio.to_thread(engine.warm_up)
        servicer.engine = engine
        if config.propose_port >= 0:  # listens once the engine can answer
            servicer.propose_port = await framed.start(config.host, config.propose_port)
        log.info("drafter_graphs", captured=graphs)
        log.info("drafter_ready", propose_port=servicer.propose_port,
                 **{k: str(v) for k, v in vars(servicer.engine.info()).items()})

    services = [Service(dpb_grpc.add_DrafterServicer_to_server, servicer, SERVICE_NAME)]
    busy_poll.run(run_server(config, services, warmup=warmup, on_stop=framed.close),
                  busy_poll.auto_ms(config.busy_poll_ms, config.device))
    return 0
