"""Prometheus metrics of the drafter (served on --metrics-port)."""

from prometheus_client import Histogram

# One Propose call by phase: decode (proto → tensors), draft (engine: inject, block forward, trees, device
# sync included), encode (trees → proto). The verifier's ddtree_draft_seconds minus these is transport.
PROPOSE_SECONDS = Histogram("ddtree_drafter_propose_seconds", "One Propose call in the drafter, by phase",
                            ["phase"], buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1,
                                                0.25, 0.5, 1.0))
