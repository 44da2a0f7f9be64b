"""`ddtree bench grammar --vocab FILE`: the CPU cost structured output adds per emitted token on the verifier.

FILE is a tiktoken BPE file (`base64(token) rank` lines: a K2.6 checkpoint's tiktoken.model, or any other) and
becomes a Kimi-layout vocabulary (its ranks, then 256 reserved special ids). For each format a sample answer is
tokenized with that vocabulary and constrained token by token, as `stepping.constrained_walk` does once per emitted
token: `Constraint.restrict` (the grammar's mask over the vocabulary, expanded and applied to a logit row on
`--device`, synchronized) and `Constraint.advance`. Prints per format the median of llguidance's mask alone, of a
greedy row's host pick from its top-32 given the mask (`grammar.greedy_choice`, then the advance: a structured greedy
row whose mask the look-ahead computed during the forward costs this), and median / p90 / max / mean microseconds per
emitted token of the device path (restriction on `--device`).
"""

from __future__ import annotations

import json
import statistics
import time

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "email": {"type": "string", "format": "email"}, "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city"]}}, "required": ["name", "age", "tags"]}
ANSWER = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
          "tags": ["mathematician", "writer", "first programmer"], "address": {"city": "London", "zip": "W1"}}
REGEX = r"(Yes|No), because [a-z ,]{10,200}\."


def formats() -> list[tuple[str, dict, str]]:
    """(label, GenerateRequest.response_format fields, a valid answer)."""
    return [
        ("json_schema, pretty-printed", dict(json_schema=json.dumps(SCHEMA)), json.dumps(ANSWER, indent=2)),
        ("json_schema, compact", dict(json_schema=json.dumps(SCHEMA)), json.dumps(ANSWER)),
        ("json_object", dict(json_object=True), json.dumps(ANSWER, indent=2)),
        ("regex", dict(regex=REGEX), "Yes, because the sky is blue, and the sea reflects it."),
    ]


def add_parser(bsub) -> None:
    p = bsub.add_parser("grammar", help="CPU cost of structured output per emitted token (one grammar mask)")
    p.add_argument("--vocab", required=True, help="tiktoken BPE file (base64 token, rank per line)")
    p.add_argument("--device", default="cpu", help="where the logit row lives (the mask is applied there)")
    p.add_argument("--repeats", type=int, default=5, help="passes over each answer")
    p.set_defaults(func=main)


def _vocabulary(path: str):
    from pathlib import Path

    import llguidance
    import tiktoken

    from service_kit.vocab import KIMI_PAT_STR, NUM_RESERVED_SPECIAL_TOKENS, load_tiktoken_ranks, special_names

    ranks = load_tiktoken_ranks(Path(path))
    n = len(ranks)
    specials = special_names(n, {})
    enc = tiktoken.Encoding(name="bench", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=specials)
    t0 = time.perf_counter()
    vocab = llguidance.LLTokenizer.from_tiktoken(encoder=ranks, special_tokens=specials, pattern=KIMI_PAT_STR,
                                                 eos_token=[n + 1], n_vocab=n + NUM_RESERVED_SPECIAL_TOKENS)
    return enc, vocab, n + NUM_RESERVED_SPECIAL_TOKENS, time.perf_counter() - t0


def _mask_and_pick(c, ids: list[int], picks: list[float]) -> list[float]:
    """Per token: llguidance's mask alone (returned, us), and the greedy host path's pick from a top-32 holding the
    token plus the matcher's advance, given that mask (appended to `picks`, us)."""
    from verifier_service.grammar import greedy_choice

    masks = []
    for t in ids:
        t0 = time.perf_counter()
        bits = c.matcher.compute_bitmask()
        t1 = time.perf_counter()
        top = [t] + [u for u in range(64) if u != t][:31]  # the token first, as the model's best
        assert greedy_choice(bits, top, [float(32 - i) for i in range(32)]) == t
        c.advance(t)
        t2 = time.perf_counter()
        masks.append((t1 - t0) * 1e6)
        picks.append((t2 - t1) * 1e6)
    return masks


def main(args) -> int:
    import torch

    from gateway.structured import grammar
    from ddtree.v1 import generation_pb2 as pb
    from verifier_service.grammar import Constraint

    enc, vocab, size, build_s = _vocabulary(args.vocab)
    print(f"vocabulary: {size} ids, LLTokenizer built in {build_s:.2f} s; device {args.device}")
    logits = torch.zeros(size, device=args.device)
    print("| format | tokens | mask only, median us | host pick, median us | median us | p90 us | max us | mean us |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, fields, answer in formats():
        text = grammar(pb.ResponseFormat(**fields))
        ids = enc.encode_ordinary(answer)
        Constraint(vocab, text, None).restrict(logits)  # the grammar's first mask builds its lexer: not timed
        masks, picks, times = [], [], []
        for _ in range(args.repeats):
            masks += _mask_and_pick(Constraint(vocab, text, None), ids, picks)
            c = Constraint(vocab, text, None)
            for t in ids:  # what the walk does per emitted token on the device path
                t0 = time.perf_counter()
                row = c.restrict(logits)
                if row.device.type == "cuda":
                    torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e6)
                assert torch.isfinite(row[t]), f"{label}: token {t} is not allowed"
                c.advance(t)
        q = statistics.quantiles(times, n=10)
        print(f"| {label} | {len(ids)} | {statistics.median(masks):.0f} | {statistics.median(picks):.0f} "
              f"| {statistics.median(times):.0f} | {q[-1]:.0f} | {max(times):.0f} | {statistics.fmean(times):.0f} |")
    return 0
