"""DFlash drafter configuration, parsed once from a released checkpoint's `config.json`.

Released DFlash drafters are Qwen3-style configs plus DFlash extras (`reference/ddtree.md` §1.9):
`block_size` (top level, or nested in `dflash_config` by newer checkpoints), `dflash_config.target_layer_ids`
and `dflash_config.mask_token_id`. RoPE comes as `rope_scaling` (transformers 4) or `rope_parameters`
(transformers 5; Kimi K2.6 ships `rope_type: "deepseek_yarn"`, which is plain YaRN over the full head).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from service_kit.checkpoint import read_config_json

# cos/sin amplitude the Kimi DFlash drafters were tuned with: legacy YaRN ignored mscale/mscale_all_dim and
# used 1 + 0.1·ln(64). transformers' YaRN gives 1.0 for mscale = mscale_all_dim = 1 ("reduces draft
# acceptance", reference/k26.md §7), so the amplitude is a knob, not derived.
KIMI_YARN_AMPLITUDE = 1.4158883

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


class ConfigError(ValueError):
    """config.json is missing a field or holds a value the drafter cannot run with (the field is named)."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    kind: str = "default"  # "default" | "yarn"
    # YaRN only (ignored for "default"):
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    amplitude: float = 1.0  # multiplies cos and sin, i.e. scales q·k by amplitude²

    def __post_init__(self):
        if self.kind not in ("default", "yarn"):
            raise ConfigError(f"rope kind must be 'default' or 'yarn', got {self.kind!r}")
        if self.theta <= 0:
            raise ConfigError(f"rope_theta must be > 0, got {self.theta}")
        if self.kind == "yarn" and (self.factor <= 0 or self.original_max_position_embeddings <= 0):
            raise ConfigError("rope_scaling.factor and rope_scaling.original_max_position_embeddings must be > 0")


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    block_size: int  # query block incl. the anchor; the draft horizon is block_size - 1
    target_layer_ids: tuple[int, ...]  # 0-based target layer outputs (HF hidden_states[id + 1])
    mask_token_id: int
    rope: RopeConfig
    num_target_layers: int | None = None
    vocab_size: int | None = None  # when set, must equal the target embedding rows (weights.py checks)
    attention_bias: bool = False
    layer_types: tuple[str, ...] = ()  # empty = all full attention
    sliding_window: int | None = None  # only used by "sliding_attention" layers
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    def __post_init__(self):
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotate-half RoPE, got {self.head_dim}")
        if self.block_size < 2:
            raise ConfigError(f"block_size must be >= 2 (anchor + at least one mask slot), got {self.block_size}")
        if not self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise ConfigError(f"dflash_config.target_layer_ids must be non-empty and >= 0: {self.target_layer_ids}")
        if self.num_target_layers is not None and max(self.target_layer_ids) >= self.num_target_layers:
            raise ConfigError(f"dflash_config.target_layer_ids {list(self.target_layer_ids)} exceed "
                              f"num_target_layers={self.num_target_layers}")
        if self.mask_token_id < 0:
            raise ConfigError(f"dflash_config.mask_token_id must be >= 0, got {self.mask_token_id}")
        if self.layer_types:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ConfigError(f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is "
                                  f"{self.num_hidden_layers}")
            bad = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
            if bad:
                raise ConfigError(f"layer_types: unknown attention types {sorted(bad)}")
            if SLIDING_ATTENTION in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
                raise ConfigError("sliding_window must be > 0 when layer_types has sliding_attention layers")

    @property
    def feature_width(self) -> int:
        """Width of one target feature row: concat of the hidden states after each target layer id."""
        return len(self.target_layer_ids) * self.hidden_size

    @property
    def horizon(self) -> int:
        return self.block_size - 1

    def layer_window(self, layer: int) -> int | None:
        """Per-layer sliding window of the checkpoint (None = full attention)."""
        if self.layer_types and self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    @classmethod
    def from_json(cls, path: str | Path, *, yarn_amplitude: float | None = None) -> "DFlashConfig":
        """`path` is a config.json or the checkpoint directory holding it."""
        _, raw = read_config_json(path, ConfigError, "drafter config")
        return cls.from_dict(raw, yarn_amplitude=yarn_amplitude)

    @classmethod
    def from_dict(cls, raw: dict, *, yarn_amplitude: float | None = None) -> "DFlashConfig":
        """yarn_amplitude: cos/sin amplitude for YaRN; None = `attention_factor` from the rope dict if the
        checkpoint states one, else KIMI_YARN_AMPLITUDE."""
        dflash = raw.get("dflash_config") or {}
        hidden = _int(raw, "hidden_size")
        heads = _int(raw, "num_attention_heads")
        layers = _int(raw, "num_hidden_layers")
        ids = _dflash_value(raw, dflash, "target_layer_ids")
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise ConfigError(f"dflash_config.target_layer_ids must be a list of ints, got {ids!r}")
        return cls(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=_int(raw, "num_key_value_heads", heads),
            head_dim=_int(raw, "head_dim", hidden // heads),
            intermediate_size=_int(raw, "intermediate_size"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),  # Qwen3Config's default
            block_size=int(_dflash_value(raw, dflash, "block_size")),
            target_layer_ids=tuple(ids),
            mask_token_id=int(_dflash_value(raw, dflash, "mask_token_id")),
            rope=_parse_rope(raw, yarn_amplitude),
            num_target_layers=raw.get("num_target_layers"),
            vocab_size=raw.get("vocab_size"),
            attention_bias=bool(raw.get("attention_bias", False)),
            layer_types=_parse_layer_types(raw, layers),
            sliding_window=raw.get("sliding_window"),
            input_embedding_scale=float(_dflash_value(raw, dflash, "input_embedding_scale", 1.0)),
            output_multiplier=float(_dflash_value(raw, dflash, "output_multiplier", 1.0)),
            final_logit_softcapping=_dflash_value(raw, dflash, "final_logit_softcapping", None),
        )


_MISSING = object()


def _int(raw: dict, key: str, default=_MISSING) -> int:
    value = raw.get(key, default)
    if value is _MISSING or value is None:
        raise ConfigError(f"config.json: required field {key!r} is missing")
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"config.json: {key!r} must be an int, got {value!r}")
    return value


def _dflash_value(raw: dict, dflash: dict, key: str, default=_MISSING):
    """DFlash extras live in `dflash_config` (preferred, as the reference code reads them) or at top level."""
    if key in dflash:
        return dflash[key]
    if key in raw:
        return raw[key]
    if default is _MISSING:
        raise ConfigError(f"config.json: required field dflash_config.{key} (or top-level {key}) is missing")
    return default


def _parse_rope(raw: dict, yarn_amplitude: float | None) -> RopeConfig:
    field = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    rope = raw.get(field) or {}
    theta = rope.get("rope_theta", raw.get("rope_theta"))
    if theta is None:
        raise ConfigError("config.json: rope_theta is missing (top level or in rope_parameters)")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return RopeConfig(theta=float(theta))
    if kind not in ("yarn", "deepseek_yarn"):
        raise ConfigError(f"config.json: {field}.rope_type {kind!r} is not supported (default, yarn, deepseek_yarn)")
    for key in ("factor", "original_max_position_embeddings"):
        if rope.get(key) is None:
            raise ConfigError(f"config.json: {field}.{key} is required for YaRN")
    if yarn_amplitude is None:
        yarn_amplitude = rope.get("attention_factor") or KIMI_YARN_AMPLITUDE
    return RopeConfig(
        theta=float(theta),
        kind="yarn",
        factor=float(rope["factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        truncate=bool(rope.get("truncate", True)),
        amplitude=float(yarn_amplitude),
    )


def _parse_layer_types(raw: dict, layers: int) -> tuple[str, ...]:
    if raw.get("layer_types"):
        return tuple(raw["layer_types"])
    # Qwen3Config derives layer types from use_sliding_window/max_window_layers. A bare `sliding_window`
    # without `use_sliding_window` is a default Qwen3 leftover and does not enable anything.
    if raw.get("use_sliding_window"):
        first = int(raw.get("max_window_layers", 0))
        return tuple(SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(layers))
    return ()
