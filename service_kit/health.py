"""Client side of grpc.health.v1 (sync): one check, and waiting until a service reports SERVING."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING


def is_serving(stub: health_pb2_grpc.HealthStub, service: str, timeout_s: float = 1.0) -> bool:
    """One Check; an unreachable server counts as not serving."""
    try:
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s).status == SERVING
    except grpc.RpcError:
        return False


def wait_serving(address: str, service: str, timeout_s: float, *, alive: Callable[[], bool] | None = None,
                 period_s: float = 0.2) -> None:
    """Poll until `service` at `address` is SERVING; TimeoutError after `timeout_s`, RuntimeError as soon
    as `alive()` (e.g. the server's process is still running) turns false."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not is_serving(stub, service):
            if alive is not None and not alive():
                raise RuntimeError(f"{address} ({service}) exited before serving")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{service} at {address} not SERVING after {timeout_s}s")
            time.sleep(period_s)
