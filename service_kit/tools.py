"""Tool subcommands of `ddtree` that are not services: make-tiny (more join in later issues)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def make_tiny(out: Path, seed: int = 0) -> Path:
    """A small random model in exactly the K2.6 on-disk layout: tokenizer + target + DFlash drafter."""
    from drafter_service.tiny_checkpoint import write_tiny_drafter
    from gateway.tiny_tokenizer import write_tiny_tokenizer
    from verifier_service.tiny_checkpoint import write_tiny_target

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = write_tiny_tokenizer(out, seed=seed)
    text = write_tiny_target(out, vocab_size=tok["vocab_size"], bos_token_id=tok["bos_token_id"],
                             eos_token_ids=[tok["eos_token_id"], tok["im_end_id"]], seed=seed)["text_config"]
    write_tiny_drafter(out / "drafter", target_hidden_size=text["hidden_size"],
                       target_num_layers=text["num_hidden_layers"], vocab_size=tok["vocab_size"],
                       mask_token_id=tok["mask_token_id"], seed=seed)
    return out


def _make_tiny_cmd(args) -> int:
    out = make_tiny(Path(args.out), seed=args.seed)
    print(f"wrote tiny K2.6-format checkpoint, tokenizer and DFlash drafter to {out}", file=sys.stderr)
    return 0


def _health_cmd(args) -> int:
    """Exit 0 iff the service reports SERVING (used by container health checks) and, with --deep, the gateway
    generates one token end to end."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from service_kit import tls

    with tls.client_channel(args) as channel:
        try:
            r = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout_s)
        except grpc.RpcError as e:
            print(f"{args.address} {args.service!r}: {e.code().name}", file=sys.stderr)
            return 1
        serving = r.status == health_pb2.HealthCheckResponse.SERVING
        print(f"{args.address} {args.service!r}: {health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)}")
        if not serving:
            return 1
        return 0 if not args.deep or _deep_probe(channel, args) else 1


def _deep_probe(channel, args) -> bool:
    """One real token through gateway, verifier and model (a canary, not for the frequent liveness poll)."""
    import time

    import grpc

    from ddtree.v1 import generation_pb2 as pb
    from ddtree.v1 import generation_pb2_grpc as pb_grpc

    req = pb.GenerateRequest(text="Hello", stopping=pb.StoppingCriteria(max_new_tokens=1, ignore_eos=True))
    metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else None
    t0 = time.monotonic()
    try:
        r = pb_grpc.GenerationStub(channel).GenerateUnary(req, timeout=args.timeout_s, metadata=metadata)
    except grpc.RpcError as e:
        print(f"deep: {e.code().name}: {e.details()}", file=sys.stderr)
        return False
    print(f"deep: {len(r.token_ids)} token in {1e3 * (time.monotonic() - t0):.0f} ms")
    return len(r.token_ids) == 1


def add_parsers(sub) -> None:
    from drafter_service import bench_draft
    from kernels import bench_all_reduce, cli as kernels_cli  # light imports: no torch until a command runs
    from service_kit import tls
    from tools import bench_grammar, bench_spec, budget_replay
    from verifier_service import bench_verify

    kernels_cli.add_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks (results belong in docs/BENCHMARKS.md)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    kernels_cli.add_bench_parser(bsub)
    bench_verify.add_parser(bsub)
    bench_all_reduce.add_parser(bsub)
    bench_draft.add_parser(bsub)
    bench_spec.add_parser(bsub)
    bench_grammar.add_parser(bsub)
    budget_replay.add_parser(bsub)
    p = sub.add_parser("health", help="check a service's grpc.health.v1 status (exit 0 iff SERVING)")
    p.add_argument("--address", default="localhost:50051")
    p.add_argument("--service", default="", help="e.g. ddtree.v1.Generation ('' = process liveness)")
    p.add_argument("--timeout-s", type=float, default=3.0)
    p.add_argument("--deep", action="store_true",
                   help="also generate one token through the gateway (a canary: gateway, verifier and model)")
    p.add_argument("--api-key", default=os.environ.get("DDTREE_API_KEY", ""),
                   help="the gateway's bearer token, for --deep [env DDTREE_API_KEY]")
    tls.add_client_arguments(p)
    p.set_defaults(func=_health_cmd)

    p = sub.add_parser("make-tiny", help="write a small random checkpoint in the K2.6 on-disk format")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_make_tiny_cmd)
