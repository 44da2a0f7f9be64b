"""`make demo`: start the three services on this machine, stream one generation per mode, stop them.

Uses the shipped tiny model when present (models/), else writes a random tiny K2.6-format checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc

from ddtree.v1 import generation_pb2 as pb
from ddtree.v1 import generation_pb2_grpc as pb_grpc
from service_kit.client import format_final
from service_kit.health import wait_serving
from service_kit.launcher import resolve_model

PORTS = {"gateway": 50051, "verifier": 50052, "drafter": 50053}
HTTP_PORT = 8000
SERVICES = {"gateway": "ddtree.v1.Generation", "verifier": "ddtree.internal.v1.Verifier",
            "drafter": "ddtree.internal.v1.Drafter"}
PROMPT = "class Stack:\n    def __init__(self):"


def wait_all_serving(timeout_s: float = 180.0) -> None:
    for name, port in PORTS.items():
        wait_serving(f"127.0.0.1:{port}", SERVICES[name], timeout_s)
        print(f"  {name:8s} SERVING on 127.0.0.1:{port}", file=sys.stderr)


def stream(stub, mode: int, budget: int | None = None, temperature: float | None = None) -> None:
    req = pb.GenerateRequest(text=PROMPT, stopping=pb.StoppingCriteria(max_new_tokens=64),
                             speculation=pb.SpeculationParams(mode=mode))
    if budget is not None:
        req.speculation.tree_budget = budget
    if temperature is not None:  # seeded: the same text on every run, in every mode
        req.sampling.temperature, req.sampling.top_p, req.sampling.seed = temperature, 0.95, 7
    label = pb.SpecMode.Name(mode) + (f", temperature {temperature}" if temperature else ", greedy")
    print(f"\n--- {label} ---\n{PROMPT}", end="")
    t0 = time.monotonic()
    for msg in stub.Generate(req, timeout=300):
        if msg.HasField("chunk"):
            print(msg.chunk.text, end="", flush=True)
        else:
            dt = time.monotonic() - t0
            print(f"\n{format_final(msg.final)} ({msg.final.usage.completion_tokens / dt:.1f} tok/s)")


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def http_completion(prompt: str) -> None:
    """The same stack through its OpenAI-compatible HTTP API, as any OpenAI client would call it."""
    base = f"http://127.0.0.1:{HTTP_PORT}/v1"
    with urllib.request.urlopen(f"{base}/models", timeout=10) as r:
        model = json.load(r)["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 64, "spec_mode": "ddtree", "tree_budget": 16}
    answer = _post(f"{base}/completions", body)
    choice, stats = answer["choices"][0], answer["spec_stats"]
    print(f"\n--- POST {base}/completions (greedy, as the DDTREE stream above) ---\n{prompt}{choice['text']}\n"
          f"[{choice['finish_reason']}] usage={answer['usage']} mode={stats['mode']} "
          f"tau={stats['mean_acceptance_length']:.2f}")


def http_structured() -> None:
    """Structured output: a chat answer that must be JSON of a schema (the target's tokens under its grammar)."""
    base = f"http://127.0.0.1:{HTTP_PORT}/v1"
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                               "year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
              "required": ["name", "year"], "additionalProperties": False,
              "x-guidance": {"whitespace_flexible": False}}  # compact JSON
    body = {"messages": [{"role": "user", "content": "Name a programming language and the year it appeared."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "language", "schema": schema}},
            "max_tokens": 64, "tree_budget": 16, "chat_template_kwargs": {"thinking": False}}
    answer = _post(f"{base}/chat/completions", body)
    choice = answer["choices"][0]
    content = choice["message"]["content"]
    parsed = json.loads(content) if choice["finish_reason"] == "stop" else "(cut at max_tokens)"
    print(f"\n--- POST {base}/chat/completions with response_format json_schema ---\n{content}\n"
          f"[{choice['finish_reason']}] parsed: {parsed} tau={answer['spec_stats']['mean_acceptance_length']:.2f}")


def main() -> int:
    model = resolve_model(os.environ.get("DDTREE_MODEL"))
    print(f"ddtree demo: model {model}", file=sys.stderr)
    cmd = [sys.executable, "-m", "service_kit.cli", "serve", "--model", str(model),
           "--gateway-port", str(PORTS["gateway"]), "--verifier-port", str(PORTS["verifier"]),
           "--drafter-port", str(PORTS["drafter"]), "--http-port", str(HTTP_PORT)]
    stack = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    try:
        wait_all_serving()
        with grpc.insecure_channel(f"127.0.0.1:{PORTS['gateway']}") as ch:
            stub = pb_grpc.GenerationStub(ch)
            info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
            print(f"serving {info.model_name}: vocab {info.vocab_size}, drafter block {info.drafter_block_size}, "
                  f"drafters {info.drafter_replicas_healthy}/{info.drafter_replicas}", file=sys.stderr)
            stream(stub, pb.SPEC_MODE_AR)
            stream(stub, pb.SPEC_MODE_CHAIN)
            stream(stub, pb.SPEC_MODE_DDTREE, budget=16)
            stream(stub, pb.SPEC_MODE_DDTREE, budget=16, temperature=0.8)
        http_completion(PROMPT)
        http_structured()
    finally:
        stack.send_signal(signal.SIGTERM)
        stack.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
