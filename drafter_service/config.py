"""Drafter configuration (flags or DDTREE_DRAFTER_* variables)."""

from __future__ import annotations

from dataclasses import dataclass

from service_kit.config import ServerConfig, option


@dataclass(frozen=True)
class DrafterConfig(ServerConfig):
    port: int = option(50053, "gRPC port")
    model: str = option("", "DFlash drafter checkpoint dir (config.json + safetensors)")
    target_model: str = option("", "target checkpoint dir (only embed_tokens and lm_head are read)")
    device: str = option("cpu", "torch device, e.g. cpu, cuda, cuda:7")
    dtype: str = option("float32", "compute dtype", choices=("float32", "bfloat16"))
    max_tree_budget: int = option(256, "largest tree_budget accepted")
    window: int = option(4096, "context rows attended per session (sliding window; 0 = unlimited)")
    max_message_mb: int = option(512, "largest gRPC message, MiB (a resync carries up to `window` feature rows)")
    kernels: bool = option(True, "on GPU, build trees with the CUDA kernel (false: torch top-K + host heap)")
    cache_mb: int = option(256, "drafter KV cache budget in MiB; least recently used sessions are evicted")

    def __post_init__(self):
        super().__post_init__()
        if not self.model or not self.target_model:
            raise ValueError("model, target_model: both checkpoint dirs are required")
        if self.max_tree_budget < 1:
            raise ValueError("max_tree_budget: must be >= 1")
        if self.window < 0:
            raise ValueError("window: must be >= 0")
