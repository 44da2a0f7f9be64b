"""Scaffolding shared by the gateway, verifier and drafter services: gRPC server lifecycle, config,
logging, wire tensors, checkpoint access, and the `ddtree` CLI."""

__version__ = "0.1.0"
