"""The gateway's OpenAI-compatible HTTP surface (aiohttp, in the gRPC server's event loop, over the same
`Gateway`): POST /v1/chat/completions and /v1/completions (JSON, or server-sent events with `stream`),
GET /v1/models, POST /tokenize and /detokenize (vLLM's), GET /health (200 when serving, else 503) and
GET /metrics (Prometheus, as on --metrics-port); the last two need no token, as vLLM's do not.

Handlers are thin: JSON → GenerateRequest (gateway/openai_api.py) → the same validation, admission and
pipeline as gRPC `Generate` → JSON. Errors are OpenAI's shape, `{"error": {"message", "type", "param",
"code"}}`, with the gRPC status mapped to HTTP (400, 401, 404, 429, 503, 504; 500 for anything else).
The first message is awaited before any byte is sent, so admission and verifier errors keep their status;
an error after that ends the event stream with one `{"error": ...}` event.
"""

from __future__ import annotations

import contextlib
import json

import grpc
import prometheus_client
import structlog
from aiohttp import web

from ddtree.v1 import generation_pb2 as pb
from gateway.config import GatewayConfig
from gateway.openai_api import chat_request, completion_request, openai_param, stream_flags
from gateway.openai_response import OpenAIResponse
from gateway.pipeline import Gateway
from gateway.validation import prompt_ids, to_job
from service_kit.auth import UNAUTHENTICATED_MESSAGE, bearer_ok
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


def error_body(e: ServiceError) -> tuple[int, dict]:
    status = HTTP_STATUS.get(e.code, 500)
    return status, {"error": {"message": e.message, "type": ERROR_TYPES.get(status, "internal_error"),
                              "param": e.field, "code": e.code.name.lower()}}


def error_response(e: ServiceError) -> web.Response:
    status, body = error_body(e)
    headers = {"Retry-After": "1"} if status in (429, 503) else None  # both clear up on their own
    return web.json_response(body, status=status, headers=headers)


def make_middleware(api_key: str):
    @web.middleware
    async def middleware(request: web.Request, handler):
        """The bearer token (all but OPEN_PATHS), then ServiceError → OpenAI error JSON, anything else → 500."""
        if request.path not in OPEN_PATHS and not bearer_ok(request.headers.get("Authorization"), api_key):
            return error_response(ServiceError(UNAUTHENTICATED_MESSAGE, grpc.StatusCode.UNAUTHENTICATED))
        try:
            return await handler(request)
        except ServiceError as e:
            return error_response(e)
        except web.HTTPException:
            raise
        except Exception as e:
            log.exception("http_request_failed", path=request.path)
            return error_response(ServiceError(f"internal error: {type(e).__name__}: {e}"))
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
        vocab = self.gateway.tokenizer.vocab_size
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidArgument("tokens", "must be a list of token ids")
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgument(f"tokens[{bad}]", f"{ids[bad]} is outside [0, {vocab})")
        return web.json_response({"prompt": self.gateway.tokenizer.decode(ids)})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await _json_object(request)
        model = self._model_name()
        if body.get("model") not in (None, model):
            raise NotFound(f"model: {body['model']!r} is not served here (this gateway serves {model!r})",
                           field="model")
        req = chat_request(body) if chat else completion_request(body)
        stream, usage = stream_flags(body)
        req.request_id = request.headers.get("X-Request-Id", "")
        with _openai_names(body, chat):
            job = to_job(req, self.gateway.tokenizer, self.gateway.require_limits())
        if self.lifecycle.draining:
            raise Unavailable("server is draining")
        out = OpenAIResponse(chat, job.request.request_id, model, self.gateway.tokenizer, req.return_logprobs, usage)
        self.lifecycle.enter()
        try:
            timeout = self.gateway.config.default_timeout_s
            with structlog.contextvars.bound_contextvars(request_id=out.request_id, method=request.path):
                return await _respond(request, out, self.gateway.generate(job, timeout), stream)
        finally:
            self.lifecycle.exit()


async def _respond(request: web.Request, out: OpenAIResponse, generation, stream: bool) -> web.StreamResponse:
    async with contextlib.aclosing(generation) as msgs:
        first = await anext(msgs, None)  # admission and verifier errors surface here, before any byte
        if first is None:
            raise Unavailable("verifier stream ended without a message")
        if stream:
            return await _stream(request, out, first, msgs)
        out.add(first)
        async for msg in msgs:
            out.add(msg)
        return web.json_response(out.response(), headers={"X-Request-Id": out.request_id})


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


async def _stream(request: web.Request, out: OpenAIResponse, first: pb.GenerateResponse, msgs) -> web.StreamResponse:
    """Server-sent events; a client that goes away ends the generation (the pipeline cancels the verifier
    call when `msgs` is closed)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Request-Id": out.request_id})
    await resp.prepare(request)
    try:
        start = out.start()
        if start is not None:
            await resp.write(sse(start))
        msg = first
        while msg is not None:
            events = out.end(msg.final) if msg.HasField("final") else [out.chunk(msg.chunk)]
            for event in events:
                if event is not None:
                    await resp.write(sse(event))
            msg = await anext(msgs, None)
        await resp.write(sse("[DONE]"))
    except ConnectionResetError:
        log.info("http_client_gone", request_id=out.request_id)
    except Exception as e:  # the status line is gone: the error becomes the stream's last event
        if not isinstance(e, ServiceError):
            log.exception("http_stream_failed", request_id=out.request_id)
            e = ServiceError(f"internal error: {type(e).__name__}: {e}")
        await resp.write(sse(error_body(e)[1]))
    return resp


def build_app(gateway: Gateway, lifecycle: Lifecycle, config: GatewayConfig) -> web.Application:
    app = web.Application(middlewares=[make_middleware(config.api_key)],
                          client_max_size=config.max_message_mb * 1024 * 1024)
    h = Handlers(gateway, lifecycle)
    app.router.add_post("/v1/chat/completions", h.chat)
    app.router.add_post("/v1/completions", h.completions)
    app.router.add_get("/v1/models", h.models)
    app.router.add_post("/tokenize", h.tokenize)
    app.router.add_post("/detokenize", h.detokenize)
    app.router.add_get("/health", h.health)
    app.router.add_get("/metrics", h.metrics)
    return app


async def start_http(gateway: Gateway, lifecycle: Lifecycle, config: GatewayConfig) -> web.AppRunner:
    """Binds config.http_port; `await runner.cleanup()` stops it. A client that disconnects cancels its
    handler (handler_cancellation), and with it the verifier call."""
    runner = web.AppRunner(build_app(gateway, lifecycle, config), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.http_port).start()
    log.info("http_listening", port=config.http_port)
    return runner
