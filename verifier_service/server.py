"""`ddtree.internal.v1.Verifier` servicer: proto in, one engine call, proto out."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time

import grpc

from ddtree.internal.v1 import drafter_pb2 as dpb
from ddtree.internal.v1 import verifier_pb2 as vpb
from ddtree.internal.v1 import verifier_pb2_grpc as vpb_grpc
from ddtree.v1 import generation_pb2 as pb
from service_kit.config import limit_torch_threads
from service_kit.errors import InvalidArgument, ServiceError, Unavailable
from service_kit.logs import configure_logging, get_logger
from service_kit.server import Service, run_server
from verifier_service import ranks
from verifier_service.config import VerifierConfig
from verifier_service.grammar import Constraint
from verifier_service.requests import to_params, validate
from verifier_service.session import Emission, Session

log = get_logger("verifier")
SERVICE_NAME = "ddtree.internal.v1.Verifier"
_MODE_PB = {"ar": pb.SPEC_MODE_AR, "chain": pb.SPEC_MODE_CHAIN, "ddtree": pb.SPEC_MODE_DDTREE}


class VerifierServicer(vpb_grpc.VerifierServicer):
    def __init__(self, engine, config: VerifierConfig):
        self.engine = engine
        self.config = config

    async def Generate(self, request, context):
        if self.engine is None:
            raise Unavailable("verifier is still loading")
        validate(request, self.engine.runner.cfg, self.config)
        if self.engine.is_live(request.request_id):
            raise InvalidArgument("request_id", f"{request.request_id!r} is already generating")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Emission] = asyncio.Queue()
        session = Session(request.request_id, list(request.prompt_ids), to_params(request, self.config),
                          emit=lambda e: loop.call_soon_threadsafe(queue.put_nowait, e),
                          window=self.config.feature_window)
        session.features_on = bool(self.engine.runner.target_layer_ids)
        if request.grammar:  # compiling a grammar may take a while (it releases the GIL): off the event loop
            after = request.grammar_after_id if request.HasField("grammar_after_id") else None
            session.constraint = await loop.run_in_executor(None, Constraint, self.engine.vocabulary,
                                                            request.grammar, after)
        self.engine.submit(session)
        try:
            while True:
                e = await queue.get()
                if e.error is not None:
                    raise ServiceError(e.error, getattr(grpc.StatusCode, e.error_code))
                if e.finish_reason is not None:
                    final = _final(session, e, self.engine.block_size)
                    _log_finished(session, final)
                    yield vpb.VerifierGenerateResponse(final=final)
                    return
                yield vpb.VerifierGenerateResponse(chunk=vpb.TokenChunk(
                    token_ids=e.token_ids, logprobs=e.logprobs, num_verify_steps=e.verify_steps,
                    top_logprobs=[pb.TopLogprobs(token_ids=i, logprobs=v) for i, v in e.top_logprobs],
                    prompt_logprobs=e.prompt_logprobs,
                    prompt_top_logprobs=[pb.TopLogprobs(token_ids=i, logprobs=v) for i, v in e.prompt_top_logprobs]))
        finally:
            if not session.finished:
                self.engine.cancel(session.id)  # client gone or deadline: free pages within one step

    async def Cancel(self, request, context):
        return vpb.CancelResponse(found=self.engine.cancel(request.request_id))

    async def GetInfo(self, request, context):
        if self.engine is None:
            raise Unavailable("verifier is still loading")
        return info(self.engine, self.config)


def _final(s: Session, e: Emission, block_size: int) -> vpb.VerifierFinal:
    phases = s.phase_seconds(time.monotonic())
    f = vpb.VerifierFinal(finish_reason=e.finish_reason, prompt_tokens=len(s.prompt),
                          completion_tokens=s.emitted, spec_stats=s.spec_stats(block_size),
                          cached_prompt_tokens=s.cached_tokens,
                          timing=pb.Timing(**{f"{phase}_s": v for phase, v in phases.items()}))
    if e.matched_stop_token_id is not None:
        f.matched_stop_token_id = e.matched_stop_token_id
    return f


def _log_finished(s: Session, f: vpb.VerifierFinal) -> None:
    """The session's summary line (its trace_id and span_id come from the log context of its Generate call)."""
    st = f.spec_stats
    log.info("session_finished", request_id=s.id, finish_reason=pb.FinishReason.Name(f.finish_reason),
             prompt_tokens=f.prompt_tokens, cached_prompt_tokens=f.cached_prompt_tokens,
             completion_tokens=f.completion_tokens, mode=pb.SpecMode.Name(st.mode), verify_steps=st.verify_steps,
             draft_unavailable_steps=st.draft_unavailable_steps,
             mean_acceptance_length=round(st.mean_acceptance_length, 3), queue_s=round(f.timing.queue_s, 4),
             prefill_s=round(f.timing.prefill_s, 4), decode_s=round(f.timing.decode_s, 4))


def info(engine, config: VerifierConfig) -> vpb.VerifierInfo:
    cfg, runner = engine.runner.cfg, engine.runner
    table = engine.table
    drafters = engine.drafting.client.states() if engine.drafting else []
    return vpb.VerifierInfo(
        model_name=model_name(config), vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers, n_routed_experts=cfg.n_routed_experts,
        num_experts_per_tok=cfg.num_experts_per_tok, kv_lora_rank=cfg.kv_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim, max_context_length=max_context(engine, config),
        max_new_tokens_limit=config.max_new_tokens_limit, default_mode=_MODE_PB[config.default_mode],
        default_tree_budget=config.default_tree_budget, max_tree_budget=config.max_tree_budget,
        drafter_block_size=engine.block_size, eos_token_ids=list(cfg.eos_token_id),
        pages_total=table.num_pages, pages_used=table.num_pages - table.num_free, page_size=table.page_size,
        pages_cached=len(table.prefix.idle) if table.prefix is not None else 0,
        live_sessions=engine.live_sessions, world_size=config.world_size, device=config.device, dtype=config.dtype,
        drafters=[vpb.DrafterReplica(address=a, state=s, sessions=n) for a, s, n in drafters],
        memory=[vpb.RankMemory(rank=r, device=d, weight_bytes=w, kv_cache_bytes=k) for r, d, w, k in runner.memory])


def model_name(config: VerifierConfig) -> str:
    return f"synthetic-{config.synthetic}" if config.synthetic else config.model.rstrip("/").split("/")[-1]


def max_context(engine, config: VerifierConfig) -> int:
    return min(config.max_context, engine.runner.cfg.max_position_embeddings)


def fetch_drafter_layout(engine, done: threading.Event) -> None:
    """Ask a drafter replica which target layers it reads (and its block size); sets the runner's
    feature layers. Until an answer comes, new sessions decode plain AR."""
    while engine.drafting and not done.is_set():
        for r in engine.drafting.client.replicas.values():
            try:
                di = r.stub.GetInfo(dpb.GetDrafterInfoRequest(), timeout=2)
            except Exception:
                continue
            engine.runner.target_layer_ids = tuple(di.target_layer_ids)
            engine.block_size = di.block_size
            log.info("drafter_layout", replica=r.address, target_layer_ids=list(di.target_layer_ids),
                     block_size=di.block_size)
            done.set()
            return
        time.sleep(1.0)


def die(engine, workers, why: str) -> None:
    """A rank is gone: fail every stream with UNAVAILABLE, stop the other ranks, exit (no hanging)."""
    log.error("verifier_rank_lost", reason=why)
    engine.fail_all(f"verifier down: {why}")
    time.sleep(1.0)  # let the failed streams reach their clients
    for p in workers:
        p.kill()
    os._exit(1)


def main(config: VerifierConfig) -> int:
    configure_logging("verifier", config.log_level, json=config.log_format == "json")
    limit_torch_threads(config.device, config.torch_threads)
    from verifier_service.engine import build_engine

    info, workers = ranks.start_ranks(config, sys.argv[1:])
    if info is not None and info.rank > 0:
        ranks.exit_process(ranks.run_worker(config, info))

    async def run() -> None:
        holder = {}

        async def warmup() -> None:
            engine = await asyncio.to_thread(build_engine, config, info)
            ranks.watch_workers(workers, lambda why: die(engine, workers, why))
            if config.world_size > 1:
                engine.on_fatal = lambda why: die(engine, workers, why)
            holder["engine"] = engine
            servicer.engine = engine
            if engine.drafting:  # without drafters there is no layout to wait for (plain AR)
                found = threading.Event()
                threading.Thread(target=fetch_drafter_layout, args=(engine, found), daemon=True).start()
                await asyncio.to_thread(found.wait, 30.0)  # start without drafts if no drafter answers yet
            # Every rank captures the same graphs in the same order (rank 0 drives them through `forward`).
            graphs = await asyncio.to_thread(engine.runner.warm_up, config.max_tree_budget + 1)
            log.info("verifier_graphs", captured=graphs, layer_ids=list(engine.runner.target_layer_ids))
            engine.start()

        async def on_stop() -> None:
            if "engine" in holder:
                holder["engine"].stop()
                holder["engine"].runner.shutdown()  # stops the other ranks' loops
            for p in workers:
                p.wait(timeout=30)

        servicer = VerifierServicer(None, config)
        await run_server(config, [Service(vpb_grpc.add_VerifierServicer_to_server, servicer, SERVICE_NAME)],
                         warmup=warmup, on_stop=on_stop)

    asyncio.run(run())
    if info is not None:  # several ranks: leave without NCCL teardown (ranks.Control.close)
        ranks.exit_process(0)
    return 0
