"""DFlash drafter: config parsing, YaRN tables, checkpoint loading, and the cached engine against the plain
non-cached reference forward."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from topk_check import assert_topk_matches
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from drafter_service.engine import DrafterEngine, EngineOptions, ProposeItem
from drafter_service.model import rope_inv_freq
from drafter_service.model_config import KIMI_YARN_AMPLITUDE, ConfigError, DFlashConfig
from drafter_service.reference import forward_ref
from drafter_service.tiny_checkpoint import spread_layer_ids, write_tiny_drafter, write_tiny_target_tables
from service_kit.checkpoint import CheckpointError

HIDDEN, VOCAB, MASK = 256, 1024, 1023
SMALL = EngineOptions(window=None, page_size=8, cache_bytes=1 << 22)


def kimi_k25_config() -> dict:
    """z-lab/Kimi-K2.5-DFlash config.json as reproduced by vllm-ascend's test (+ intermediate/block size)."""
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 7168, "vocab_size": 163840,
        "head_dim": 128, "num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 6,
        "num_target_layers": 61, "max_position_embeddings": 262144, "rope_theta": 50000.0,
        "intermediate_size": 18432, "block_size": 8,
        "dflash_config": {"target_layer_ids": [1, 12, 24, 35, 47, 58], "mask_token_id": 163838},
        "rope_scaling": {"rope_type": "yarn", "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0},
    }


def hf_inv_freq(raw: dict) -> torch.Tensor:
    """Independent oracle: transformers' own rope init for a Qwen3 config."""
    rope = dict(raw.get("rope_scaling") or {"rope_type": "default"})
    if rope["rope_type"] == "default":
        return 1.0 / raw["rope_theta"] ** (torch.arange(0, raw["head_dim"], 2).float() / raw["head_dim"])
    rope |= {"rope_type": "yarn", "rope_theta": raw["rope_theta"]}  # deepseek_yarn is plain YaRN
    cfg = Qwen3Config(hidden_size=raw["hidden_size"], num_attention_heads=raw["num_attention_heads"],
                      head_dim=raw["head_dim"], max_position_embeddings=raw.get("max_position_embeddings", 262144),
                      rope_parameters=rope)
    return ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")[0]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafter")
    write_tiny_drafter(root / "drafter", target_hidden_size=HIDDEN, target_num_layers=4, vocab_size=VOCAB,
                       mask_token_id=MASK, seed=3)
    write_tiny_target_tables(root / "target", hidden_size=HIDDEN, vocab_size=VOCAB, seed=4)
    return root / "drafter", root / "target"


def reference_logits(drafter_dir, target_dir, features, first_position, root, yarn_amplitude=None):
    raw = json.loads((drafter_dir / "config.json").read_text())
    cfg = DFlashConfig.from_dict(raw, yarn_amplitude=yarn_amplitude)
    state = {k: v.float() for k, v in load_file(drafter_dir / "model.safetensors").items()}
    target = {k: v.float() for k, v in load_file(target_dir / "model-00001-of-00001.safetensors").items()}
    return forward_ref(state, cfg, target["language_model.model.embed_tokens.weight"],
                       target["language_model.lm_head.weight"], hf_inv_freq(raw), features, first_position, root)


def draft_logprobs(engine, session, start, features, root, k=64):
    [res] = engine.propose([ProposeItem(session, start, features, root, k, return_draft_logprobs=True)])
    return res


# --- config ---------------------------------------------------------------------------------------------

def test_kimi_config_fields_and_amplitude_knob():
    cfg = DFlashConfig.from_dict(kimi_k25_config())
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (8, 163838, (1, 12, 24, 35, 47, 58))
    assert cfg.feature_width == 6 * 7168 and cfg.horizon == 7
    assert cfg.rope.kind == "yarn" and cfg.rope.amplitude == KIMI_YARN_AMPLITUDE
    assert DFlashConfig.from_dict(kimi_k25_config(), yarn_amplitude=1.0).rope.amplitude == 1.0
    raw = kimi_k25_config()
    raw["rope_scaling"]["attention_factor"] = 1.25  # a checkpoint that states it explicitly
    assert DFlashConfig.from_dict(raw).rope.amplitude == 1.25
    assert spread_layer_ids(61, 6) == [1, 12, 24, 35, 47, 58]


def test_k26_rope_parameters_and_nested_block_size():
    raw = kimi_k25_config()
    rope = raw.pop("rope_scaling") | {"rope_type": "deepseek_yarn", "rope_theta": raw.pop("rope_theta")}
    raw["rope_parameters"] = rope
    raw["dflash_config"]["block_size"] = raw.pop("block_size")
    cfg = DFlashConfig.from_dict(raw)
    assert cfg.block_size == 8 and cfg.rope.kind == "yarn" and cfg.rope.theta == 50000.0
    assert cfg == DFlashConfig.from_dict(kimi_k25_config())


@pytest.mark.parametrize("edit,field", [
    (lambda r: r["dflash_config"].pop("mask_token_id"), "mask_token_id"),
    (lambda r: r["dflash_config"].pop("target_layer_ids"), "target_layer_ids"),
    (lambda r: r.pop("block_size"), "block_size"),
    (lambda r: r.pop("hidden_size"), "hidden_size"),
    (lambda r: r.pop("intermediate_size"), "intermediate_size"),
    (lambda r: r.update(num_key_value_heads=5), "num_key_value_heads"),
    (lambda r: r["rope_scaling"].update(rope_type="longrope"), "rope_type"),
    (lambda r: r["rope_scaling"].pop("factor"), "factor"),
    (lambda r: r.update(num_target_layers=40), "num_target_layers"),
    (lambda r: r.update(layer_types=["full_attention"]), "layer_types"),
    (lambda r: r.update(layer_types=["sliding_attention"] * 6), "sliding_window"),
])
def test_config_errors_name_the_field(edit, field):
    raw = kimi_k25_config()
    edit(raw)
    with pytest.raises(ConfigError, match=field):
        DFlashConfig.from_dict(raw)


@pytest.mark.parametrize("raw", [kimi_k25_config(), {**kimi_k25_config(), "rope_scaling": None, "rope_theta": 1e6},
                                 {**kimi_k25_config(), "head_dim": 64,
                                  "rope_scaling": kimi_k25_config()["rope_scaling"] | {"factor": 8.0}}])
def test_rope_inv_freq_matches_transformers(raw):
    cfg = DFlashConfig.from_dict(raw)
    torch.testing.assert_close(rope_inv_freq(cfg.rope, cfg.head_dim), hf_inv_freq(raw), rtol=1e-6, atol=0)


# --- checkpoint -----------------------------------------------------------------------------------------

def test_tiny_checkpoint_is_deterministic_in_released_layout(tmp_path):
    cfg = write_tiny_drafter(tmp_path / "a", target_hidden_size=256, target_num_layers=4, vocab_size=2048,
                             mask_token_id=2047, seed=1)
    write_tiny_drafter(tmp_path / "b", target_hidden_size=256, target_num_layers=4, vocab_size=2048,
                       mask_token_id=2047, seed=1)
    write_tiny_drafter(tmp_path / "c", target_hidden_size=256, target_num_layers=4, vocab_size=2048,
                       mask_token_id=2047, seed=2)
    a, b, c = (load_file(tmp_path / d / "model.safetensors") for d in "abc")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["fc.weight"], c["fc.weight"])
    assert len(a) == 3 + 11 * 2 and all(t.dtype == torch.bfloat16 for t in a.values())
    assert a["fc.weight"].shape == (256, 2 * 256) and a["layers.1.self_attn.k_proj.weight"].shape == (128, 256)
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"target_layer_ids": [0, 3], "mask_token_id": 2047}
    assert json.loads((tmp_path / "a" / "config.json").read_text()) == cfg


def test_prefixed_drafter_and_unprefixed_target_load_the_same(ckpt, tmp_path):
    drafter, target = ckpt
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text((drafter / "config.json").read_text())
    tensors = {f"model.{k}": v for k, v in load_file(drafter / "model.safetensors").items()}
    save_file(tensors, str(tmp_path / "d" / "model.safetensors"))
    index = {"weight_map": {k: "model.safetensors" for k in tensors}}
    (tmp_path / "d" / "model.safetensors.index.json").write_text(json.dumps(index))
    write_tiny_target_tables(tmp_path / "t", hidden_size=HIDDEN, vocab_size=VOCAB, seed=4, prefix="")
    features = torch.randn(5, 2 * HIDDEN).bfloat16()
    runs = [draft_logprobs(DrafterEngine.load(d, t, dtype=torch.float32, options=SMALL), "s", 0, features, 7)
            for d, t in ((drafter, target), (tmp_path / "d", tmp_path / "t"))]
    np.testing.assert_array_equal(runs[0].topk_logprobs, runs[1].topk_logprobs)


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.pop("layers.1.mlp.up_proj.weight"), "missing drafter tensors"),
    (lambda t: t.update({"lm_head.weight": torch.zeros(4, 4)}), "unexpected drafter tensor"),
    (lambda t: t.update({"fc.weight": torch.zeros(256, 256)}), "fc.weight has shape"),
])
def test_bad_drafter_checkpoint(ckpt, tmp_path, edit, match):
    drafter, target = ckpt
    tensors = load_file(drafter / "model.safetensors")
    edit(tensors)
    (tmp_path / "config.json").write_text((drafter / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "model.safetensors" for k in tensors}}))
    with pytest.raises(CheckpointError, match=match):
        DrafterEngine.load(tmp_path, target, dtype=torch.float32, options=SMALL)


def _copy_drafter(src, dst, **config_changes):
    raw = json.loads((src / "config.json").read_text())
    raw["dflash_config"] |= config_changes.pop("dflash_config", {})
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(raw | config_changes))
    for name in ("model.safetensors", "model.safetensors.index.json"):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


def test_target_must_match_the_drafter(ckpt, tmp_path):
    drafter, target = ckpt
    write_tiny_target_tables(tmp_path / "small_vocab", hidden_size=HIDDEN, vocab_size=MASK, seed=0)
    with pytest.raises(CheckpointError, match="vocab_size"):
        DrafterEngine.load(drafter, tmp_path / "small_vocab", dtype=torch.float32, options=SMALL)
    bad_mask = _copy_drafter(drafter, tmp_path / "bad_mask", vocab_size=None, dflash_config={"mask_token_id": VOCAB})
    with pytest.raises(CheckpointError, match="mask_token_id"):
        DrafterEngine.load(bad_mask, target, dtype=torch.float32, options=SMALL)
    write_tiny_target_tables(tmp_path / "narrow", hidden_size=128, vocab_size=VOCAB, seed=0)
    with pytest.raises(CheckpointError, match="hidden"):
        DrafterEngine.load(drafter, tmp_path / "narrow", dtype=torch.float32, options=SMALL)


# --- forward parity -------------------------------------------------------------------------------------

@pytest.mark.parametrize("amplitude", [None, 1.0])  # Kimi's tuned 1.4158883 and transformers' 1.0 (P3)
def test_engine_matches_reference_forward(ckpt, amplitude):
    drafter, target = ckpt
    engine = DrafterEngine.load(drafter, target, dtype=torch.float32, yarn_amplitude=amplitude, options=SMALL)
    torch.manual_seed(0)
    features, root = torch.randn(21, 2 * HIDDEN).bfloat16(), 11
    res = draft_logprobs(engine, "s", 0, features, root)
    ref = torch.log_softmax(reference_logits(drafter, target, features, 0, root, amplitude), -1)
    assert_topk_matches(res.topk_ids, res.topk_logprobs, ref)
    [chain] = engine.propose([ProposeItem("s", 21, features[:0], root, 0, mode="chain")])
    assert chain.tree.tokens.tolist() == ref.argmax(-1).tolist()  # chain = per-position argmax


def test_amplitude_knob_changes_the_draft(ckpt):
    drafter, target = ckpt
    features = torch.randn(9, 2 * HIDDEN).bfloat16()
    a, b = (reference_logits(drafter, target, features, 100, 5, amp) for amp in (None, 1.0))
    assert (a - b).abs().max() > 1e-2


def engine_matches_reference(drafter_dir, target_dir, features, root):
    """Top-64 draft ids and log-probs of a fresh fp32 engine against the reference forward's (ids equal up to
    near-ties, log-probs to 2e-5); returns (engine, its result)."""
    engine = DrafterEngine.load(drafter_dir, target_dir, dtype=torch.float32, options=SMALL)
    res = draft_logprobs(engine, "s", 0, features, root)
    ref = torch.log_softmax(reference_logits(drafter_dir, target_dir, features, 0, root), -1)
    assert_topk_matches(res.topk_ids, res.topk_logprobs, ref)
    return engine, res


def test_sliding_attention_layers_match_reference(ckpt, tmp_path):
    drafter, target = ckpt
    sliding = _copy_drafter(drafter, tmp_path / "sliding", layer_types=["sliding_attention", "full_attention"],
                            sliding_window=6)
    features = torch.randn(17, 2 * HIDDEN).bfloat16()
    _, res = engine_matches_reference(sliding, target, features, 3)
    full = draft_logprobs(DrafterEngine.load(drafter, target, dtype=torch.float32, options=SMALL), "s", 0,
                          features, 3)
    assert np.abs(full.topk_logprobs - res.topk_logprobs).max() > 1e-3  # the window did change the draft


def test_softcapped_logits_match_reference_and_fill_a_given_buffer(ckpt, tmp_path):
    """final_logit_softcapping against the reference forward; `logits(out=)` (the block graphs' static
    logits buffer) writes the same values into the buffer it is given."""
    drafter, target = ckpt
    capped = _copy_drafter(drafter, tmp_path / "capped", final_logit_softcapping=2.0)
    engine, _ = engine_matches_reference(capped, target, torch.randn(9, 2 * HIDDEN).bfloat16(), 4)
    hidden = torch.randn(2, 3, HIDDEN)
    for model in (engine.model, DrafterEngine.load(drafter, target, dtype=torch.float32, options=SMALL).model):
        out = torch.full((2, 3, VOCAB), float("nan"))
        assert model.logits(hidden, out=out) is out and torch.equal(out, model.logits(hidden))
