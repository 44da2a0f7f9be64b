"""Tool subcommands of `ddtree` that are not services: make-tiny (more join in later issues)."""

from __future__ import annotations

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


def add_parsers(sub) -> None:
    p = sub.add_parser("make-tiny", help="write a small random checkpoint in the K2.6 on-disk format")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_make_tiny_cmd)
