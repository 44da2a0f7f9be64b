"""The gateway's OpenAI-compatible HTTP surface (aiohttp, in the gRPC server's event loop, over the same
`Gateway`): POST /v1/chat/completions and /v1/completions (JSON, or server-sent events with `stream`),
GET /v1/models, POST /tokenize and /detokenize (vLLM's), GET /health (200 when serving, else 503) and
GET /metrics (Prometheus, as on --metrics-port); the last two need no token, as vLLM's do not. Anthropic's
POST /v1/messages and /v1/messages/count_tokens are served beside them (gateway/anthropic_http.py).

Handlers are thin: JSON → GenerateRequest (gateway/openai_api.py) → the same validation, admission and
pipeline as gRPC `Generate` → JSON. Errors are OpenAI's shape, `{"error": {"message", "type", "param",
"code"}}`, with the gRPC status mapped to HTTP (400, 401, 404, 429, 503, 504; 500 for anything else).
The first message is awaited before any byte is sent, so admission and verifier errors keep their status;
an error after that ends the event stream with one `{"error": ...}` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import grpc
import prometheus_client
import structlog
from aiohttp import web

from ddtree.v1 import generation_pb2 as pb
from gateway.config import GatewayConfig
from gateway.openai_api import chat_request, choice_count, completion_request, echo_flags, openai_param, stream_flags
from gateway.openai_response import OpenAIResponse, merged_response, usage_event
from gateway.pipeline import Gateway
from gateway.validation import check_token_ids, choice_jobs, prompt_ids, to_job
from service_kit import trace_context
from service_kit.auth import UNAUTHENTICATED_MESSAGE, bearer_ok, key_ok
from service_kit.errors import InvalidArgument, NotFound, ServiceError, Unavailable
from service_kit.logs import get_logger
from service_kit.server import Lifecycle

log = get_logger("gateway.http")
HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
               grpc.StatusCode.OUT_OF_RANGE: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
               grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
               grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504}
OPEN_PATHS = ("/health", "/metrics")  # probed by orchestrators and scrapers
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               429: "rate_limit_error", 503: "service_unavailable_error", 504: "timeout_error"}


ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                         429: "rate_limit_error", 503: "overloaded_error"}


def error_body(e: ServiceError, anthropic: bool = False) -> tuple[int, dict]:
    status = HTTP_STATUS.get(e.code, 500)
    if anthropic:  # the /v1/messages surface
        return status, {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"),
                                                   "message": e.message}}
    return status, {"error": {"message": e.message, "type": ERROR_TYPES.get(status, "internal_error"),
                              "param": e.field, "code": e.code.name.lower()}}


def error_response(e: ServiceError, anthropic: bool = False) -> web.Response:
    status, body = error_body(e, anthropic)
    headers = {"Retry-After": "1"} if status in (429, 503) else None  # both clear up on their own
    return web.json_response(body, status=status, headers=headers)


def make_middleware(api_key: str):
    @web.middleware
    async def middleware(request: web.Request, handler):
        """The key (all but OPEN_PATHS; a bearer token, or Anthropic's `x-api-key`), then ServiceError → the
        surface's error JSON, anything else → 500."""
        anthropic = request.path.startswith("/v1/messages")
        if request.path not in OPEN_PATHS and not (bearer_ok(request.headers.get("Authorization"), api_key) or (
                anthropic and key_ok(request.headers.get("x-api-key"), api_key))):
            return error_response(ServiceError(UNAUTHENTICATED_MESSAGE, grpc.StatusCode.UNAUTHENTICATED), anthropic)
        try:
            return await handler(request)
        except ServiceError as e:
            return error_response(e, anthropic)
        except web.HTTPException:
            raise
        except Exception as e:
            log.exception("http_request_failed", path=request.path)
            return error_response(ServiceError(f"internal error: {type(e).__name__}: {e}"), anthropic)
    return middleware


def sse(event: dict | str) -> bytes:
    return f"data: {event if isinstance(event, str) else json.dumps(event, separators=(',', ':'))}\n\n".encode()


class Handlers:
    def __init__(self, gateway: Gateway, lifecycle: Lifecycle):
        self.gateway, self.lifecycle = gateway, lifecycle

    async def health(self, request: web.Request) -> web.Response:
        ok = self.lifecycle.serving and not self.lifecycle.draining
        return web.Response(status=200 if ok else 503, text="ok" if ok else "not serving")

    def _info(self):
        if self.gateway.info is None:
            raise Unavailable("gateway is not connected to a verifier yet")
        return self.gateway.info

    def _model_name(self) -> str:
        return self.gateway.config.served_model_name or self._info().model_name

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=prometheus_client.generate_latest(),
                            headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        name = self._model_name()
        return web.json_response({"object": "list", "data": [{
            "id": name, "object": "model", "created": 0, "owned_by": "ddtree-serve",
            "max_model_len": self._info().max_context_length}]})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: `prompt` (text or ids) or `messages` (through the chat template, tools included),
        tokenized exactly as a generation's prompt is."""
        body = await _json_object(request)
        chat = "messages" in body
        req = chat_request(body) if chat else completion_request(body)
        with _openai_names(body, chat):
            ids = prompt_ids(req, self.gateway.tokenizer)
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": self._info().max_context_length})

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: `tokens` (ids) → `prompt` (text, special tokens kept)."""
        ids = (await _json_object(request)).get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidArgument("tokens", "must be a list of token ids")
        check_token_ids(ids, self.gateway.tokenizer.vocab_size, "tokens")
        return web.json_response({"prompt": self.gateway.tokenizer.decode(ids)})

    def served_model(self, body: dict) -> str:
        """The served model's name; NOT_FOUND when the body asks for another."""
        model = self._model_name()
        if body.get("model") not in (None, model):
            raise NotFound(f"model: {body['model']!r} is not served here (this gateway serves {model!r})",
                           field="model")
        return model

    async def json_body(self, request: web.Request) -> dict:
        return await _json_object(request)

    async def anthropic_messages(self, request: web.Request) -> web.StreamResponse:
        from gateway import anthropic_http  # it builds on this module
        return await anthropic_http.messages(self, request)

    async def anthropic_count_tokens(self, request: web.Request) -> web.Response:
        from gateway import anthropic_http
        return await anthropic_http.count_tokens(self, request)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await _json_object(request)
        model = self.served_model(body)
        req = chat_request(body) if chat else completion_request(body)
        stream, usage = stream_flags(body)
        n = choice_count(body)
        req.request_id = request.headers.get("X-Request-Id", "")
        with _openai_names(body, chat):
            job = await asyncio.to_thread(to_job, req, self.gateway.tokenizer, self.gateway.require_limits())
        if self.lifecycle.draining:
            raise Unavailable("server is draining")
        request_id = job.request.request_id
        echo, prompt_only = (False, False) if chat else echo_flags(body)
        ids = list(job.request.prompt_ids)
        echoed = (ids, req.text if req.WhichOneof("input") == "text" else self.gateway.tokenizer.decode(ids))
        outs = [OpenAIResponse(chat, request_id, model, self.gateway.tokenizer, req.return_logprobs, index=i,
                               echo=echoed if echo else None, prompt_only=prompt_only) for i in range(n)]
        self.lifecycle.enter()
        try:
            timeout = self.gateway.config.default_timeout_s
            generations = [self.gateway.generate(j, timeout) for j in choice_jobs(job, n)]
            with (trace_context.span(request.headers.get(trace_context.HEADER)),
                  structlog.contextvars.bound_contextvars(request_id=request_id, method=request.path)):
                return await _respond(request, outs, generations, stream, usage)
        finally:
            self.lifecycle.exit()


async def _respond(request: web.Request, outs: list[OpenAIResponse], generations: list, stream: bool,
                   include_usage: bool) -> web.StreamResponse:
    async with contextlib.AsyncExitStack() as stack:
        msgs = [await stack.enter_async_context(contextlib.aclosing(g)) for g in generations]
        # Admission and verifier errors surface here, before any byte. The first choice's first message means its
        # prompt is prefilled and its full pages are in the verifier's prefix cache: the other choices start then
        # and prefill only the rest (together, they would each prefill the whole prompt in the same steps).
        firsts = [await _first(msgs[0])]
        firsts += await _each([_first(m) for m in msgs[1:]])
        if any(first is None for first in firsts):
            raise Unavailable("verifier stream ended without a message")
        if stream:
            return await _stream(request, outs, firsts, msgs, include_usage)
        await _each([_collect(out, first, m) for out, first, m in zip(outs, firsts, msgs)])
        return web.json_response(merged_response(outs), headers={"X-Request-Id": outs[0].request_id})


async def _first(msgs) -> pb.GenerateResponse | None:
    return await anext(msgs, None)


async def _collect(out: OpenAIResponse, first: pb.GenerateResponse, msgs) -> None:
    out.add(first)
    async for msg in msgs:
        out.add(msg)


async def _each(coroutines: list) -> list:
    """Runs them concurrently; the first failure cancels the rest and is raised as itself (not a group)."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in coroutines]
    except BaseExceptionGroup as group:
        errors = [e for e in group.exceptions if not isinstance(e, asyncio.CancelledError)] or group.exceptions
        raise next((e for e in errors if isinstance(e, ServiceError)), errors[0]) from None
    return [t.result() for t in tasks]


@contextlib.contextmanager
def _openai_names(body: dict, chat: bool):
    """The shared validation names proto fields; the HTTP client is told the parameter it sent."""
    try:
        yield
    except InvalidArgument as e:
        raise InvalidArgument(openai_param(e.field, body, chat), e.detail) from e


async def _json_object(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidArgument("body", f"not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise InvalidArgument("body", "must be a JSON object")
    return body


async def _stream(request: web.Request, outs: list[OpenAIResponse], firsts: list, msgs: list,
                  include_usage: bool) -> web.StreamResponse:
    """Server-sent events, the choices' events as they come; a client that goes away ends the generations (the
    pipeline cancels a verifier call when its `msgs` is closed)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Request-Id": outs[0].request_id})
    await resp.prepare(request)
    events: asyncio.Queue = asyncio.Queue()

    async def relay(out: OpenAIResponse, msg: pb.GenerateResponse | None, rest) -> None:
        while msg is not None:
            await events.put(out.end(msg.final) if msg.HasField("final") else out.chunk(msg.chunk))
            msg = await anext(rest, None)

    async def write_until_done(relays) -> None:
        while not all(r.done() for r in relays) or not events.empty():
            event = await events.get()
            if event is not None:
                await resp.write(sse(event))

    try:
        for out in outs:
            start = out.start()
            if start is not None:
                await resp.write(sse(start))
        async with asyncio.TaskGroup() as group:
            relays = [group.create_task(relay(*args)) for args in zip(outs, firsts, msgs)]
            for r in relays:
                r.add_done_callback(lambda _: events.put_nowait(None))  # wakes the writer at each end
            await write_until_done(relays)
        if include_usage:
            await resp.write(sse(usage_event(outs)))
        await resp.write(sse("[DONE]"))
    except BaseExceptionGroup as group:
        await _stream_error(resp, outs[0], group.exceptions[0])
    except Exception as e:
        await _stream_error(resp, outs[0], e)
    return resp


async def _stream_error(resp: web.StreamResponse, out: OpenAIResponse, e: BaseException) -> None:
    """The status line is gone: an error becomes the stream's last event (a client that left gets nothing)."""
    if isinstance(e, ConnectionResetError):
        log.info("http_client_gone", request_id=out.request_id)
        return
    if not isinstance(e, ServiceError):
        log.error("http_stream_failed", request_id=out.request_id, error=f"{type(e).__name__}: {e}")
        e = ServiceError(f"internal error: {type(e).__name__}: {e}")
    with contextlib.suppress(ConnectionResetError):
        await resp.write(sse(error_body(e)[1]))


def build_app(gateway: Gateway, lifecycle: Lifecycle, config: GatewayConfig) -> web.Application:
    app = web.Application(middlewares=[make_middleware(config.api_key)],
                          client_max_size=config.max_message_mb * 1024 * 1024)
    h = Handlers(gateway, lifecycle)
    app.router.add_post("/v1/chat/completions", h.chat)
    app.router.add_post("/v1/completions", h.completions)
    app.router.add_get("/v1/models", h.models)
    app.router.add_post("/v1/messages", h.anthropic_messages)
    app.router.add_post("/v1/messages/count_tokens", h.anthropic_count_tokens)
    app.router.add_post("/tokenize", h.tokenize)
    app.router.add_post("/detokenize", h.detokenize)
    app.router.add_get("/health", h.health)
    app.router.add_get("/metrics", h.metrics)
    return app


async def start_http(gateway: Gateway, lifecycle: Lifecycle, config: GatewayConfig,
                     ssl_context=None) -> web.AppRunner:
    """Binds config.http_port; `await runner.cleanup()` stops it. A client that disconnects cancels its
    handler (handler_cancellation), and with it the verifier call."""
    runner = web.AppRunner(build_app(gateway, lifecycle, config), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.http_port, ssl_context=ssl_context).start()
    log.info("http_listening", port=config.http_port, tls=ssl_context is not None)
    return runner
