"""Verifier configuration (flags or DDTREE_VERIFIER_* variables)."""

from __future__ import annotations

from dataclasses import dataclass

from service_kit import busy_poll
from service_kit.config import ServerConfig, option

MODES = ("ar", "chain", "ddtree")
DRAFTER_TRANSPORTS = ("framed", "grpc")  # how Proposes travel: the drafter's framed port when it has one, or gRPC
SYNTHETIC_PRESETS = ("k26", "k26-mini")  # verifier_service/synthetic.py PRESETS (not imported: no torch here)


@dataclass(frozen=True)
class VerifierConfig(ServerConfig):
    port: int = option(50052, "gRPC port (rank 0)")
    model: str = option("", "target checkpoint dir (K2.6 layout); not needed with --synthetic")
    synthetic: str = option("", "benchmarks without a checkpoint: random weights of this preset made on the "
                            f"device ({', '.join(SYNTHETIC_PRESETS)}; empty = load --model)")
    synthetic_layers: int = option(0, "with --synthetic: number of layers (0 = the preset's; K2.6 has 61)")
    device: str = option("cpu", "cpu or cuda")
    dtype: str = option("float32", "compute dtype", choices=("float32", "bfloat16"))
    torch_threads: int = option(0, "torch CPU threads (0: 1 on a GPU, where the OpenMP pools of services on one "
                                "host spin against each other; torch's default on CPU)")
    world_size: int = option(1, "verifier ranks (GPUs); routed experts and attention heads are split over them")
    gpus: tuple[int, ...] = option((), "GPU index per rank (default: the first world_size visible)")
    drafter: tuple[str, ...] = option((), "drafter replica host:port (repeatable) or one dns:///name:port")
    default_mode: str = option("ddtree", "mode when a request leaves it unspecified", choices=MODES)
    default_tree_budget: int = option(16, "tree nodes per step when a request leaves it unset")
    max_tree_budget: int = option(64, "largest tree budget a request may ask for")
    adaptive_tree_budget: bool = option(True, "each step verifies only those of a session's drafted nodes (up to its "
                                        "tree budget) that maximize expected tokens per second, from the drafter's "
                                        "calibrated confidence in each node and the measured verify time of each row "
                                        "bucket, and skips the drafter while its trees do not pay "
                                        "(verifier_service/budget.py); false: every drafted node")
    max_new_tokens_limit: int = option(4096, "largest max_new_tokens a request may ask for")
    max_context: int = option(8192, "longest prompt + generation per session, tokens")
    kv_cache_mb: int = option(256, "latent KV cache budget in MiB (pages are allocated once from it)")
    page_size: int = option(64, "KV rows per page")
    prefill_chunk: int = option(512, "prompt tokens prefilled per step per session")
    prefix_cache: bool = option(True, "reuse the KV pages of earlier requests' identical prompt prefixes (whole "
                                "pages, kept until the space is needed); false: every prompt is prefilled")
    prefix_feature_mb: int = option(4096, "host memory for the drafter's feature rows of cached pages, MiB: a "
                                    "prefix-cache hit sends the drafter the rows before its first prefilled "
                                    "position (up to --feature-window) from here; 0 = it gets none")
    max_batch: int = option(64, "sessions decoded together in one step")
    drafter_transport: str = option("framed", "how Proposes travel: framed = the drafter's framed Propose port "
                                    "(GetInfo.propose_port; gRPC for a replica without one), grpc = the "
                                    "ProposeStream RPC", choices=DRAFTER_TRANSPORTS)
    busy_poll_ms: float = option(-1.0, "the engine waits for a drafter's framed answer polling without "
                                 "sleeping for up to this long, then blocks (service_kit/busy_poll.py); 0 = block; "
                                 "-1 = 20 on a GPU, 0 on CPU (where the spin would take a core from the drafter)")
    draft_deadline_ms: float = option(2000.0, "per-step wait for drafts; late sessions verify root-only")
    feature_window: int = option(4096, "target feature rows kept per session for drafter resync")
    drafter_max_message_mb: int = option(512, "message size limit towards the drafters, MiB (a resync "
                                         "resends the window: 4096 rows of K2.6 features are 336 MiB)")
    split_replicated: bool = option(True, "at world size > 1 also split the shared experts, the dense MLP and "
                                    "embedding/head over the ranks (each rank reads 1/N of them per step: "
                                    "K2.6 on 7 H200s, 16-row verify 13.8 -> 10.1 ms per rank); false: "
                                    "replicated on every rank (no embedding all-reduce, no logits all-gather)")
    expert_slices: int = option(1, "at world size > 1 cut each routed expert into this many slices of its "
                                "intermediate rows, dealt round-robin over the ranks (1: whole experts, 55 or 54 a "
                                "rank); a step waits for the rank with the most touched experts, and slices even "
                                "that out (one row on 7 ranks: 2.7 experts' bytes on the slowest rank, 1.6 with 4). "
                                "4 on uniform routing, slowest rank: steps of 1-16 rows 6-13 % faster, 64 rows 8 % "
                                "slower, prefill MoE up to 27 % slower")
    kernels: bool = option(True, "run the CUDA kernels on GPU (false: the torch reference path, for debugging)")
    cuda_graphs: bool = option(True, "replay the GPU forward from CUDA graphs per row bucket (false: eager)")
    one_shot_all_reduce_kb: int = option(1024, "at world size > 1 on GPUs, all-reduces up to this many KiB run as one "
                                         "NVLink push and one local sum (kernels/all_reduce.py) instead of NCCL's "
                                         "ring; 0 = NCCL for all")
    collective_timeout_s: float = option(60.0, "a rank's collective waiting longer than this fails the verifier")
    force_accept_depth: int = option(0, "TEST ONLY, breaks losslessness: accept the drafted path down to this "
                                     "depth whatever the target says (then the target's bonus), to time steps "
                                     "at a chosen acceptance length with random weights; 0 = off")

    def __post_init__(self):
        super().__post_init__()
        if not self.model and not self.synthetic:
            raise ValueError("model: a checkpoint directory is required (--model), or --synthetic PRESET")
        if self.synthetic and self.synthetic not in SYNTHETIC_PRESETS:
            raise ValueError(f"synthetic: {self.synthetic!r} is not one of {', '.join(SYNTHETIC_PRESETS)}")
        if min(self.synthetic_layers, self.force_accept_depth, self.torch_threads, self.one_shot_all_reduce_kb) < 0:
            raise ValueError("synthetic_layers, force_accept_depth, torch_threads, one_shot_all_reduce_kb: must be >= 0")
        busy_poll.check_ms(self.busy_poll_ms)
        if self.world_size < 1:
            raise ValueError("world_size: must be >= 1")
        if self.expert_slices < 1 or self.expert_slices & (self.expert_slices - 1):
            raise ValueError("expert_slices: must be a power of two >= 1")
        if self.gpus and len(self.gpus) != self.world_size:
            raise ValueError(f"gpus: {len(self.gpus)} given for world_size {self.world_size}")
        if not 1 <= self.default_tree_budget <= self.max_tree_budget:
            raise ValueError("default_tree_budget: must be in [1, max_tree_budget]")
        if self.page_size < 1 or self.prefill_chunk < 1 or self.max_batch < 1:
            raise ValueError("page_size, prefill_chunk, max_batch: must be >= 1")
