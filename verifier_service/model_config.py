"""The target model's architecture, parsed once from the checkpoint's `config.json`.

Accepted layouts (reference/k26.md §1):
- K2.5 / K2.6: a `kimi_k25` wrapper whose `text_config` holds the DeepSeek-V3 text model;
  `quantization_config` sits at the top level or inside `text_config`.
- K2 / K2-Thinking: the DeepSeek-V3 fields at the top level.
RoPE comes as `rope_scaling` (+ top-level `rope_theta`) or as transformers-5 `rope_parameters`
(which carries `rope_theta` itself). Every architectural number is read from the file; a missing,
unknown or contradictory value raises `ConfigError` naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from service_kit.checkpoint import read_config_json
from typing import Any

YARN_TYPES = ("yarn", "deepseek_yarn")  # K2.6 spells it "deepseek_yarn" in rope_parameters
PLAIN_ROPE_TYPES = ("default",)


class ConfigError(ValueError):
    """config.json is missing a field or holds a value this model does not support."""


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (DeepSeek flavour). Field names follow the JSON keys."""

    type: str
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float


@dataclass(frozen=True)
class QuantScheme:
    """compressed-tensors pack-quantized weights: symmetric int, one scale per `group_size` inputs."""

    num_bits: int
    group_size: int


@dataclass(frozen=True)
class K2Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP (layers < first_k_dense_replace)
    moe_intermediate_size: int  # per routed / shared expert
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    scoring_func: str
    topk_method: str
    hidden_act: str
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None  # None = plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int
    eos_token_id: tuple[int, ...]  # the file may hold an int or a list
    quantization_config: QuantScheme | None  # None = no INT4 tensors expected
    num_nextn_predict_layers: int = 0  # MTP layers stored after the last layer; never run here

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_width(self) -> int:
        """Values cached per token per layer: normalized latent + rotated shared rope key (576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5 · m², m = yarn_mscale(factor, mscale_all_dim) (k26.md §3.5)."""
        m = 1.0
        if self.rope_scaling is not None:
            m = yarn_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim)
        return self.qk_head_dim**-0.5 * m * m

    @property
    def rope_amplitude(self) -> float:
        """cos/sin multiplier: yarn_mscale(f, mscale) / yarn_mscale(f, mscale_all_dim); 1.0 for K2.6."""
        rs = self.rope_scaling
        if rs is None:
            return 1.0
        return yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim)

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @classmethod
    def from_json(cls, source: str | Path | Mapping[str, Any]) -> K2Config:
        """`source`: a config.json path, a checkpoint directory, or the already-parsed dict."""
        raw = _read_raw(source)
        return _parse(raw)


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _read_raw(source: str | Path | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(source, Mapping):
        return source
    path, raw = read_config_json(source, ConfigError)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level is not a JSON object")
    return raw


class _Fields:
    """Typed reads from one JSON object; errors name the dotted field path."""

    def __init__(self, obj: Mapping[str, Any], where: str):
        self.obj, self.where = obj, where

    def name(self, key: str) -> str:
        return f"{self.where}{key}"

    def has(self, key: str) -> bool:
        return self.obj.get(key) is not None

    def get(self, key: str, kind: type, default: Any = ...) -> Any:
        if key not in self.obj or self.obj[key] is None:
            if default is ...:
                raise ConfigError(f"config.json: missing field {self.name(key)!r}")
            return default
        value = self.obj[key]
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise ConfigError(f"config.json: {self.name(key)}={value!r} is not a {kind.__name__}")
        return value


def _parse(raw: Mapping[str, Any]) -> K2Config:
    top = _Fields(raw, "")
    text = _Fields(raw["text_config"], "text_config.") if "text_config" in raw else top
    ints = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
            "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
            "num_experts_per_tok", "n_shared_experts", "n_group", "topk_group",
            "first_k_dense_replace", "max_position_embeddings")
    values: dict[str, Any] = {k: text.get(k, int) for k in ints}
    values.update(
        routed_scaling_factor=text.get("routed_scaling_factor", float),
        norm_topk_prob=text.get("norm_topk_prob", bool),
        scoring_func=text.get("scoring_func", str),
        topk_method=text.get("topk_method", str),
        hidden_act=text.get("hidden_act", str),
        rms_norm_eps=text.get("rms_norm_eps", float),
        tie_word_embeddings=text.get("tie_word_embeddings", bool, top.get("tie_word_embeddings", bool, False)),
        num_nextn_predict_layers=text.get("num_nextn_predict_layers", int, 0),
        bos_token_id=_token_ids(text, top, "bos_token_id")[0],
        eos_token_id=_token_ids(text, top, "eos_token_id"),
        quantization_config=_parse_quant(text, top),
    )
    values["rope_theta"], values["rope_scaling"] = _parse_rope(text)
    _check_unsupported(text)
    return K2Config(**values)


def _token_ids(text: _Fields, top: _Fields, key: str) -> tuple[int, ...]:
    src = text if text.has(key) else top
    value = src.get(key, object)
    ids = list(value) if isinstance(value, list) else [value]
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"config.json: {src.name(key)}={value!r} is not a token id or list of ids")
    return tuple(ids)


def _parse_rope(text: _Fields) -> tuple[float, RopeScaling | None]:
    if text.has("rope_parameters"):
        params = _Fields(text.get("rope_parameters", dict), text.name("rope_parameters."))
        theta, type_key = params.get("rope_theta", float), "rope_type"
    elif text.has("rope_scaling"):
        params = _Fields(text.get("rope_scaling", dict), text.name("rope_scaling."))
        theta = text.get("rope_theta", float)
        type_key = "type" if params.has("type") else "rope_type"
    else:
        return text.get("rope_theta", float), None
    rope_type = params.get(type_key, str)
    if rope_type in PLAIN_ROPE_TYPES:
        return theta, None
    if rope_type not in YARN_TYPES:
        raise ConfigError(f"config.json: {params.name(type_key)}={rope_type!r} is not a supported "
                          f"rope type (expected one of {YARN_TYPES + PLAIN_ROPE_TYPES})")
    rs = RopeScaling(
        type="yarn",
        factor=params.get("factor", float),
        original_max_position_embeddings=params.get("original_max_position_embeddings", int),
        beta_fast=params.get("beta_fast", float),
        beta_slow=params.get("beta_slow", float),
        mscale=params.get("mscale", float),
        mscale_all_dim=params.get("mscale_all_dim", float),
    )
    if rs.factor < 1:
        raise ConfigError(f"config.json: {params.name('factor')}={rs.factor} must be >= 1")
    if rs.beta_fast <= rs.beta_slow:
        raise ConfigError(f"config.json: {params.name('beta_fast')}={rs.beta_fast} must exceed "
                          f"{params.name('beta_slow')}={rs.beta_slow}")
    return theta, rs


def _parse_quant(text: _Fields, top: _Fields) -> QuantScheme | None:
    src = text if text.has("quantization_config") else top
    if not src.has("quantization_config"):
        return None
    q = _Fields(src.get("quantization_config", dict), src.name("quantization_config."))
    method, fmt = q.get("quant_method", str), q.get("format", str)
    if method != "compressed-tensors" or fmt != "pack-quantized":
        raise ConfigError(f"config.json: {q.name('quant_method')}/{q.name('format')}={method}/{fmt} "
                          "is not supported (expected compressed-tensors/pack-quantized)")
    groups = q.get("config_groups", dict)
    if len(groups) != 1:
        raise ConfigError(f"config.json: {q.name('config_groups')} must hold exactly one group")
    (gname, group), = groups.items()
    w = _Fields(_Fields(group, q.name(f"config_groups.{gname}.")).get("weights", dict),
                q.name(f"config_groups.{gname}.weights."))
    scheme = QuantScheme(num_bits=w.get("num_bits", int), group_size=w.get("group_size", int))
    expected = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    for key, want in expected.items():
        got = w.get(key, type(want))
        if got != want:
            raise ConfigError(f"config.json: {w.name(key)}={got!r} is not supported (expected {want!r})")
    if w.has("actorder"):
        raise ConfigError(f"config.json: {w.name('actorder')} is not supported (g_idx reordering)")
    return scheme


def _check_unsupported(text: _Fields) -> None:
    """Fields whose non-default values would change the math in ways this model does not implement."""
    if text.get("moe_layer_freq", int, 1) != 1:
        raise ConfigError(f"config.json: {text.name('moe_layer_freq')} must be 1")
    if text.get("attention_bias", bool, False):
        raise ConfigError(f"config.json: {text.name('attention_bias')}=true is not supported")
    heads = text.get("num_attention_heads", int)
    if text.get("num_key_value_heads", int, heads) != heads:
        raise ConfigError(f"config.json: {text.name('num_key_value_heads')} must equal "
                          "num_attention_heads (MLA has one latent KV head shared by all heads)")


def _validate(c: K2Config) -> None:
    def bad(field: str, why: str) -> ConfigError:
        return ConfigError(f"config.json: {field}={getattr(c, field)!r} {why}")

    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim",
                  "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group"):
        if getattr(c, field) <= 0:
            raise bad(field, "must be positive")
    if c.qk_rope_head_dim % 2:
        raise bad("qk_rope_head_dim", "must be even (rotation pairs)")
    if c.n_routed_experts % c.n_group:
        raise bad("n_group", f"does not divide n_routed_experts={c.n_routed_experts}")
    if c.topk_group > c.n_group:
        raise bad("topk_group", f"exceeds n_group={c.n_group}")
    if c.n_group > 1 and c.n_routed_experts // c.n_group < 2:
        raise bad("n_group", "leaves fewer than 2 experts per group (group score = top-2 sum)")
    if c.num_experts_per_tok > c.topk_group * (c.n_routed_experts // c.n_group):
        raise bad("num_experts_per_tok", "exceeds the experts in the kept groups")
    if not 0 <= c.first_k_dense_replace <= c.num_hidden_layers:
        raise bad("first_k_dense_replace", f"is outside [0, num_hidden_layers={c.num_hidden_layers}]")
    if c.scoring_func != "sigmoid":
        raise bad("scoring_func", "is not supported (expected 'sigmoid')")
    if c.topk_method != "noaux_tc":
        raise bad("topk_method", "is not supported (expected 'noaux_tc')")
    if c.hidden_act != "silu":
        raise bad("hidden_act", "is not supported (expected 'silu')")
    q = c.quantization_config
    if q is not None and (c.hidden_size % q.group_size or c.moe_intermediate_size % q.group_size):
        raise ConfigError(f"config.json: quantization group_size={q.group_size} does not divide "
                          f"hidden_size={c.hidden_size} and moe_intermediate_size={c.moe_intermediate_size}")
    if c.bos_token_id >= c.vocab_size:
        raise bad("bos_token_id", f"is outside the vocabulary (vocab_size={c.vocab_size})")
    if any(i >= c.vocab_size for i in c.eos_token_id):
        raise bad("eos_token_id", f"is outside the vocabulary (vocab_size={c.vocab_size})")
