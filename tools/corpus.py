"""The training corpus: Python source installed on this machine, no downloads.

Sources: the standard library (without its site-packages) and every site-packages / dist-packages
directory of the running interpreter, `.py` files only. Each file is keyed `stdlib/<rel>` or
`site-packages/<rel>`, so the same file has the same key on every machine. Files are read in key
order; identical contents are kept once (the first key wins); files above `--max-file-kb` (generated
tables) and files that are not UTF-8 are skipped.

Split: a file is held out iff sha1("heldout:" + key) mod 1000 < `--heldout-per-mille` (default 30, so
~3%). The rule depends on the key alone, so a key held out on one machine is held out on every
machine, whatever else is installed there.

`--max-train-mb` caps the training text: files are taken in a fixed hash order of their keys (a spread
over all packages) until the cap, then streamed in key order. Each document is followed by [EOS].

Output (`--out DIR`): train.u16 / heldout.u16 (raw little-endian uint16 token ids), heldout_docs.json
(key, offset, length per held-out document) and corpus.json (file, byte and token counts).

    python -m tools.corpus --tokenizer models/kimi-tiny --out .out/corpus
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python tools/corpus.py`
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import hashlib
import json
import os
import site
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SITE_DIR_NAMES = ("site-packages", "dist-packages")


@dataclass(frozen=True)
class SourceFile:
    key: str  # stdlib/<rel> or site-packages/<rel>: the same on every machine
    path: Path
    text: str


def source_roots() -> list[tuple[str, Path]]:
    """(key prefix, directory): the stdlib, then each distinct site directory of this interpreter."""
    roots = [("stdlib", Path(sysconfig.get_paths()["stdlib"]))]
    candidates = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    if site.ENABLE_USER_SITE:
        candidates.append(site.getusersitepackages())
    candidates += [p for p in sys.path if Path(p).name in SITE_DIR_NAMES]
    seen = set()
    for c in candidates:
        p = Path(c)
        if p.is_dir() and p.resolve() not in seen:
            seen.add(p.resolve())
            roots.append(("site-packages", p))
    return roots


def _walk(prefix: str, root: Path) -> list[tuple[str, Path]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        # The stdlib dir may hold the base interpreter's site-packages: those are listed as site dirs.
        dirnames[:] = sorted(d for d in dirnames if not (prefix == "stdlib" and d in SITE_DIR_NAMES)
                             and d != "__pycache__")
        rel = Path(dirpath).relative_to(root)
        out += [(f"{prefix}/{(rel / f).as_posix()}", Path(dirpath) / f) for f in filenames if f.endswith(".py")]
    return out


_LISTED: dict[int, tuple[list[SourceFile], dict]] = {}


def list_files(max_file_bytes: int = 512 * 1024) -> tuple[list[SourceFile], dict]:
    """Every usable .py file, key order, deduplicated by content; plus counts of what was skipped.
    Read once per process (the result is cached; callers must not mutate it)."""
    if max_file_bytes not in _LISTED:
        _LISTED[max_file_bytes] = _list_files(max_file_bytes)
    return _LISTED[max_file_bytes]


def _list_files(max_file_bytes: int) -> tuple[list[SourceFile], dict]:
    entries = sorted((e for prefix, root in source_roots() for e in _walk(prefix, root)), key=lambda e: e[0])
    files, seen_keys, seen_content = [], set(), set()
    stats = dict(found=len(entries), duplicate_key=0, duplicate_content=0, too_large=0, not_utf8=0, empty=0)
    for key, path in entries:
        if key in seen_keys:
            stats["duplicate_key"] += 1
            continue
        seen_keys.add(key)
        try:
            if path.stat().st_size > max_file_bytes:
                stats["too_large"] += 1
                continue
            raw = path.read_bytes()
        except OSError:
            stats["not_utf8"] += 1
            continue
        if not raw.strip():
            stats["empty"] += 1
            continue
        digest = hashlib.sha1(raw).digest()
        if digest in seen_content:
            stats["duplicate_content"] += 1
            continue
        seen_content.add(digest)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            stats["not_utf8"] += 1
            continue
        files.append(SourceFile(key, path, text))
    stats["kept"] = len(files)
    return files, stats


def key_hash(tag: str, key: str) -> int:
    return int.from_bytes(hashlib.sha1(f"{tag}:{key}".encode()).digest()[:8], "little")


def is_heldout(key: str, per_mille: int = 30) -> bool:
    return key_hash("heldout", key) % 1000 < per_mille


def split(files: list[SourceFile], per_mille: int = 30) -> tuple[list[SourceFile], list[SourceFile]]:
    train = [f for f in files if not is_heldout(f.key, per_mille)]
    heldout = [f for f in files if is_heldout(f.key, per_mille)]
    return train, heldout


def take_bytes(files: list[SourceFile], max_bytes: int | None) -> list[SourceFile]:
    """Files in a fixed hash order of their keys until `max_bytes` of UTF-8, returned in key order."""
    if max_bytes is None:
        return list(files)
    chosen, total = [], 0
    for f in sorted(files, key=lambda f: key_hash("order", f.key)):
        n = len(f.text.encode("utf-8"))
        if total + n > max_bytes:
            continue
        chosen.append(f)
        total += n
    return sorted(chosen, key=lambda f: f.key)


def encoder(tokenizer_dir: str | Path):
    """A tiktoken Encoding equal to gateway.tokenizer.KimiTokenizer's for ordinary text."""
    import tiktoken

    from gateway.tokenizer import KIMI_PAT_STR, load_tiktoken_ranks

    ranks = load_tiktoken_ranks(Path(tokenizer_dir) / "tiktoken.model")
    return tiktoken.Encoding(name="corpus", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens={}), len(ranks)


def tokenize(files: list[SourceFile], tokenizer_dir: str | Path, threads: int = 8) -> tuple[np.ndarray, list[list]]:
    """-> (uint16 token stream, [key, offset, length] per document); [EOS] after every document."""
    enc, num_regular = encoder(tokenizer_dir)
    eos = num_regular + 1  # Kimi's [EOS] offset (gateway/tiny_tokenizer.KIMI_SPECIAL_NAMES)
    docs, parts, offset = [], [], 0
    step = 2048
    for lo in range(0, len(files), step):
        batch = files[lo:lo + step]
        for f, ids in zip(batch, enc.encode_ordinary_batch([f.text for f in batch], num_threads=threads)):
            arr = np.empty(len(ids) + 1, dtype=np.uint16)
            arr[:-1] = ids
            arr[-1] = eos
            parts.append(arr)
            docs.append([f.key, offset, len(ids)])
            offset += len(arr)
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)
    return stream, docs


def build(out_dir: str | Path, tokenizer_dir: str | Path, *, max_train_mb: float | None = None,
          max_heldout_mb: float | None = 8.0, heldout_per_mille: int = 30, max_file_kb: int = 512,
          threads: int = 8, log=print) -> dict:
    t0 = time.monotonic()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files, stats = list_files(max_file_kb * 1024)
    train_all, heldout_all = split(files, heldout_per_mille)
    mb = lambda fs: sum(len(f.text.encode("utf-8")) for f in fs) / 1e6  # noqa: E731
    train = take_bytes(train_all, None if max_train_mb is None else int(max_train_mb * 1e6))
    heldout = take_bytes(heldout_all, None if max_heldout_mb is None else int(max_heldout_mb * 1e6))
    log(f"corpus: {stats['kept']} files ({mb(files):.1f} MB) kept of {stats['found']} found; "
        f"train {len(train)}/{len(train_all)} files ({mb(train):.1f}/{mb(train_all):.1f} MB), "
        f"held out {len(heldout)}/{len(heldout_all)} files ({mb(heldout):.1f} MB) [{time.monotonic() - t0:.1f}s]")
    train_ids, _ = tokenize(train, tokenizer_dir, threads)
    heldout_ids, heldout_docs = tokenize(heldout, tokenizer_dir, threads)
    train_ids.tofile(out / "train.u16")
    heldout_ids.tofile(out / "heldout.u16")
    (out / "heldout_docs.json").write_text(json.dumps(heldout_docs) + "\n")
    summary = {
        "python": sys.version.split()[0],
        "roots": [f"{p}={r}" for p, r in source_roots()],
        "files": stats,
        "bytes_kept": int(mb(files) * 1e6),
        "train_files_available": len(train_all), "train_bytes_available": int(mb(train_all) * 1e6),
        "train_files": len(train), "train_bytes": int(mb(train) * 1e6), "train_tokens": int(train_ids.size),
        "heldout_files_available": len(heldout_all), "heldout_files": len(heldout),
        "heldout_bytes": int(mb(heldout) * 1e6), "heldout_tokens": int(heldout_ids.size),
        "bytes_per_token": round(mb(train) * 1e6 / max(train_ids.size, 1), 3),
        "heldout_per_mille": heldout_per_mille, "max_file_kb": max_file_kb, "max_train_mb": max_train_mb,
        "seconds": round(time.monotonic() - t0, 1),
    }
    (out / "corpus.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"corpus: train {summary['train_tokens']:,} tokens, held out {summary['heldout_tokens']:,} tokens, "
        f"{summary['bytes_per_token']} bytes/token [{summary['seconds']}s]")
    return summary


def load_stream(corpus_dir: str | Path, name: str) -> np.ndarray:
    return np.fromfile(Path(corpus_dir) / f"{name}.u16", dtype=np.uint16)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", required=True, help="dir with tiktoken.model")
    p.add_argument("--out", required=True)
    p.add_argument("--max-train-mb", type=float, default=None, help="cap on training text (default: all)")
    p.add_argument("--max-heldout-mb", type=float, default=8.0)
    p.add_argument("--heldout-per-mille", type=int, default=30)
    p.add_argument("--max-file-kb", type=int, default=512)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = p.parse_args(argv)
    build(a.out, a.tokenizer, max_train_mb=a.max_train_mb, max_heldout_mb=a.max_heldout_mb,
          heldout_per_mille=a.heldout_per_mille, max_file_kb=a.max_file_kb, threads=a.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
