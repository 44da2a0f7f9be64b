"""Lazy, by-name access to a Hugging Face safetensors checkpoint (single file or sharded + index).

Shared by the verifier (whole target) and the drafter (only `embed_tokens` and `lm_head` of the
target). Tensors are read one at a time through `safe_open`, so a 594 GB checkpoint never sits in RAM.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed, or does not match what the model expects."""


def read_config_json(path: str | Path, error: type[Exception], what: str = "config") -> tuple[Path, object]:
    """`path` is a config.json or the checkpoint directory holding it -> (the file, its parsed JSON).
    An unreadable file or bad JSON raises `error` (the caller's own config error) naming the file."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        return path, json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise error(f"{path}: cannot read {what} ({e})") from e


class CheckpointIndex:
    """Maps tensor names to shard files; `read(name)` loads one tensor on demand."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        self._handles: dict[str, object] = {}  # before the weight map: a single-file checkpoint opens itself
        self.weight_map = self._read_weight_map()

    def _read_weight_map(self) -> dict[str, str]:
        index = self.dir / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})") from e
            return dict(weight_map)
        single = self.dir / SINGLE_FILE
        if single.exists():
            return {name: SINGLE_FILE for name in self._open(SINGLE_FILE).keys()}
        raise CheckpointError(f"{self.dir}: neither {INDEX_FILE} nor {SINGLE_FILE} found")

    def _open(self, file: str):
        if file not in self._handles:
            path = self.dir / file
            if not path.exists():
                raise CheckpointError(f"shard {path} listed in the index does not exist")
            try:
                self._handles[file] = safe_open(str(path), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise CheckpointError(f"shard {path} is unreadable or truncated: {e}") from e
        return self._handles[file]

    def names(self) -> list[str]:
        return sorted(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def read(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise CheckpointError(f"tensor {name!r} not found in {self.dir}")
        file = self.weight_map[name]
        try:
            return self._open(file).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"tensor {name!r} in {self.dir / file} is unreadable: {e}") from e

    def files(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    def open_all(self) -> None:
        """Open every shard now, so a missing or truncated file fails before any tensor is read."""
        for file in self.files():
            self._open(file)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of one tensor from the shard header (no data read)."""
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """safetensors dtype string of one tensor ("BF16", "I32", ...), from the header."""
        return self._slice(name).get_dtype()

    def _slice(self, name: str):
        if name not in self.weight_map:
            raise CheckpointError(f"tensor {name!r} not found in {self.dir}")
        file = self.weight_map[name]
        try:
            return self._open(file).get_slice(name)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"tensor {name!r} listed in the index is not in {self.dir / file}: {e}") from e

    def nbytes(self, name: str) -> int:
        """Size of one tensor on disk, from the shard header (no data read)."""
        sl = self._slice(name)
        numel = 1
        for d in sl.get_shape():
            numel *= d
        return numel * _DTYPE_BYTES[sl.get_dtype()]


_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8, "U8": 1, "I8": 1, "F64": 8, "BOOL": 1}
