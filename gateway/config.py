"""Gateway configuration (flags or DDTREE_GATEWAY_* variables)."""

from __future__ import annotations

from dataclasses import dataclass

from service_kit.config import ServerConfig, option


@dataclass(frozen=True)
class GatewayConfig(ServerConfig):
    port: int = option(50051, "public gRPC port")
    http_port: int = option(8000, "OpenAI-compatible HTTP port: /v1/chat/completions, /v1/completions, /v1/models, "
                                  "/health, /metrics (0 = off)")
    api_key: str = option("", "bearer token every client must send on both ports (`authorization: Bearer <key>`); "
                              "empty = no check. Prefer the variable to the flag (argv is visible in ps)", secret=True)
    served_model_name: str = option("", "the `model` HTTP clients send and /v1/models lists (default: the "
                                        "verifier's model name, its checkpoint directory's name)")
    model: str = option("", "model dir holding tiktoken.model, tokenizer_config.json, chat_template.jinja")
    verifier: str = option("localhost:50052", "verifier address host:port")
    max_concurrent_requests: int = option(64, "admission limit; excess requests get RESOURCE_EXHAUSTED")
    default_max_new_tokens: int = option(256, "max_new_tokens when a request leaves it unset")
    default_timeout_s: float = option(600.0, "deadline for requests that send none")
    max_stop_strings: int = option(16, "most stop strings per request")
    internal_max_message_mb: int = option(256, "message size limit towards the verifier, MiB")
    ssl_certfile: str = option("", "PEM certificate chain (leaf first): the gRPC and HTTP ports serve TLS; needs "
                                   "ssl_keyfile (vLLM's names). Empty = plaintext")
    ssl_keyfile: str = option("", "PEM private key of ssl_certfile")

    def __post_init__(self):
        super().__post_init__()
        if not self.model:
            raise ValueError("model: a tokenizer directory is required (--model)")
        if not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port: {self.http_port} is not a TCP port")
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ValueError("ssl_certfile, ssl_keyfile: give both (TLS) or neither (plaintext)")
        if self.max_concurrent_requests < 1:
            raise ValueError("max_concurrent_requests: must be >= 1")
