"""Full-dimension Kimi K2.6 weights with random values, made directly on the device (no checkpoint).

For benchmarks of the real shapes and for `ddtree verifier --synthetic PRESET`: `preset_config` is
K2.6's text config (`k26`) or a small model of the same architecture and vocabulary for CPU tests
(`k26-mini`), optionally with fewer layers; `random_target` builds one rank's slice (its heads and
experts; with `split`, also its share of the dense and shared MLPs and the vocab rows of embeddings and
head, as `--split-replicated` loads a checkpoint) in the checkpoint's formats: bf16 attention / dense /
shared / embeddings / head / router, INT4 pack-quantized routed experts, fp32 router bias. Magnitudes keep
activations O(1) so the numerics stay representative.

Every tensor, and every head block and expert of a split tensor, draws from its own generator seeded
by (seed, name): any rank of any world size builds the same values for the same parts, so the
replicated parts agree across ranks and a model split over N ranks equals the unsplit one.
"""

from __future__ import annotations

import hashlib
import math

import torch

from verifier_service.int4 import Int4Weight, tileable
from verifier_service.mla import MLAWeights
from verifier_service.model import LayerWeights, TargetWeights
from verifier_service.model_config import K2Config
from verifier_service.expert_shard import ExpertShard
from verifier_service.moe import ExpertStack, MLPWeights, MoEWeights
from verifier_service.weights import Split

K26_TEXT_CONFIG = {  # reference/k26.md §1.2
    "model_type": "kimi_k2", "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
    "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 384, "num_experts_per_tok": 8,
    "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "routed_scaling_factor": 2.827, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc", "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "max_position_embeddings": 262144, "tie_word_embeddings": False, "bos_token_id": 163584,
    "eos_token_id": 163585, "attention_bias": False, "num_nextn_predict_layers": 0,
    "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                "group_size": 32, "dynamic": False}}}},
}

# CPU-test size, same architecture and the real vocabulary (token ids, BOS/EOS and the drafter's mask id
# stay K2.6's, so one synthetic tokenizer serves both presets). 16 experts / 4 heads split over 2-7 ranks.
K26_MINI_OVERRIDES = {
    "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 32,
    "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 16,
    "num_experts_per_tok": 4,
}
PRESETS = {"k26": K26_TEXT_CONFIG, "k26-mini": {**K26_TEXT_CONFIG, **K26_MINI_OVERRIDES}}


def preset_config(name: str, num_layers: int = 0) -> K2Config:
    """The preset's config; `num_layers` > 0 replaces its layer count (layer 0 stays dense)."""
    if name not in PRESETS:
        raise ValueError(f"synthetic preset {name!r} is not one of {sorted(PRESETS)}")
    raw = PRESETS[name]
    return K2Config.from_json({**raw, "num_hidden_layers": num_layers or raw["num_hidden_layers"]})


def k26_config(num_layers: int = 61) -> K2Config:
    return preset_config("k26", num_layers)


class _Random:
    """Random tensors on the device, each from a generator keyed by (seed, *key)."""

    def __init__(self, device, dtype, seed: int):
        self.device, self.dtype, self.seed = torch.device(device), dtype, seed

    def gen(self, *key) -> torch.Generator:
        digest = hashlib.blake2b(repr((self.seed, *key)).encode(), digest_size=8).digest()
        return torch.Generator(device=self.device).manual_seed(int.from_bytes(digest, "little") >> 1)

    def dense(self, key: tuple, out: int, inp: int, fan_in: int | None = None, dtype=None, rows: range | None = None,
              cols: range | None = None) -> torch.Tensor:
        """[out, in], std 1/sqrt(fan_in) (default: in); `rows` / `cols`: only that block of it (the whole
        tensor is drawn, so every split of it is a slice of the same values)."""
        t = torch.empty(out, inp, device=self.device, dtype=dtype or self.dtype)
        t.normal_(0.0, 1.0 / math.sqrt(fan_in or inp), generator=self.gen(*key))
        if (rows is None or len(rows) == out) and (cols is None or len(cols) == inp):
            return t
        rows, cols = rows if rows is not None else range(out), cols if cols is not None else range(inp)
        return t[rows.start: rows.stop, cols.start: cols.stop].clone()

    def head_rows(self, key: tuple, heads: range, rows: int, inp: int) -> torch.Tensor:
        """[len(heads)·rows, in]: one [rows, in] block per head (q_b_proj, kv_b_proj)."""
        blocks = [self.dense((*key, h), rows, inp) for h in heads]
        return torch.cat(blocks) if blocks else torch.empty(0, inp, device=self.device, dtype=self.dtype)

    def head_cols(self, key: tuple, heads: range, out: int, cols: int, fan_in: int) -> torch.Tensor:
        """[out, len(heads)·cols]: one [out, cols] block per head (o_proj); std from the full fan-in."""
        blocks = [self.dense((*key, h), out, cols, fan_in) for h in heads]
        return torch.cat(blocks, 1) if blocks else torch.empty(out, 0, device=self.device, dtype=self.dtype)

    def norm(self, n: int) -> torch.Tensor:
        return torch.ones(n, device=self.device, dtype=self.dtype)

    def int4(self, key: tuple, pieces: list[tuple[int, int]], S: int, out: int, inp: int, dim: int = 0) -> Int4Weight:
        """Uniform random nibbles (q in [-8, 7], std ≈ 4.6) with scales giving std 1/sqrt(in), per expert. On a GPU
        the draw is taken as the tiled order (int4.tile_int4) the INT4 kernel reads, as the loader stores K2.6's.
        `pieces`: (expert, slice) pairs (ExpertShard.pieces), slice s of S of dim `dim` (0: rows, 1: columns) of
        each whole expert's draw (on a CPU every layout then holds the same values; on a GPU a slice of the draw is
        taken as the piece's tiled order)."""
        shape = (out // S, inp) if dim == 0 else (out, inp // S)
        rows, words = shape[0], shape[1] // 8
        packed = torch.empty(len(pieces), rows, words, device=self.device, dtype=torch.int32)
        whole = torch.empty(out, inp // 8, device=self.device, dtype=torch.int32)
        for j, (e, s) in enumerate(pieces):
            whole.random_(-2**31, 2**31 - 1, generator=self.gen(*key, e))
            packed[j] = whole[s * rows:(s + 1) * rows] if dim == 0 else whole[:, s * words:(s + 1) * words]
        scale = torch.full((len(pieces), shape[0], shape[1] // 32), 1.0 / (4.6 * math.sqrt(inp)), device=self.device,
                           dtype=torch.bfloat16)
        return Int4Weight(packed, scale, shape, packed.is_cuda and tileable(shape, 32))


def random_target(cfg: K2Config, *, experts: range | ExpertShard, heads: range, device="cuda",
                  dtype=torch.bfloat16, seed: int = 0, split: Split | None = None) -> TargetWeights:
    """`experts`: this rank's whole experts, or an ExpertShard (expert slices). `split` (rank, world): also this
    rank's rows of the dense and shared MLPs' gate/up, columns of their down, and vocab rows of embed_tokens /
    lm_head; None: those replicated."""
    r = _Random(device, dtype, seed)
    layers = tuple(_layer(r, cfg, i, experts, heads, split) for i in range(cfg.num_hidden_layers))
    vocab = split.of(cfg.vocab_size) if split else range(cfg.vocab_size)
    H = cfg.hidden_size
    return TargetWeights(embed_tokens=r.dense(("embed",), cfg.vocab_size, H, rows=vocab).mul_(50), layers=layers,
                         norm=r.norm(H), lm_head=r.dense(("lm_head",), cfg.vocab_size, H, rows=vocab),
                         vocab_start=vocab.start)


def _mlp(r: _Random, key: tuple, inter: int, H: int, split: Split | None) -> MLPWeights:
    """gate/up [inter, H] and down [H, inter]; split: this rank's rows of gate/up and columns of down."""
    part = split.of(inter) if split else range(inter)
    return MLPWeights(r.dense((*key, "gate"), inter, H, rows=part), r.dense((*key, "up"), inter, H, rows=part),
                      r.dense((*key, "down"), H, inter, cols=part))


def _layer(r: _Random, cfg: K2Config, i: int, experts: range | ExpertShard, heads: range,
           split: Split | None) -> LayerWeights:
    H = cfg.hidden_size
    attn = MLAWeights(
        q_a_proj=r.dense((i, "q_a"), cfg.q_lora_rank, H), q_a_layernorm=r.norm(cfg.q_lora_rank),
        q_b_proj=r.head_rows((i, "q_b"), heads, cfg.qk_head_dim, cfg.q_lora_rank),
        kv_a_proj_with_mqa=r.dense((i, "kv_a"), cfg.kv_lora_rank + cfg.qk_rope_head_dim, H),
        kv_a_layernorm=r.norm(cfg.kv_lora_rank),
        kv_b_proj=r.head_rows((i, "kv_b"), heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank),
        o_proj=r.head_cols((i, "o"), heads, H, cfg.v_head_dim, cfg.num_attention_heads * cfg.v_head_dim))
    if cfg.is_moe_layer(i):
        I, n = cfg.moe_intermediate_size, cfg.n_routed_experts
        sliced = isinstance(experts, ExpertShard)
        shard = experts if sliced else ExpertShard()
        pieces, S = shard.pieces(n) if sliced else [(e, 0) for e in experts], shard.slices
        mats = (r.int4((i, "gate"), pieces, S, I, H), r.int4((i, "up"), pieces, S, I, H),
                r.int4((i, "down"), pieces, S, H, I, dim=1))
        stack = ExpertStack(*mats, first=shard.first(n) if sliced else experts.start, slices=S, rank=shard.rank,
                            world=shard.world)
        shared = _mlp(r, (i, "shared"), I * cfg.n_shared_experts, H, split)
        bias = torch.randn(n, device=r.device, generator=r.gen(i, "bias")) * 0.01
        router = r.dense((i, "router"), n, H, dtype=torch.float32).to(r.dtype)  # stored like K2.6's (bf16)
        mlp = MoEWeights(gate=router, e_score_correction_bias=bias,
                         experts=stack, shared_experts=shared)
    else:
        mlp = _mlp(r, (i,), cfg.intermediate_size, H, split)
    return LayerWeights(input_layernorm=r.norm(H), self_attn=attn, post_attention_layernorm=r.norm(H), mlp=mlp)
