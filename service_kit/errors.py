"""Exceptions that carry their gRPC status; the server interceptor maps them (and only them) to codes.

Domain code raises these instead of touching grpc, so engines stay testable without a server.
"""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    """`field`, when known, names the request field at fault (the HTTP surface reports it as `param`)."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        if code is not None:
            self.code = code


class InvalidArgument(ServiceError):
    """Bad input. `field` names the offending request field (dotted path)."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}", field=field)
        self.detail = message


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION
