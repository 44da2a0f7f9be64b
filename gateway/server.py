"""Public `ddtree.v1.Generation` servicer: proto in, one call, proto out. Text lives in the gateway."""

from __future__ import annotations

import asyncio

from ddtree.v1 import generation_pb2 as pb
from ddtree.v1 import generation_pb2_grpc as pb_grpc
from gateway.config import GatewayConfig
from gateway.http_api import start_http
from gateway.pipeline import Gateway
from gateway.tokenizer import KimiTokenizer
from gateway.validation import check_cancel, check_token_ids, to_job
from service_kit import __version__
from service_kit.errors import InvalidArgument, Unavailable
from service_kit.logs import configure_logging, get_logger
from service_kit.server import Lifecycle, Service, run_server
from service_kit.tls import server_context, server_credentials as tls_server_credentials

log = get_logger("gateway")
SERVICE_NAME = "ddtree.v1.Generation"
FEATURES = ("ar", "chain", "ddtree", "sampling", "min_p", "penalties", "logit_bias", "logprobs", "prompt_logprobs",
            "stop_strings", "min_new_tokens", "chat", "spec_stats", "reasoning_text", "tool_calls", "tool_choice",
            "prefix_cache_usage", "response_format", "generate_unary", "detokenize", "cancel", "load")


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    async def Generate(self, request, context):
        job, timeout = await self._job(request, context)
        async for response in self.gateway.generate(job, timeout):
            yield response

    async def GenerateUnary(self, request, context):
        job, timeout = await self._job(request, context)
        return await self.gateway.generate_result(job, timeout)

    async def _job(self, request, context) -> tuple:
        """The validated job (off the event loop: templating and tokenizing a long prompt, or compiling a grammar,
        take milliseconds) and the seconds it may take (the call's deadline, else the configured default)."""
        job = await asyncio.to_thread(to_job, request, self.gateway.tokenizer, self.gateway.require_limits())
        remaining = context.time_remaining()
        return job, self.gateway.config.default_timeout_s if remaining is None else remaining

    async def Tokenize(self, request, context):
        tok = self.gateway.tokenizer
        kind = request.WhichOneof("input")
        if kind is None:
            raise InvalidArgument("input", "one of text or chat is required")
        if kind == "text":
            ids = tok.encode(request.text)
        else:
            if not request.chat.messages:
                raise InvalidArgument("chat.messages", "must not be empty")
            ids = tok.encode_chat([{"role": m.role, "content": m.content} for m in request.chat.messages])
        return pb.TokenizeResponse(token_ids=ids, tokens=[tok.decode([i]) for i in ids])

    async def Detokenize(self, request, context):
        tok = self.gateway.tokenizer
        check_token_ids(request.token_ids, tok.vocab_size, "token_ids")
        return pb.DetokenizeResponse(text=tok.decode(list(request.token_ids),
                                                     skip_special_tokens=request.skip_special_tokens))

    async def Cancel(self, request, context):
        return pb.CancelResponse(cancelled=await self.gateway.cancel(check_cancel(request)))

    async def GetLoad(self, request, context):
        return load(self.gateway, await self.gateway.verifier_info())

    async def GetServerInfo(self, request, context):
        if self.gateway.info is not None:
            await self.gateway.refresh_info()  # replica health, block size: live, not as at start-up
        return server_info(self.gateway)


def server_info(gateway: Gateway) -> pb.ServerInfo:
    info = gateway.info
    if info is None:
        raise Unavailable("gateway is not connected to a verifier yet")
    healthy = _healthy(info)
    return pb.ServerInfo(
        model_name=info.model_name, version=__version__, vocab_size=info.vocab_size,
        max_context_length=info.max_context_length, max_new_tokens_limit=info.max_new_tokens_limit,
        default_mode=info.default_mode, default_tree_budget=info.default_tree_budget,
        max_tree_budget=info.max_tree_budget, drafter_block_size=info.drafter_block_size,
        eos_token_ids=info.eos_token_ids,
        supported_features=FEATURES + (("openai_http", "anthropic_http") if gateway.config.http_port else ()),
        verifier_world_size=info.world_size, drafter_replicas=len(info.drafters),
        drafter_replicas_healthy=healthy, max_concurrent_requests=gateway.config.max_concurrent_requests)


def _healthy(info) -> int:
    """Drafter replicas the verifier reports healthy."""
    return sum(1 for d in info.drafters if d.state == "healthy")


def load(gateway: Gateway, info) -> pb.Load:
    """The public Load from the gateway's count and the verifier's GetInfo."""
    return pb.Load(running_requests=gateway.running, max_concurrent_requests=gateway.config.max_concurrent_requests,
                   live_sessions=info.live_sessions, kv_pages_total=info.pages_total, kv_pages_used=info.pages_used,
                   kv_pages_cached=info.pages_cached, drafter_replicas=len(info.drafters),
                   drafter_replicas_healthy=_healthy(info))


async def follow_verifier(gateway: Gateway, lifecycle: Lifecycle, period_s: float = 1.0) -> None:
    """Gateway readiness follows the verifier's: NOT_SERVING within ~period_s of it going away."""
    was = True
    while True:
        await asyncio.sleep(period_s)
        now = await gateway.verifier_serving()
        if now and not was:
            try:
                await gateway.connect(timeout_s=10)
            except Exception as e:  # keep following; the next period tries again
                log.warning("verifier_reconnect_failed", error=repr(e))
                continue
        if now != was:
            log.warning("verifier_health_changed", serving=now)
            await lifecycle.set_serving(now)
        was = now


def main(config: GatewayConfig) -> int:
    configure_logging("gateway", config.log_level, json=config.log_format == "json")
    tokenizer = KimiTokenizer.from_dir(config.model)
    tls = config.ssl_certfile != ""
    credentials = tls_server_credentials(config.ssl_certfile, config.ssl_keyfile) if tls else None
    ssl_context = server_context(config.ssl_certfile, config.ssl_keyfile) if tls else None

    async def run() -> None:
        gateway = Gateway(config, tokenizer)
        lifecycle = Lifecycle()
        tasks = []
        http = await start_http(gateway, lifecycle, config, ssl_context) if config.http_port else None

        async def warmup() -> None:
            await gateway.connect()
            tasks.append(asyncio.create_task(follow_verifier(gateway, lifecycle)))

        async def on_stop() -> None:
            for t in tasks:
                t.cancel()
            if http is not None:
                await http.cleanup()
            await gateway.channel.close()

        await run_server(config, [Service(pb_grpc.add_GenerationServicer_to_server, GenerationServicer(gateway),
                                          SERVICE_NAME)], lifecycle=lifecycle, warmup=warmup, on_stop=on_stop,
                         api_key=config.api_key, credentials=credentials)

    asyncio.run(run())
    return 0
