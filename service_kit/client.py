"""`ddtree generate "text"`: streams a generation from the gateway to stdout, stats to stderr."""

from __future__ import annotations

import os
import sys

import grpc

from ddtree.v1 import generation_pb2 as pb
from ddtree.v1 import generation_pb2_grpc as pb_grpc
from service_kit import tls

MODES = {"default": pb.SPEC_MODE_UNSPECIFIED, "ar": pb.SPEC_MODE_AR,
         "chain": pb.SPEC_MODE_CHAIN, "ddtree": pb.SPEC_MODE_DDTREE}


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="stream a generation from the gateway")
    p.add_argument("prompt")
    p.add_argument("--address", default="localhost:50051", help="gateway host:port")
    p.add_argument("--chat", action="store_true", help="send the prompt as one user turn of a chat")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None, help="drop tokens below min_p x the top token's probability")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--mode", choices=tuple(MODES), default="default")
    p.add_argument("--tree-budget", type=int, default=None)
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="the answer is a JSON object (structured output)")
    fmt.add_argument("--json-schema", metavar="FILE", help="the answer is JSON valid against this JSON Schema file")
    fmt.add_argument("--regex", help="the answer matches this regular expression")
    p.add_argument("--timeout-s", type=float, default=600.0)
    tls.add_client_arguments(p)
    p.add_argument("--api-key", default=os.environ.get("DDTREE_API_KEY", ""),
                   help="the gateway's bearer token [env DDTREE_API_KEY]")
    p.set_defaults(func=generate)


def build_request(args) -> pb.GenerateRequest:
    req = pb.GenerateRequest(return_logprobs=False)
    if args.chat:
        req.chat.messages.add(role="user", content=args.prompt)
    else:
        req.text = args.prompt
    for name in ("temperature", "top_p", "top_k", "min_p", "seed"):
        if getattr(args, name) is not None:
            setattr(req.sampling, name, getattr(args, name))
    if args.max_new_tokens is not None:
        req.stopping.max_new_tokens = args.max_new_tokens
    req.stopping.stop.extend(args.stop)
    req.speculation.mode = MODES[args.mode]
    if args.tree_budget is not None:
        req.speculation.tree_budget = args.tree_budget
    if args.json:
        req.response_format.json_object = True
    elif args.json_schema:
        with open(args.json_schema, encoding="utf-8") as f:
            req.response_format.json_schema = f.read()
    elif args.regex:
        req.response_format.regex = args.regex
    return req


def format_final(final: pb.Final) -> str:
    s = final.spec_stats
    return (f"[{pb.FinishReason.Name(final.finish_reason)}] prompt={final.usage.prompt_tokens} "
            f"completion={final.usage.completion_tokens} mode={pb.SpecMode.Name(s.mode)} "
            f"steps={s.verify_steps} tau={s.mean_acceptance_length:.2f} budget={s.tree_budget} "
            f"accepted={s.accepted_draft_tokens}/{s.draft_tokens} no_draft_steps={s.draft_unavailable_steps}"
            + (f" matched_stop={final.matched_stop!r}" if final.matched_stop else "")
            + (f" ttft={final.timing.ttft_s * 1e3:.0f}ms e2e={final.timing.e2e_s * 1e3:.0f}ms"
               if final.HasField("timing") else ""))


class ChunkPrinter:
    """Chunks to stdout; a chat answer's thinking block between <think> and </think>, as the model wrote it,
    and each tool call on a line of its own."""

    def __init__(self):
        self.state = "start"  # -> "thinking" -> "answer"

    def write(self, chunk: pb.Chunk) -> None:
        if chunk.reasoning_text:
            if self.state == "start":
                sys.stdout.write("<think>")
                self.state = "thinking"
            sys.stdout.write(chunk.reasoning_text)
        if chunk.text or chunk.tool_calls:
            if self.state == "thinking":
                sys.stdout.write("</think>")
            self.state = "answer"
            sys.stdout.write(chunk.text)
        for call in chunk.tool_calls:
            sys.stdout.write(f"\n[tool call {call.id}] {call.name}({call.arguments})\n")
        sys.stdout.flush()


def generate(args) -> int:
    with tls.client_channel(args) as channel:
        stub = pb_grpc.GenerationStub(channel)
        try:
            metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else None
            shown = ChunkPrinter()
            for msg in stub.Generate(build_request(args), timeout=args.timeout_s, metadata=metadata):
                if msg.HasField("chunk"):
                    shown.write(msg.chunk)
                else:
                    sys.stdout.write("\n")
                    print(format_final(msg.final), file=sys.stderr)
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0
