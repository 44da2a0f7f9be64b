"""Drafter configuration (flags or DDTREE_DRAFTER_* variables)."""

from __future__ import annotations

from dataclasses import dataclass

from service_kit import busy_poll
from service_kit.config import ServerConfig, option


SYNTHETIC_PRESETS = ("k26", "k26-mini")  # drafter_service/synthetic.py PRESETS (not imported: no torch here)
QUANTIZATIONS = ("none", "int8")  # --quantization: weight storage of the projections (drafter_service/int8.py)


@dataclass(frozen=True)
class DrafterConfig(ServerConfig):
    port: int = option(50053, "gRPC port")
    model: str = option("", "DFlash drafter checkpoint dir (config.json + safetensors)")
    target_model: str = option("", "target checkpoint dir (only embed_tokens and lm_head are read)")
    synthetic: str = option("", "benchmarks without checkpoints: a random drafter of this preset (with random "
                            f"target embed/lm_head) made on the device ({', '.join(SYNTHETIC_PRESETS)}; "
                            "empty = load --model and --target-model)")
    synthetic_layers: int = option(0, "with --synthetic: layers of the target it drafts for, target_layer_ids "
                                   "are spread over them (0 = the preset's; K2.6 has 61)")
    device: str = option("cpu", "torch device, e.g. cpu, cuda, cuda:7")
    dtype: str = option("float32", "compute dtype", choices=("float32", "bfloat16"))
    quantization: str = option("none", "weight storage of the drafter's projections and its lm_head copy: none "
                               "(dtype), or int8 (one fp32 scale per output row; half the bytes a Propose reads in "
                               "bfloat16; changes acceptance, never the served tokens)", choices=QUANTIZATIONS)
    torch_threads: int = option(0, "torch CPU threads (0: 1 on a GPU, where the OpenMP pools of services on one "
                                "host spin against each other; torch's default on CPU)")
    max_tree_budget: int = option(256, "largest tree_budget accepted")
    window: int = option(4096, "context rows attended per session (sliding window; 0 = unlimited)")
    max_message_mb: int = option(512, "largest gRPC message, MiB (a resync carries up to `window` feature rows)")
    kernels: bool = option(True, "on GPU, build trees with the CUDA kernel (false: torch top-K + host heap)")
    cuda_graphs: bool = option(True, "on GPU, replay each step's inject and block forward from CUDA graphs "
                               "(false: eager launches)")
    propose_port: int = option(0, "TCP port of the framed Propose stream the verifier prefers to gRPC (same "
                               "messages, ~0.6 ms less per step on an H200 host); 0 = any free port, "
                               "advertised in GetInfo.propose_port; -1 = off (gRPC only)")
    busy_poll_ms: float = option(-1.0, "while requests keep coming, the event loop polls without sleeping for "
                                 "this long after each (service_kit/busy_poll.py: a sleeping thread runs its next "
                                 "Propose slower on virtualized hosts); 0 = always block; -1 = 20 on a GPU, 0 on "
                                 "CPU (where the spin would take a core from the services' compute)")
    cache_mb: int = option(256, "drafter KV cache budget in MiB; least recently used sessions are evicted")

    def __post_init__(self):
        super().__post_init__()
        if not self.synthetic and (not self.model or not self.target_model):
            raise ValueError("model, target_model: both checkpoint dirs are required (or --synthetic PRESET)")
        if self.synthetic and self.synthetic not in SYNTHETIC_PRESETS:
            raise ValueError(f"synthetic: {self.synthetic!r} is not one of {', '.join(SYNTHETIC_PRESETS)}")
        if self.synthetic_layers < 0:
            raise ValueError("synthetic_layers: must be >= 0")
        if self.quantization not in QUANTIZATIONS:  # a DDTREE_DRAFTER_QUANTIZATION value skips argparse's choices
            raise ValueError(f"quantization: {self.quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
        if self.max_tree_budget < 1:
            raise ValueError("max_tree_budget: must be >= 1")
        if self.window < 0:
            raise ValueError("window: must be >= 0")
        busy_poll.check_ms(self.busy_poll_ms)
        if not -1 <= self.propose_port < 65536:
            raise ValueError(f"propose_port: {self.propose_port} is not a TCP port, 0 or -1")
        if self.torch_threads < 0:
            raise ValueError("torch_threads: must be >= 0")
