"""The gateway's Anthropic Messages surface on the HTTP port: POST /v1/messages (JSON, or server-sent events with
`stream`) and /v1/messages/count_tokens. The key may come as `x-api-key` (Anthropic's clients) or a bearer token;
errors are Anthropic's shape, `{"type": "error", "error": {"type", "message"}}` (gateway/http_api.py's middleware).
Same validation, admission and pipeline as every other surface; the first message is awaited before any byte."""

from __future__ import annotations

import asyncio
import contextlib
import json

import structlog
from aiohttp import web

from gateway.anthropic_api import anthropic_param, messages_request
from gateway.anthropic_response import AnthropicResponse
from gateway.validation import prompt_ids, to_job
from service_kit import trace_context
from service_kit.errors import InvalidArgument, ServiceError, Unavailable
from service_kit.logs import get_logger

log = get_logger("gateway.http")


def event(body: dict) -> bytes:
    return f"event: {body['type']}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n".encode()


@contextlib.contextmanager
def _anthropic_names():
    try:
        yield
    except InvalidArgument as e:
        raise InvalidArgument(anthropic_param(e.field), e.detail) from e


async def messages(h, request: web.Request) -> web.StreamResponse:
    """`h`: the HTTP surface's Handlers (gateway, lifecycle, model name)."""
    body = await h.json_body(request)
    model = h.served_model(body)
    with _anthropic_names():
        req = messages_request(body)
        req.request_id = request.headers.get("X-Request-Id", "")
        job = await asyncio.to_thread(to_job, req, h.gateway.tokenizer, h.gateway.require_limits())
    if h.lifecycle.draining:
        raise Unavailable("server is draining")
    out = AnthropicResponse(job.request.request_id, model, len(job.request.prompt_ids))
    h.lifecycle.enter()
    try:
        with (trace_context.span(request.headers.get(trace_context.HEADER)),
              structlog.contextvars.bound_contextvars(request_id=out.request_id, method=request.path)):
            async with contextlib.aclosing(h.gateway.generate(job, h.gateway.config.default_timeout_s)) as msgs:
                first = await anext(msgs, None)  # admission and verifier errors keep their status
                if first is None:
                    raise Unavailable("verifier stream ended without a message")
                if body.get("stream"):
                    return await _stream(request, out, first, msgs)
                out.add(first)
                async for msg in msgs:
                    out.add(msg)
                return web.json_response(out.message(), headers={"X-Request-Id": out.request_id})
    finally:
        h.lifecycle.exit()


async def _stream(request: web.Request, out: AnthropicResponse, msg, msgs) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Request-Id": out.request_id})
    await resp.prepare(request)
    try:
        await resp.write(event(out.start()))
        while msg is not None:
            for body in out.end(msg.final) if msg.HasField("final") else out.chunk(msg.chunk):
                await resp.write(event(body))
            msg = await anext(msgs, None)
    except ConnectionResetError:
        log.info("http_client_gone", request_id=out.request_id)
    except Exception as e:  # the status line is gone: the error is the stream's last event
        if not isinstance(e, ServiceError):
            log.error("http_stream_failed", request_id=out.request_id, error=f"{type(e).__name__}: {e}")
        message = e.message if isinstance(e, ServiceError) else f"internal error: {type(e).__name__}: {e}"
        with contextlib.suppress(ConnectionResetError):
            await resp.write(event({"type": "error", "error": {"type": "api_error", "message": message}}))
    return resp


async def count_tokens(h, request: web.Request) -> web.Response:
    """The prompt's token count, as a generation would tokenize it."""
    body = await h.json_body(request)
    with _anthropic_names():
        ids = await asyncio.to_thread(prompt_ids, messages_request(body, count_only=True), h.gateway.tokenizer)
    return web.json_response({"input_tokens": len(ids)})
