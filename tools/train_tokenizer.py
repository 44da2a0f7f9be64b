"""Train the Kimi-format byte-level BPE tokenizer of the tiny pair on a sample of the Python corpus.

Writes, like Kimi K2.6 ships them: `tiktoken.model` (base64 token + rank per line; 256 single bytes,
then merges in rank order), the 256 reserved special ids after the regular ones (Kimi's names at
Kimi's offsets), `tokenizer_config.json` and a Kimi-style `chat_template.jinja`. The trainer is
gateway.tiny_tokenizer.train_bpe over chunks cut by Kimi's pre-tokenizer; deterministic for a given
set of files (the sample is the training split's files in a fixed hash order of their keys).

    python -m tools.train_tokenizer --out models/kimi-tiny --vocab 4096 --sample-mb 24
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python tools/train_tokenizer.py`
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import base64
import json
import sys
import time
from collections import Counter
from pathlib import Path

from gateway.chat import KIMI_STYLE_CHAT_TEMPLATE
from gateway.tiny_tokenizer import kimi_special_tokens, pretokenize, train_bpe
from gateway.tokenizer import NUM_RESERVED_SPECIAL_TOKENS
from tools import corpus

ADDITIONAL_SPECIAL = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                      "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"]


def special_ids(num_regular: int) -> dict[str, int]:
    """Ids of the specials the model and the services use (Kimi offsets from the first special id)."""
    return {"vocab_size": num_regular + NUM_RESERVED_SPECIAL_TOKENS, "bos_token_id": num_regular,
            "eos_token_id": num_regular + 1, "im_end_id": num_regular + 2,
            "mask_token_id": num_regular + 254, "pad_token_id": num_regular + 255}


def write_tokenizer_files(out_dir: str | Path, tokens: list[bytes]) -> dict[str, int]:
    """tokens: all regular tokens in rank order (the 256 single bytes first). Same files and fields as
    gateway.tiny_tokenizer.write_tiny_tokenizer, for a token list trained elsewhere."""
    if tokens[:256] != [bytes([b]) for b in range(256)] or len(set(tokens)) != len(tokens):
        raise ValueError("tokens must start with the 256 single bytes and be unique")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode('ascii')} {rank}\n" for rank, t in enumerate(tokens)))
    specials = kimi_special_tokens(len(tokens))
    config = {
        "added_tokens_decoder": {str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for i, name in specials.items()},
        "additional_special_tokens": ADDITIONAL_SPECIAL,
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 262144,
        "tokenizer_class": "TikTokenTokenizer",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out / "chat_template.jinja").write_text(KIMI_STYLE_CHAT_TEMPLATE)
    return special_ids(len(tokens))


def train(out_dir: str | Path, *, vocab: int = 4096, sample_mb: float = 24.0, heldout_per_mille: int = 30,
          log=print) -> dict:
    t0 = time.monotonic()
    files, _ = corpus.list_files()
    train_files, _ = corpus.split(files, heldout_per_mille)
    sample = corpus.take_bytes(train_files, int(sample_mb * 1e6))
    counts: Counter[bytes] = Counter()
    for f in sample:
        counts.update(chunk.encode("utf-8") for chunk in pretokenize(f.text))
    t1 = time.monotonic()
    tokens = [bytes([b]) for b in range(256)] + train_bpe(counts, vocab - 256)
    ids = write_tokenizer_files(out_dir, tokens)
    info = {"vocab_regular": vocab, "sample_files": len(sample),
            "sample_bytes": sum(len(f.text.encode("utf-8")) for f in sample), "unique_chunks": len(counts),
            "pretokenize_s": round(t1 - t0, 1), "bpe_s": round(time.monotonic() - t1, 1), **ids}
    log(f"tokenizer: {vocab} regular + {NUM_RESERVED_SPECIAL_TOKENS} special ids from {info['sample_files']} files "
        f"({info['sample_bytes'] / 1e6:.1f} MB, {len(counts):,} distinct chunks) in "
        f"{info['pretokenize_s'] + info['bpe_s']:.1f}s -> {out_dir}")
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--vocab", type=int, default=4096, help="regular ids (256 bytes + merges)")
    p.add_argument("--sample-mb", type=float, default=24.0)
    p.add_argument("--heldout-per-mille", type=int, default=30)
    a = p.parse_args(argv)
    train(a.out, vocab=a.vocab, sample_mb=a.sample_mb, heldout_per_mille=a.heldout_per_mille)
    return 0


if __name__ == "__main__":
    sys.exit(main())
