"""Load a released DFlash drafter plus the target's `embed_tokens` and `lm_head` (only those two tensors).

Drafter tensors are named as in the released checkpoints (`fc.weight`, `layers.0.self_attn.q_proj.weight`,
…), optionally under a `model.` prefix. Target tensors may sit under `language_model.` (Kimi K2.x) or not.
Every tensor is read one at a time and moved straight to the device in the serving dtype.
"""

from __future__ import annotations

from pathlib import Path

import torch

from service_kit.checkpoint import CheckpointError, CheckpointIndex

from .model import DFlashDrafter
from .model_config import DFlashConfig

TARGET_EMBED = ("language_model.model.embed_tokens.weight", "model.embed_tokens.weight")
TARGET_HEAD = ("language_model.lm_head.weight", "lm_head.weight")


def load_drafter(drafter_dir: str | Path, target_dir: str | Path, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.bfloat16, yarn_amplitude: float | None = None) -> DFlashDrafter:
    cfg = DFlashConfig.from_json(drafter_dir, yarn_amplitude=yarn_amplitude)
    target = CheckpointIndex(target_dir)
    embed = _read_first(target, TARGET_EMBED).to(device, dtype)
    head = _read_first(target, TARGET_HEAD).to(device, dtype)
    _check_target(cfg, embed, head)
    with torch.device("meta"):  # no init of billions of random parameters; load_state_dict assigns
        model = DFlashDrafter(cfg, vocab_size=embed.shape[0])
    return attach(model, read_drafter_state(drafter_dir, model, device, dtype), embed, head, device)


def attach(model: DFlashDrafter, state: dict[str, torch.Tensor], embed: torch.Tensor, head: torch.Tensor,
           device: torch.device | str) -> DFlashDrafter:
    """A drafter built on the meta device gets its tensors (already on `device`) and the target's tables."""
    model.load_state_dict(state, strict=True, assign=True)
    model.embed_tokens, model.lm_head = embed, head
    model.inv_freq = model.inv_freq.to(device)
    return model.requires_grad_(False).eval()


def read_drafter_state(drafter_dir: str | Path, model: DFlashDrafter, device: torch.device | str,
                       dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Drafter checkpoint → state dict keyed like `model`, every name and shape checked."""
    index = CheckpointIndex(drafter_dir)
    expected = {name: p.shape for name, p in model.named_parameters()}
    by_name = {}
    for stored in index.names():
        name = stored.removeprefix("model.")
        if name not in expected:
            raise CheckpointError(f"{drafter_dir}: unexpected drafter tensor {stored!r}")
        if name in by_name:
            raise CheckpointError(f"{drafter_dir}: tensor {name!r} stored both with and without 'model.'")
        by_name[name] = stored
    missing = sorted(set(expected) - set(by_name))
    if missing:
        raise CheckpointError(f"{drafter_dir}: missing drafter tensors {missing[:8]}{' …' if len(missing) > 8 else ''}")
    state = {}
    for name, stored in by_name.items():
        tensor = index.read(stored)
        if tuple(tensor.shape) != tuple(expected[name]):
            raise CheckpointError(f"{drafter_dir}: {stored} has shape {tuple(tensor.shape)}, config implies "
                                  f"{tuple(expected[name])}")
        state[name] = tensor.to(device, dtype)
    return state


def _read_first(index: CheckpointIndex, names: tuple[str, ...]) -> torch.Tensor:
    for name in names:
        if name in index:
            return index.read(name)
    raise CheckpointError(f"{index.dir}: target checkpoint has none of {list(names)}")


def _check_target(cfg: DFlashConfig, embed: torch.Tensor, head: torch.Tensor) -> None:
    if embed.ndim != 2 or embed.shape[1] != cfg.hidden_size:
        raise CheckpointError(f"target embed_tokens {tuple(embed.shape)} is not [vocab, hidden_size="
                              f"{cfg.hidden_size}]: drafter and target hidden sizes must match")
    if head.shape != embed.shape:
        raise CheckpointError(f"target lm_head {tuple(head.shape)} does not match embed_tokens {tuple(embed.shape)}")
    vocab = embed.shape[0]
    if cfg.vocab_size is not None and cfg.vocab_size != vocab:
        raise CheckpointError(f"drafter config vocab_size={cfg.vocab_size} but the target vocab is {vocab}")
    if cfg.mask_token_id >= vocab:
        raise CheckpointError(f"dflash_config.mask_token_id={cfg.mask_token_id} is not a row of the target "
                              f"embedding (vocab {vocab})")
