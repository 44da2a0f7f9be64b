"""Gateway Prometheus metrics (`ddtree_` prefix, base units, vLLM-style names; see docs/ARCHITECTURE.md).

PromQL: mean acceptance length = rate(ddtree_request_spec_decode_acceptance_length_sum[5m]) /
rate(ddtree_request_spec_decode_acceptance_length_count[5m]).
"""

from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 60.0)

REQUESTS = Counter("ddtree_requests_total", "Generate requests finished, by finish reason or error code",
                   ["finished_reason"])
REJECTED = Counter("ddtree_requests_rejected_total", "Requests rejected before generation", ["reason"])
RUNNING = Gauge("ddtree_num_requests_running", "Generate streams in flight at the gateway")
TTFT = Histogram("ddtree_time_to_first_token_seconds", "Request arrival to first token", buckets=LATENCY_BUCKETS)
ITL = Histogram("ddtree_inter_token_latency_seconds", "Time between tokens, per token (a chunk of k tokens "
                "observes its gap / k, k times)", buckets=LATENCY_BUCKETS)
E2E = Histogram("ddtree_e2e_request_latency_seconds", "Request arrival to final message", buckets=LATENCY_BUCKETS)
PROMPT_TOKENS = Counter("ddtree_prompt_tokens_total", "Prompt tokens of finished requests")
GENERATION_TOKENS = Counter("ddtree_generation_tokens_total", "Tokens streamed to clients")
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
REQUEST_PROMPT_TOKENS = Histogram("ddtree_request_prompt_tokens", "Prompt tokens per finished request",
                                  buckets=TOKEN_BUCKETS)
REQUEST_GENERATION_TOKENS = Histogram("ddtree_request_generation_tokens", "Generated tokens per finished request",
                                      buckets=TOKEN_BUCKETS)
TPOT = Histogram("ddtree_request_time_per_output_token_seconds", "Per request: (last token - first token) / "
                 "(generated tokens - 1), for requests of 2+ tokens", buckets=LATENCY_BUCKETS)
ACCEPTANCE = Histogram("ddtree_request_spec_decode_acceptance_length",
                       "Per-request mean tokens committed per verify step",
                       buckets=(1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8, 10, 12, 16))
