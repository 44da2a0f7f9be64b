"""Load the target's weights for one rank from an HF safetensors checkpoint (reference/k26.md §2).

- Names with or without the `language_model.` prefix; `vision_tower.*` / `mm_projector.*` skipped;
  MTP layers (index >= num_hidden_layers) skipped.
- A linear is INT4 iff `<name>.weight_packed` exists: kept packed (int32 words, bf16 group scales,
  logical shape). Everything else is cast to the model dtype, except the router (its weight keeps the stored
  dtype, bf16 for K2.6, fp32 in an fp32 model; `e_score_correction_bias` stays fp32) and dense routed experts,
  which keep their stored dtype.
- Every name and header shape is checked against the config before any data is read: missing,
  unexpected or mis-shaped tensors and unreadable shards raise `CheckpointError` naming them.
- Lazy: one tensor at a time; a rank reads only its routed experts (`expert_range`).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from service_kit.checkpoint import CheckpointError, CheckpointIndex
from service_kit.logs import get_logger
from verifier_service.int4 import NIBBLES_PER_WORD, Int4Weight, tile_int4, tileable
from verifier_service.mla import MLAWeights
from verifier_service.model import LayerWeights, TargetWeights
from verifier_service.model_config import K2Config
from verifier_service.expert_shard import ExpertShard
from verifier_service.moe import ExpertStack, MLPWeights, MoEWeights
from verifier_service.ranks import split_range, split_rows

log = get_logger("verifier.weights")

TEXT_PREFIX = "language_model."
SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.")
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
_TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I32": torch.int32}


def expert_range(n_experts: int, ep_rank: int, ep_size: int) -> range:
    """Contiguous expert ids of one rank; the first n % size ranks get one more (384 / 7 = 55×6 + 54)."""
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank {ep_rank} outside [0, ep_size={ep_size})")
    if ep_size > n_experts:
        raise ValueError(f"ep_size {ep_size} exceeds the {n_experts} routed experts")
    base, extra = divmod(n_experts, ep_size)
    start = ep_rank * base + min(ep_rank, extra)
    return range(start, start + base + (ep_rank < extra))


@dataclass(frozen=True)
class LoadProgress:
    tensors_done: int
    tensors_total: int
    bytes_done: int
    bytes_total: int
    elapsed_s: float

    @property
    def rate_bytes_per_s(self) -> float:
        return self.bytes_done / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float:
        rate = self.rate_bytes_per_s
        return (self.bytes_total - self.bytes_done) / rate if rate > 0 else float("inf")


class LogProgress:
    """Default progress callback: one structured log event every `every_s` seconds, and one at the end."""

    def __init__(self, every_s: float = 5.0, logger=log):
        self.every_s, self.logger, self._last = every_s, logger, 0.0

    def __call__(self, p: LoadProgress) -> None:
        done = p.tensors_done == p.tensors_total
        if not done and p.elapsed_s - self._last < self.every_s:
            return
        self._last = p.elapsed_s
        self.logger.info(
            "weights_loaded" if done else "loading_weights",
            tensors=f"{p.tensors_done}/{p.tensors_total}", gb_done=round(p.bytes_done / 1e9, 2),
            gb_total=round(p.bytes_total / 1e9, 2), mb_per_s=round(p.rate_bytes_per_s / 1e6),
            eta_s=0.0 if done else round(p.eta_s, 1), elapsed_s=round(p.elapsed_s, 1),
        )


def load_target_weights(
    model_dir: str | Path,
    cfg: K2Config | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    ep_rank: int = 0,
    ep_size: int = 1,
    progress: Callable[[LoadProgress], None] | None = None,
    split_replicated: bool = False,
    expert_slices: int = 1,
) -> TargetWeights:
    """Validate the checkpoint against `cfg` (default: its own config.json), then load this rank's part:
    routed experts `expert_range(n, ep_rank, ep_size)` (with `expert_slices` S > 1, the expert slices
    `ExpertShard(ep_rank, ep_size, S)` deals it, each read without the rest of its expert) and attention heads
    `head_range(heads, ep_rank, ep_size)` (slices of q_b_proj / kv_b_proj rows and o_proj columns, likewise).
    `split_replicated` also splits the dense and shared MLPs (gate/up rows, down columns) and the
    embedding / lm_head vocab rows over the ranks (96 GB cards)."""
    cfg = cfg if cfg is not None else K2Config.from_json(model_dir)
    index = CheckpointIndex(model_dir)
    index.open_all()
    stored = _canonical_names(index, cfg)
    packed = ".weight_packed"
    expected = expected_shapes(cfg, int4_linears={n[: -len(packed)] for n in stored if n.endswith(packed)})
    _check_names(index, stored, expected)
    _check_shapes(index, stored, expected)
    expert_range(cfg.n_routed_experts, ep_rank, ep_size)  # checks the rank and world
    shard = ExpertShard(ep_rank, ep_size, expert_slices)
    check_expert_slices(cfg.moe_intermediate_size, expert_slices, cfg.quantization_config)
    pieces = shard.pieces(cfg.n_routed_experts)
    # Heads like experts (64 over 7 → 10 + 9×6); a rank may hold none (tiny models at world size 7).
    heads = split_range(cfg.num_attention_heads, ep_rank, ep_size)
    reader = _Reader(index, stored, torch.device(device), progress or LogProgress())
    held = collections.Counter(e for e, _ in pieces)  # a tensor is read once per piece of its expert
    reader.plan([n for n in expected for _ in range(_wanted(n, held))])
    split = Split(ep_rank, ep_size) if split_replicated else None
    layers = tuple(_layer(reader, cfg, i, shard, heads, dtype, split) for i in range(cfg.num_hidden_layers))
    vocab = split.of(cfg.vocab_size) if split else None
    embed = reader.get("model.embed_tokens.weight", dtype, rows=vocab)
    head = embed if cfg.tie_word_embeddings else reader.get("lm_head.weight", dtype, rows=vocab)
    norm = reader.get("model.norm.weight", dtype)
    return TargetWeights(embed_tokens=embed, layers=layers, norm=norm, lm_head=head,
                         vocab_start=vocab.start if vocab else 0)


@dataclass(frozen=True)
class Split:
    """This rank's share of a dimension split over ranks (contiguous, as even as possible)."""

    rank: int
    size: int

    def of(self, n: int) -> range:
        return split_rows(n, self.rank, self.size)


def expected_shapes(cfg: K2Config, int4_linears: set[str]) -> dict[str, tuple[int, ...]]:
    """Canonical name (no `language_model.`) -> shape, for every text tensor the config implies.
    Routed-expert linears in `int4_linears` are expected packed, the others as plain `weight`."""
    H, heads = cfg.hidden_size, cfg.num_attention_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, H), "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, H)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        shapes.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            a + "q_a_proj.weight": (cfg.q_lora_rank, H), a + "q_a_layernorm.weight": (cfg.q_lora_rank,),
            a + "q_b_proj.weight": (heads * cfg.qk_head_dim, cfg.q_lora_rank),
            a + "kv_a_proj_with_mqa.weight": (cfg.kv_cache_width, H), a + "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
            a + "kv_b_proj.weight": (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
            a + "o_proj.weight": (H, heads * cfg.v_head_dim),
        })
        if not cfg.is_moe_layer(i):
            shapes.update(_mlp_shapes(p + "mlp.", H, cfg.intermediate_size))
            continue
        shapes[p + "mlp.gate.weight"] = (cfg.n_routed_experts, H)
        shapes[p + "mlp.gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
        if cfg.n_shared_experts:
            shapes.update(_mlp_shapes(p + "mlp.shared_experts.", H, cfg.moe_intermediate_size * cfg.n_shared_experts))
        for e in range(cfg.n_routed_experts):
            for base, (out, inp) in _expert_linears(p, e, cfg).items():
                if base in int4_linears:
                    group = cfg.quantization_config.group_size if cfg.quantization_config else 0
                    shapes[base + ".weight_packed"] = (out, inp // NIBBLES_PER_WORD)
                    shapes[base + ".weight_scale"] = (out, inp // group) if group else (out, -1)
                    shapes[base + ".weight_shape"] = (2,)
                else:
                    shapes[base + ".weight"] = (out, inp)
    return shapes


def _mlp_shapes(p: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {p + "gate_proj.weight": (inter, hidden), p + "up_proj.weight": (inter, hidden),
            p + "down_proj.weight": (hidden, inter)}


def _expert_linears(p: str, e: int, cfg: K2Config) -> dict[str, tuple[int, int]]:
    H, inter = cfg.hidden_size, cfg.moe_intermediate_size
    dims = {"gate_proj": (inter, H), "up_proj": (inter, H), "down_proj": (H, inter)}
    return {f"{p}mlp.experts.{e}.{proj}": dims[proj] for proj in EXPERT_PROJS}


def _canonical_names(index: CheckpointIndex, cfg: K2Config) -> dict[str, str]:
    """Canonical name -> stored name, without skipped (vision, projector, MTP) tensors."""
    mtp = tuple(f"model.layers.{cfg.num_hidden_layers + k}." for k in range(cfg.num_nextn_predict_layers))
    out: dict[str, str] = {}
    for stored in index.names():
        name = stored[len(TEXT_PREFIX):] if stored.startswith(TEXT_PREFIX) else stored
        if name.startswith(SKIPPED_PREFIXES) or (mtp and name.startswith(mtp)):
            continue
        if name in out:
            raise CheckpointError(f"{index.dir}: tensor {name!r} is stored both with and without {TEXT_PREFIX!r}")
        out[name] = stored
    return out


def _check_names(index: CheckpointIndex, stored: dict[str, str], expected: dict[str, tuple[int, ...]]) -> None:
    def listing(names: list[str]) -> str:
        return ", ".join(names[:8]) + (f" ... ({len(names)} in all)" if len(names) > 8 else "")

    missing = sorted(n for n in expected if n not in stored)
    if missing:
        raise CheckpointError(f"{index.dir}: missing tensors: {listing(missing)}")
    extra = sorted(stored[n] for n in stored if n not in expected)
    if extra:
        raise CheckpointError(f"{index.dir}: unexpected tensors (not in the config's architecture): {listing(extra)}")


def _check_shapes(index: CheckpointIndex, stored: dict[str, str], expected: dict[str, tuple[int, ...]]) -> None:
    for name, want in expected.items():
        got = index.shape(stored[name])
        if len(got) != len(want) or any(w not in (-1, g) for w, g in zip(want, got)):
            raise CheckpointError(f"{index.dir}: tensor {stored[name]!r} has shape {list(got)}, "
                                  f"config implies {[d if d >= 0 else '?' for d in want]}")
        if name.endswith(".weight_packed") and index.dtype(stored[name]) != "I32":
            raise CheckpointError(f"{index.dir}: {stored[name]!r} is {index.dtype(stored[name])}, expected I32")
        if name.endswith(".weight_scale") and want[1] < 0:
            raise CheckpointError(f"{index.dir}: {stored[name]!r} is INT4 but config.json has no quantization_config")


def _wanted(name: str, held: collections.Counter) -> int:
    """How many times this rank reads a tensor: once if replicated, once per piece it holds of a routed expert."""
    if ".mlp.experts." not in name:
        return 1
    return held[int(name.split(".mlp.experts.")[1].split(".")[0])]


def check_expert_slices(inter: int, slices: int, quant) -> None:
    """An expert cuts into `slices` slices of whole INT4 scale groups (K2.6: 2048 = 64 groups of 32 → 1, 2, 4, ...)."""
    group = quant.group_size if quant else 1
    if slices < 1 or inter % slices or (inter // slices) % group:
        raise ValueError(f"expert_slices: {slices} does not cut moe_intermediate_size {inter} into whole "
                         f"groups of {group}")


class _Reader:
    """Reads tensors by canonical name, moves them to the device, reports progress."""

    def __init__(self, index: CheckpointIndex, stored: dict[str, str], device: torch.device,
                 progress: Callable[[LoadProgress], None]):
        self.index, self.stored, self.device, self.progress = index, stored, device, progress
        self.total_tensors = self.total_bytes = self.done_tensors = self.done_bytes = 0
        self.start = time.monotonic()

    def plan(self, names: list[str]) -> None:
        self.total_tensors = len(names)
        self.total_bytes = sum(self.index.nbytes(self.stored[n]) for n in names)

    def get(self, name: str, dtype: torch.dtype | None, rows: range | None = None,
            cols: range | None = None) -> torch.Tensor:
        """dtype None keeps the stored dtype. rows/cols read only that block of a 2-D tensor."""
        stored = self.stored[name]
        if rows is None and cols is None:
            t = self.index.read(stored)
        else:
            r = slice(None) if rows is None else slice(rows.start, rows.stop)
            c = slice(None) if cols is None else slice(cols.start, cols.stop)
            t = self.index._slice(stored)[r, c]
        t = t.to(self.device) if dtype is None else t.to(self.device, dtype)
        self.done_tensors += 1
        self.done_bytes += self.index.nbytes(stored)
        self.progress(LoadProgress(self.done_tensors, self.total_tensors, self.done_bytes,
                                   self.total_bytes, time.monotonic() - self.start))
        return t


def _attention(r: _Reader, cfg: K2Config, a: str, heads: range, dtype: torch.dtype) -> MLAWeights:
    """This rank's heads: per-head row blocks of q_b_proj ([nope ; rope]) and kv_b_proj ([W_UK ; W_UV]),
    column block of o_proj. The latent projections are replicated."""
    def per_head(width: int) -> range:
        return range(heads.start * width, heads.stop * width)

    full = {k: r.get(a + k + ".weight", dtype) for k in (
        "q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")}
    return MLAWeights(
        **full,
        q_b_proj=r.get(a + "q_b_proj.weight", dtype, rows=per_head(cfg.qk_head_dim)),
        kv_b_proj=r.get(a + "kv_b_proj.weight", dtype, rows=per_head(cfg.qk_nope_head_dim + cfg.v_head_dim)),
        o_proj=r.get(a + "o_proj.weight", dtype, cols=per_head(cfg.v_head_dim)))


def _layer(r: _Reader, cfg: K2Config, i: int, experts: ExpertShard, heads: range, dtype: torch.dtype,
           split: Split | None) -> LayerWeights:
    p = f"model.layers.{i}."
    attn = _attention(r, cfg, p + "self_attn.", heads, dtype)
    if cfg.is_moe_layer(i):
        inter = split.of(cfg.moe_intermediate_size * cfg.n_shared_experts) if split else None
        shared = _mlp(r, p + "mlp.shared_experts.", dtype, inter) if cfg.n_shared_experts else None
        mlp: MLPWeights | MoEWeights = MoEWeights(
            # the stored dtype (K2.6: bf16, logits on tensor cores in fp32, kernels/moe_gate); fp32 in an fp32 model
            gate=r.get(p + "mlp.gate.weight", torch.float32 if dtype == torch.float32 else None),
            e_score_correction_bias=r.get(p + "mlp.gate.e_score_correction_bias", torch.float32),
            experts=_experts(r, p, cfg, experts),
            shared_experts=shared,
        )
    else:
        mlp = _mlp(r, p + "mlp.", dtype, split.of(cfg.intermediate_size) if split else None)
    return LayerWeights(
        input_layernorm=r.get(p + "input_layernorm.weight", dtype),
        self_attn=attn,
        post_attention_layernorm=r.get(p + "post_attention_layernorm.weight", dtype),
        mlp=mlp,
    )


def _mlp(r: _Reader, p: str, dtype: torch.dtype, inter: range | None = None) -> MLPWeights:
    """SwiGLU weights; `inter` = this rank's intermediate rows (gate/up rows, down columns)."""
    return MLPWeights(r.get(p + "gate_proj.weight", dtype, rows=inter),
                      r.get(p + "up_proj.weight", dtype, rows=inter),
                      r.get(p + "down_proj.weight", dtype, cols=inter))


def _experts(r: _Reader, p: str, cfg: K2Config, shard: ExpertShard) -> ExpertStack:
    """Stack this rank's experts (or expert slices: gate/up rows, down columns) per projection into preallocated
    [E_local, ...] tensors."""
    n, S = cfg.n_routed_experts, shard.slices
    pieces = shard.pieces(n)
    stacks = {}
    for proj in EXPERT_PROJS:
        base = f"{p}mlp.experts.{pieces[0][0]}.{proj}"
        int4 = base + ".weight_packed" in r.stored
        parts = (".weight_packed", ".weight_scale") if int4 else (".weight",)
        dim = 1 if proj == "down_proj" else 0  # the intermediate dim a slice cuts
        full = _expert_linears(p, pieces[0][0], cfg)[base]
        shape = (full[0], full[1] // S) if dim else (full[0] // S, full[1])
        sizes = [list(r.index.shape(r.stored[base + s])) for s in parts]
        for size in sizes:
            size[dim] //= S
        bufs = [torch.empty(len(pieces), *size, dtype=_TORCH_DTYPES[r.index.dtype(r.stored[base + s])],
                            device=r.device) for size, s in zip(sizes, parts)]
        # On a GPU, INT4 experts are stored in the tiled order kernels/moe_w4a16 reads, each expert tiled as read.
        tiled = int4 and bufs[0].is_cuda and tileable(shape, shape[1] // bufs[1].shape[-1])
        for j, (e, sl) in enumerate(pieces):
            eb = f"{p}mlp.experts.{e}.{proj}"
            got = [_read_slice(r, eb + s, buf.shape[1 + dim], sl, dim) for buf, s in zip(bufs, parts)]
            for buf, t in zip(bufs, tile_int4(*got) if tiled else got):
                buf[j] = t
            if int4:
                _check_logical_shape(r, eb, _expert_linears(p, e, cfg)[eb])
        stacks[proj] = Int4Weight(bufs[0], bufs[1], shape, tiled) if int4 else bufs[0]
    return ExpertStack(**stacks, first=shard.first(n), slices=S, rank=shard.rank, world=shard.world)


def _read_slice(r: _Reader, name: str, size: int, index: int, dim: int) -> torch.Tensor:
    """Slice `index` (of `size` rows or columns along `dim`) of a stored 2-D tensor, read without the rest."""
    part = range(index * size, (index + 1) * size)
    whole = r.index.shape(r.stored[name])[dim] == size
    return r.get(name, None) if whole else r.get(name, None, **{"rows" if dim == 0 else "cols": part})


def _check_logical_shape(r: _Reader, base: str, want: tuple[int, int]) -> None:
    got = tuple(int(v) for v in r.get(base + ".weight_shape", None).tolist())
    if got != want:
        raise CheckpointError(f"{r.index.dir}: {r.stored[base + '.weight_shape']!r} holds {list(got)}, "
                              f"config implies {list(want)}")
