"""Verifier Prometheus metrics (`ddtree_` prefix, base units; PromQL conventions in docs/ARCHITECTURE.md)."""

from prometheus_client import Counter, Gauge, Histogram

STEP_BUCKETS = (0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0, 2.0, 4.0)

# phase="prefill" when the step holds prompt rows (maybe with verifies), "decode" when it holds only verifies:
# a 512-row prefill chunk would otherwise hide in the mean of the tree verifies.
VERIFY_SECONDS = Histogram("ddtree_verify_step_seconds", "One target forward over a step's rows", ["phase"],
                           buckets=STEP_BUCKETS)
DRAFT_SECONDS = Histogram("ddtree_draft_seconds", "Waiting for drafts in one step", buckets=STEP_BUCKETS)
ACCEPT_SECONDS = Histogram("ddtree_accept_commit_seconds", "Acceptance, KV commit and emission of one step",
                           ["phase"], buckets=STEP_BUCKETS)
STEP_ROWS = Histogram("ddtree_step_rows", "Rows in one target forward", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
TREE_NODES = Histogram("ddtree_spec_tree_nodes", "Draft nodes verified per session step", buckets=(0, 1, 2, 4, 7, 8, 16, 32, 64, 128, 256))
ACCEPTANCE = Histogram("ddtree_spec_decode_acceptance_length_per_step", "Tokens committed per session step",
                       buckets=(1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16))
NUM_DRAFTS = Counter("ddtree_spec_decode_num_drafts_total", "Session verify steps")
NUM_DRAFT_TOKENS = Counter("ddtree_spec_decode_num_draft_tokens_total", "Draft tree nodes verified")
NUM_ACCEPTED = Counter("ddtree_spec_decode_num_accepted_tokens_total", "Draft tokens accepted")
ACCEPTED_PER_POS = Counter("ddtree_spec_decode_num_accepted_tokens_per_pos_total",
                           "Draft tokens accepted at each tree depth (position 0 = the first token after the root)",
                           ["position"])  # <= the drafter's block size - 1 labels
TREE_DEPTH = Histogram("ddtree_spec_tree_depth", "Depth of the draft tree verified per session step",
                       buckets=(0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16))
DRAFT_UNAVAILABLE = Counter("ddtree_draft_unavailable_steps_total", "Session steps verified without a draft "
                            "because the drafter was late or failed")
DRAFT_SKIPPED = Counter("ddtree_draft_skipped_steps_total", "Session steps verified root-only by choice: the adaptive "
                        "tree budget expected more tokens per second without waiting for a draft")
RUNNING = Gauge("ddtree_num_sessions_running", "Sessions admitted to the decode loop")
WAITING = Gauge("ddtree_num_sessions_waiting", "Sessions waiting for KV pages or a batch slot")
KV_USAGE = Gauge("ddtree_kv_cache_usage_perc", "Fraction of KV pages in use (0-1)")


PREFIX_QUERIES = Counter("ddtree_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache")
PREFIX_HITS = Counter("ddtree_prefix_cache_hits_total", "Prompt tokens found in the prefix cache (not prefilled)")


def observe_prefix_cache(queried: int, hit: int) -> None:
    PREFIX_QUERIES.inc(queried)
    PREFIX_HITS.inc(hit)


def observe_step(*, draft_s: float, verify_s: float, accept_s: float, rows: int, sessions: int,
                 prefill: bool) -> None:
    if sessions:
        DRAFT_SECONDS.observe(draft_s)
    phase = "prefill" if prefill else "decode"
    VERIFY_SECONDS.labels(phase).observe(verify_s)
    ACCEPT_SECONDS.labels(phase).observe(accept_s)
    STEP_ROWS.observe(rows)


REQUEST_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92, 163.84,
                   600.0)
PHASE_SECONDS = {name: Histogram(f"ddtree_request_{name}_time_seconds", what, buckets=REQUEST_BUCKETS)
                 for name, what in (("queue", "Per request: submitted to admitted to the decode loop (waiting for KV "
                                              "pages or a batch slot)"),
                                    ("prefill", "Per request: admitted to its first token"),
                                    ("decode", "Per request: first token to finish"))}


def observe_phases(seconds: dict[str, float]) -> None:
    """A finished session's Session.phase_seconds (the phases it reached)."""
    for name, s in seconds.items():
        PHASE_SECONDS[name].observe(s)


def observe_acceptance(committed: int, drafted: int, depth: int) -> None:
    """One session step: `committed` tokens (root or bonus included) from a tree of `drafted` nodes, `depth` deep."""
    TREE_NODES.observe(drafted)
    TREE_DEPTH.observe(depth)
    ACCEPTANCE.observe(committed)
    NUM_DRAFTS.inc()
    NUM_DRAFT_TOKENS.inc(drafted)
    NUM_ACCEPTED.inc(committed - 1)
    for position in range(committed - 1):  # the accepted path holds one node per depth
        ACCEPTED_PER_POS.labels(str(position)).inc()
