"""grpc.aio server lifecycle shared by the three services: limits, health, reflection, error
mapping, drain on SIGTERM, Prometheus port.

Health: "" (liveness) is SERVING once the port is bound; each service name is NOT_SERVING until
`warmup` returns (weights loaded) and again from the moment a drain starts.
Drain: SIGTERM → health NOT_SERVING → new calls get UNAVAILABLE → in-flight calls may finish for
`drain_timeout_s` → `server.stop(grace_s)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import prometheus_client
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service_kit import trace_context
from service_kit.auth import UNAUTHENTICATED_MESSAGE, bearer_ok, grpc_authorization
from service_kit.config import ServerConfig
from service_kit.errors import ServiceError

log = structlog.get_logger("service_kit.server")

_UNTRACKED_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


def grpc_options(config: ServerConfig) -> list[tuple[str, int]]:
    """Explicit message limits and keepalive tolerance (clients ping every ~30 s during long prefills)."""
    size = config.max_message_mb * 1024 * 1024
    return [
        ("grpc.max_send_message_length", size),
        ("grpc.max_receive_message_length", size),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def channel_options(max_message_mb: int) -> list[tuple[str, int]]:
    size = max_message_mb * 1024 * 1024
    return [
        ("grpc.max_send_message_length", size),
        ("grpc.max_receive_message_length", size),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


class Lifecycle:
    """In-flight call accounting and the draining flag, shared by the interceptor and the servicers."""

    def __init__(self):
        self.draining = False
        self.serving = False  # readiness of the mounted services (the HTTP surface reports it too)
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._health = None
        self._names: list[str] = []

    async def set_serving(self, serving: bool) -> None:
        """Readiness of every mounted service (e.g. the gateway follows its verifier); ignored while draining."""
        if self._health is None or self.draining:
            return
        self.serving = serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self._names:
            await self._health.set(name, status)

    def enter(self) -> None:
        self.inflight += 1
        self._idle.clear()

    def exit(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps ServiceError subclasses to their status codes, anything else to INTERNAL (logged); binds request_id and
    the call's trace span (service_kit/trace_context, from `traceparent` metadata) into the log context; refuses new
    calls while draining, and calls without the bearer token when an `api_key` is set (health and reflection stay
    open)."""

    def __init__(self, lifecycle: Lifecycle, api_key: str = ""):
        self.lifecycle = lifecycle
        self.api_key = api_key

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(_UNTRACKED_PREFIXES):
            return handler
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(handler.unary_unary, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(handler.unary_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                self._wrap_bidi(handler.stream_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return handler

    async def _admit(self, context) -> None:
        if self.lifecycle.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is draining")
        if not bearer_ok(grpc_authorization(context.invocation_metadata()), self.api_key):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    async def _fail(self, context, method: str, exc: BaseException) -> None:
        if isinstance(exc, ServiceError):
            await context.abort(exc.code, exc.message)
        log.exception("rpc_failed", method=method)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}: {exc}")

    @contextlib.asynccontextmanager
    async def _guard(self, request, context, method: str, counted: bool = True):
        """Admission while draining, in-flight accounting (unless not `counted`), request_id and the trace span in
        the log context, error mapping."""
        await self._admit(context)
        if counted:
            self.lifecycle.enter()
        rid = getattr(request, "request_id", "") or None
        incoming = trace_context.metadata_value(context.invocation_metadata())
        try:
            with trace_context.span(incoming), structlog.contextvars.bound_contextvars(request_id=rid,
                                                                                        method=method):
                yield
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as e:
            await self._fail(context, method, e)
        finally:
            if counted:
                self.lifecycle.exit()

    def _wrap_unary(self, behavior, method):
        async def wrapper(request, context):
            async with self._guard(request, context, method):
                return await behavior(request, context)
        return wrapper

    def _wrap_stream(self, behavior, method):
        async def wrapper(request, context):
            async with self._guard(request, context, method):
                async for response in behavior(request, context):
                    yield response
        return wrapper

    def _wrap_bidi(self, behavior, method):
        """A long-lived stream (ProposeStream): not counted in flight, or a drain would wait on it to its
        timeout; the server's stop cancels it."""
        async def wrapper(request_iterator, context):
            async with self._guard(None, context, method, counted=False):
                async for response in behavior(request_iterator, context):
                    yield response
        return wrapper


@dataclass
class Service:
    """One servicer to mount: its generated `add_*_to_server` function and its full proto name."""

    add_to_server: Callable
    servicer: object
    full_name: str


async def run_server(config: ServerConfig, services: list[Service], *, lifecycle: Lifecycle | None = None,
                     warmup: Callable[[], Awaitable[None]] | None = None,
                     on_stop: Callable[[], Awaitable[None]] | None = None, api_key: str = "",
                     credentials: grpc.ServerCredentials | None = None) -> None:
    """Serves until SIGTERM/SIGINT, then drains and stops. `warmup` runs after the port is bound;
    `api_key`, when set, is the bearer token every call but health and reflection must carry; `credentials`, when
    set, put the port on TLS (service_kit/tls.py)."""
    lifecycle = lifecycle or Lifecycle()
    if config.metrics_port:
        prometheus_client.start_http_server(config.metrics_port)
    server = grpc.aio.server(interceptors=[ErrorInterceptor(lifecycle, api_key)], options=grpc_options(config))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for s in services:
        s.add_to_server(s.servicer, server)
    names = [s.full_name for s in services]
    lifecycle._health, lifecycle._names = health_servicer, names
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = f"{config.host}:{config.port}"
    port = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    for name in names:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    log.info("listening", port=port, services=names, metrics_port=config.metrics_port, tls=credentials is not None)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    warm = asyncio.create_task(_warm(warmup, lifecycle))
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({warm, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if warm.done() and warm.exception() is not None:
        log.error("warmup_failed", error=repr(warm.exception()))
        await server.stop(0)
        raise warm.exception()
    await stopped
    warm.cancel()
    await _drain(server, health_servicer, lifecycle, config)
    if on_stop is not None:
        await on_stop()


async def _warm(warmup, lifecycle: Lifecycle) -> None:
    t0 = time.monotonic()
    if warmup is not None:
        await warmup()
    await lifecycle.set_serving(True)
    log.info("serving", warmup_s=round(time.monotonic() - t0, 3))


async def _drain(server, health_servicer, lifecycle: Lifecycle, config: ServerConfig) -> None:
    log.info("draining", inflight=lifecycle.inflight, timeout_s=config.drain_timeout_s)
    await health_servicer.enter_graceful_shutdown()
    lifecycle.draining = True
    finished = await lifecycle.wait_idle(config.drain_timeout_s)
    log.info("stopping", drained=finished, inflight=lifecycle.inflight, grace_s=config.grace_s)
    await server.stop(config.grace_s)
