"""Config parsing and checkpoint loading: layouts accepted, and every defect named in the error."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from model_fixtures import single_thread, tiny_dir  # noqa: F401
from safetensors.torch import load_file, save_file

from service_kit.checkpoint import CheckpointError, CheckpointIndex
from verifier_service.model_config import ConfigError, K2Config
from verifier_service.moe import MoEWeights, moe_experts_ref, route
from verifier_service.weights import LoadProgress, expert_range, load_target_weights

QB = "language_model.model.layers.2.self_attn.q_b_proj.weight"


def rewrite(src: Path, dst: Path, mutate: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """Copy a checkpoint, letting `mutate` edit the {name: tensor} dict; shards and index rebuilt."""
    shutil.copytree(src, dst)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    tensors = {n: t for f in files for n, t in load_file(src / f).items()}
    mutate(tensors)
    shard_of = {n: index["weight_map"].get(n, files[0]) for n in tensors}
    for f in files:
        save_file({n: t for n, t in tensors.items() if shard_of[n] == f}, dst / f, metadata={"format": "pt"})
    index["weight_map"] = dict(sorted(shard_of.items()))
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def edit_config(model_dir: Path, edit: Callable[[dict], None]) -> dict:
    raw = json.loads((model_dir / "config.json").read_text())
    edit(raw)
    return raw


# ---- config ---------------------------------------------------------------------------------


def test_k26_wrapper_config(tiny_dir):
    cfg = K2Config.from_json(tiny_dir)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.n_routed_experts, cfg.kv_cache_width) == (256, 4, 16, 48)
    assert cfg.eos_token_id == (2, 3) and cfg.bos_token_id == 1
    assert cfg.quantization_config is not None and cfg.quantization_config.group_size == 32
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 64.0
    assert cfg.is_moe_layer(1) and not cfg.is_moe_layer(0)


def test_alternative_layouts_parse_identically(tiny_dir):
    base = K2Config.from_json(tiny_dir)

    def quant_on_top(raw):
        raw["quantization_config"] = raw["text_config"].pop("quantization_config")

    def flat_k2(raw):  # K2 / K2-Thinking: text fields at the top level, eos an int
        raw.update(raw.pop("text_config"))
        raw["eos_token_id"] = [2, 3]

    def rope_parameters(raw):  # transformers 5 / K2.6 spelling
        t = raw["text_config"]
        rope = t.pop("rope_scaling")
        rope.pop("type")
        t["rope_parameters"] = {"rope_type": "deepseek_yarn", "rope_theta": t.pop("rope_theta"), **rope}

    for edit in (quant_on_top, flat_k2, rope_parameters):
        assert K2Config.from_json(edit_config(tiny_dir, edit)) == base, edit.__name__
    single_eos = K2Config.from_json(edit_config(tiny_dir, lambda r: r["text_config"].update(eos_token_id=2)))
    assert single_eos.eos_token_id == (2,)


@pytest.mark.parametrize("edit, culprit", [
    (lambda t: t.pop("kv_lora_rank"), "text_config.kv_lora_rank"),
    (lambda t: t["rope_scaling"].pop("beta_fast"), "text_config.rope_scaling.beta_fast"),
    (lambda t: t["rope_scaling"].update(type="longrope"), "text_config.rope_scaling.type"),
    (lambda t: t.update(n_group=4, topk_group=5), "topk_group"),
    (lambda t: t.update(n_group=3), "n_group"),
    (lambda t: t.update(scoring_func="softmax"), "scoring_func"),
    (lambda t: t.update(hidden_size="256"), "text_config.hidden_size"),
    (lambda t: t.update(num_key_value_heads=2), "text_config.num_key_value_heads"),
    (lambda t: t.update(first_k_dense_replace=9), "first_k_dense_replace"),
    (lambda t: t["quantization_config"]["config_groups"]["group_0"]["weights"].update(num_bits=8), "num_bits"),
    (lambda t: t.update(eos_token_id=[2, 9999]), "eos_token_id"),
])
def test_config_errors_name_the_field(tiny_dir, edit, culprit):
    raw = edit_config(tiny_dir, lambda r: edit(r["text_config"]))
    with pytest.raises(ConfigError, match=culprit.replace(".", r"\.")):
        K2Config.from_json(raw)


def test_config_missing_on_disk(tmp_path, tiny_dir):
    bad = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, bad)
    raw = edit_config(tiny_dir, lambda r: r["text_config"].pop("moe_intermediate_size"))
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="text_config.moe_intermediate_size"):
        load_target_weights(bad)


# ---- checkpoint defects -------------------------------------------------------------------------


def test_missing_tensor(tmp_path, tiny_dir):
    bad = rewrite(tiny_dir, tmp_path / "c", lambda t: t.pop(QB))
    with pytest.raises(CheckpointError, match=r"missing tensors: .*layers\.2\.self_attn\.q_b_proj\.weight"):
        load_target_weights(bad)


def test_missing_expert_tensor(tmp_path, tiny_dir):
    name = "language_model.model.layers.3.mlp.experts.11.down_proj.weight_scale"
    bad = rewrite(tiny_dir, tmp_path / "c", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"layers\.3\.mlp\.experts\.11\.down_proj\.weight_scale"):
        load_target_weights(bad, ep_rank=0, ep_size=2)  # validated even though rank 0 does not load it


def test_index_lists_tensor_missing_from_shard(tmp_path, tiny_dir):
    bad = tmp_path / "c"
    shutil.copytree(tiny_dir, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    index["weight_map"][QB] = "model-00001-of-000006.safetensors"  # wrong shard
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"q_b_proj\.weight.*model-00001-of-000006"):
        load_target_weights(bad)


def test_wrong_shape(tmp_path, tiny_dir):
    bad = rewrite(tiny_dir, tmp_path / "c", lambda t: t.update({QB: t[QB][:-1]}))
    with pytest.raises(CheckpointError, match=r"q_b_proj\.weight.*shape \[191, 64\].*\[192, 64\]"):
        load_target_weights(bad)


def test_wrong_logical_expert_shape(tmp_path, tiny_dir):
    name = "language_model.model.layers.1.mlp.experts.0.up_proj.weight_shape"
    bad = rewrite(tiny_dir, tmp_path / "c", lambda t: t.update({name: torch.tensor([64, 255], dtype=torch.int32)}))
    with pytest.raises(CheckpointError, match=r"experts\.0\.up_proj\.weight_shape.*\[64, 255\]"):
        load_target_weights(bad)


def test_unexpected_tensor(tmp_path, tiny_dir):
    extra = "language_model.model.layers.0.self_attn.q_proj.weight"
    bad = rewrite(tiny_dir, tmp_path / "c", lambda t: t.update({extra: torch.zeros(2, 2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors.*layers\.0\.self_attn\.q_proj\.weight"):
        load_target_weights(bad)


def test_truncated_shard(tmp_path, tiny_dir):
    bad = tmp_path / "c"
    shutil.copytree(tiny_dir, bad)
    shard = bad / "model-00003-of-000006.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="model-00003-of-000006.safetensors"):
        load_target_weights(bad)


# ---- what gets loaded ---------------------------------------------------------------------------


def test_expert_range_uneven_split():
    sizes = [len(expert_range(384, r, 7)) for r in range(7)]
    assert sizes == [55] * 6 + [54]
    ranges = [expert_range(16, r, 3) for r in range(3)]
    assert [(r.start, r.stop) for r in ranges] == [(0, 6), (6, 11), (11, 16)]
    with pytest.raises(ValueError):
        expert_range(16, 3, 3)
    with pytest.raises(ValueError):
        expert_range(4, 0, 5)


def test_loaded_dtypes_and_skips(tiny_dir):
    w = load_target_weights(tiny_dir, dtype=torch.bfloat16)
    moe = w.layers[1].mlp
    assert isinstance(moe, MoEWeights)
    assert moe.gate.dtype == torch.bfloat16  # as stored (K2.6's router is bf16; an fp32 model gets fp32)
    assert moe.e_score_correction_bias.dtype == torch.float32 and moe.e_score_correction_bias.abs().sum() > 0
    assert load_target_weights(tiny_dir, dtype=torch.float32).layers[1].mlp.gate.dtype == torch.float32
    assert moe.experts.gate_proj.packed.dtype == torch.int32 and moe.experts.gate_proj.packed.shape == (16, 64, 32)
    assert moe.experts.down_proj.scale.dtype == torch.bfloat16 and moe.experts.down_proj.scale.shape == (16, 256, 2)
    assert w.layers[0].self_attn.q_b_proj.dtype == torch.bfloat16
    assert w.embed_tokens.dtype == torch.bfloat16 and w.lm_head.shape == (512, 256)


def test_ep_rank_loads_only_its_experts(tiny_dir, monkeypatch):
    read: list[str] = []
    original = CheckpointIndex.read
    monkeypatch.setattr(CheckpointIndex, "read", lambda self, name: read.append(name) or original(self, name))
    seen: list[LoadProgress] = []
    full = load_target_weights(tiny_dir, dtype=torch.float32)
    parts = []
    for rank in range(3):
        read.clear()
        parts.append(load_target_weights(tiny_dir, dtype=torch.float32, ep_rank=rank, ep_size=3, progress=seen.append))
        mine = expert_range(16, rank, 3)
        experts_read = {int(n.split(".mlp.experts.")[1].split(".")[0]) for n in read if ".mlp.experts." in n}
        assert experts_read == set(mine)
        assert not any(n.startswith(("vision_tower.", "mm_projector.")) for n in read)
        assert not any(n.endswith(("q_b_proj.weight", "kv_b_proj.weight", "o_proj.weight")) for n in read)
        sliced = 3 * 4  # q_b_proj, kv_b_proj, o_proj per layer: read as head slices, not whole tensors
        assert seen[-1].tensors_done == seen[-1].tensors_total == len(read) + sliced
        assert seen[-1].bytes_done == seen[-1].bytes_total > 0
    # The ranks' routed outputs sum to the full routed output (tokens on other ranks' experts give 0).
    cfg = K2Config.from_json(tiny_dir)
    x = torch.randn(20, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    layer = full.layers[2].mlp
    ids, wts = route(x, layer, cfg)
    whole = moe_experts_ref(x, ids, wts, layer.experts)
    summed = sum(moe_experts_ref(x, ids, wts, p.layers[2].mlp.experts) for p in parts)
    assert torch.allclose(summed, whole, atol=1e-5)
    assert parts[1].layers[2].mlp.experts.first == 6
    assert torch.equal(parts[1].layers[2].mlp.experts.up_proj.packed, layer.experts.up_proj.packed[6:11])


def test_names_without_language_model_prefix(tmp_path, tiny_dir):
    def strip(t):
        for n in list(t):
            if n.startswith("language_model."):
                t[n.removeprefix("language_model.")] = t.pop(n)

    plain = rewrite(tiny_dir, tmp_path / "c", strip)
    a, b = load_target_weights(tiny_dir, dtype=torch.float32), load_target_weights(plain, dtype=torch.float32)
    assert torch.equal(a.lm_head, b.lm_head)
    assert torch.equal(a.layers[3].mlp.experts.down_proj.packed, b.layers[3].mlp.experts.down_proj.packed)


def test_tiny_checkpoint_is_deterministic(tmp_path):
    from model_fixtures import make_target

    a, b = make_target(tmp_path / "a", seed=5), make_target(tmp_path / "b", seed=5)
    for f in sorted(p.name for p in a.iterdir()):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    shards = sorted(p.name for p in a.glob("model-*.safetensors"))
    assert len(shards) >= 2 and shards[0] == "model-00001-of-000006.safetensors"
    c = make_target(tmp_path / "c", seed=6)
    assert (a / shards[0]).read_bytes() != (c / shards[0]).read_bytes()
    raw = json.loads((a / "config.json").read_text())
    assert raw["model_type"] == "kimi_k25" and raw["text_config"]["model_type"] == "kimi_k2"


def test_single_file_checkpoint_without_index(tmp_path):
    """Released DFlash drafters ship one model.safetensors and no index."""
    from safetensors.torch import save_file

    from service_kit.checkpoint import CheckpointIndex

    save_file({"a.weight": torch.ones(2, 3), "b": torch.zeros(4)}, str(tmp_path / "model.safetensors"))
    idx = CheckpointIndex(tmp_path)
    assert idx.names() == ["a.weight", "b"]
    assert torch.equal(idx.read("a.weight"), torch.ones(2, 3))
