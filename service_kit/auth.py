"""Bearer-token check shared by the gateway's two public surfaces (gRPC metadata and HTTP header
`authorization: Bearer <key>`). Health checks, reflection and metrics stay open: orchestrators probe them."""

from __future__ import annotations

import hmac

UNAUTHENTICATED_MESSAGE = "authorization: missing or wrong bearer token (send `authorization: Bearer <key>`)"


def bearer_ok(authorization: str | None, api_key: str) -> bool:
    """True when no key is configured or `authorization` is exactly "Bearer <api_key>" (scheme
    case-insensitive); compared in constant time."""
    if not api_key:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and key_ok(token, api_key)


def key_ok(key: str | None, api_key: str) -> bool:
    """True when no key is configured or `key` (a bare key header, Anthropic's `x-api-key`) is api_key."""
    return not api_key or hmac.compare_digest((key or "").strip().encode(), api_key.encode())


def grpc_authorization(metadata) -> str | None:
    """The `authorization` value of gRPC invocation metadata ((key, value) pairs, keys lower-case)."""
    return next((v for k, v in metadata or () if k == "authorization"), None)
