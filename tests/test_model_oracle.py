"""The target forward equals Hugging Face transformers' DeepseekV3ForCausalLM on the same weights.

HF is built independently of verifier_service: its config comes from the raw config.json, its weights
from the shards via safetensors, experts dequantized with compressed-tensors' own unpacker. fp32, eager.
HF rotates de-interleaved rope vectors (`rope_interleave=True`) while we rotate interleaved pairs; q and
k are permuted alike, so logits agree without touching the weights (reference/k26.md §3.4).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_fixtures import grouped_dir, load_model, new_cache, prefill, single_thread, tiny_dir  # noqa: F401
from safetensors.torch import load_file

from verifier_service.mla import rms_norm
from verifier_service.moe import MoEWeights, route
from verifier_service.plan import SeqRows, build_plan, chain_parents

transformers = pytest.importorskip("transformers")
unpack = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers").unpack_from_int32

REL_TOL = 1e-4
# Far-apart positions: below, inside and beyond the YaRN ramp (original context 4096).
ANCHOR_POSITIONS = [0, 9, 4100, 40000, 199000]


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref.float()).norm() / ref.float().norm()).item()


def hf_model(model_dir: Path):
    raw = json.loads((model_dir / "config.json").read_text())
    text = dict(raw["text_config"])
    rope = text.pop("rope_scaling")
    keep = ("vocab_size hidden_size intermediate_size moe_intermediate_size num_hidden_layers num_attention_heads "
            "num_key_value_heads n_shared_experts n_routed_experts routed_scaling_factor kv_lora_rank q_lora_rank "
            "qk_rope_head_dim v_head_dim qk_nope_head_dim n_group topk_group num_experts_per_tok "
            "first_k_dense_replace norm_topk_prob hidden_act max_position_embeddings rms_norm_eps "
            "tie_word_embeddings attention_bias").split()
    hf_cfg = transformers.DeepseekV3Config(
        **{k: text[k] for k in keep},
        rope_parameters={"rope_type": rope["type"], "rope_theta": text["rope_theta"],
                         **{k: v for k, v in rope.items() if k != "type"}},
        rope_interleave=True, num_mtp_layers=0, attn_implementation="eager",
    )
    model = transformers.DeepseekV3ForCausalLM(hf_cfg).float().eval()
    model.load_state_dict(_hf_state_dict(model_dir, text), strict=True)
    return model


def _hf_state_dict(model_dir: Path, text: dict) -> dict[str, torch.Tensor]:
    raw: dict[str, torch.Tensor] = {}
    for shard in sorted(model_dir.glob("model-*.safetensors")):
        raw.update(load_file(shard))
    sd = {k.removeprefix("language_model."): v.float() for k, v in raw.items()
          if k.startswith("language_model.") and ".mlp.experts." not in k}

    def expert(layer: int, e: int, proj: str) -> torch.Tensor:
        p = f"language_model.model.layers.{layer}.mlp.experts.{e}.{proj}."
        shape = torch.Size(raw[p + "weight_shape"].tolist())
        q = unpack(raw[p + "weight_packed"], 4, shape).float()  # [out, in]
        return q * raw[p + "weight_scale"].float().repeat_interleave(32, dim=1)

    for layer in range(text["first_k_dense_replace"], text["num_hidden_layers"]):
        n = text["n_routed_experts"]
        p = f"model.layers.{layer}.mlp.experts."
        sd[p + "gate_up_proj"] = torch.stack(
            [torch.cat([expert(layer, e, "gate_proj"), expert(layer, e, "up_proj")]) for e in range(n)])
        sd[p + "down_proj"] = torch.stack([expert(layer, e, "down_proj") for e in range(n)])
    return sd


def _inputs(seed: int, n: int = 24) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, 500, (n,), generator=g).tolist()
    extra = torch.randint(1, 262000, (n - len(ANCHOR_POSITIONS),), generator=g).tolist()
    positions = sorted(set(ANCHOR_POSITIONS + extra))
    while len(positions) < n:  # collisions are unlikely; pad deterministically
        positions.append(positions[-1] + 1)
    return tokens, positions


@pytest.fixture(scope="module", params=["tiny_dir", "grouped_dir"])
def case(request):
    model_dir = request.getfixturevalue(request.param)
    ours, hf = load_model(model_dir), hf_model(model_dir)
    tokens, positions = _inputs(seed=len(request.param))
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, layer in enumerate(hf.model.layers):
        if hasattr(layer.mlp, "gate"):
            def hook(_m, args, out, i=i):
                captured[i] = (args[0].detach().view(-1, args[0].shape[-1]), out[2].detach())
            layer.mlp.gate.register_forward_hook(hook)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([tokens]), position_ids=torch.tensor([positions]), output_hidden_states=True)
    return ours, tokens, positions, ref, captured


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit", "absorbed"])
def test_single_prefill_matches_hf(case, explicit):
    ours, tokens, positions, ref, _ = case
    layers = list(range(ours.cfg.num_hidden_layers))
    out = prefill(ours, new_cache(ours), "s", tokens, positions=positions, explicit=explicit, target_layer_ids=layers)
    assert rel_err(out.logits, ref.logits[0]) < REL_TOL
    H = ours.cfg.hidden_size
    for j, layer in enumerate(layers):  # layer outputs = HF hidden_states[id + 1] ...
        mine = out.hidden[:, j * H:(j + 1) * H]
        if layer == layers[-1]:  # ... except the last, which HF reports after the final norm
            mine = rms_norm(mine, ours.weights.norm, ours.cfg.rms_norm_eps)
        assert rel_err(mine, ref.hidden_states[layer + 1][0]) < REL_TOL, layer
    assert out.logits.argmax(-1).tolist() == ref.logits[0].argmax(-1).tolist()


def test_chunked_prefill_then_decode_matches_hf(case):
    """Cache path: explicit prefill chunk, absorbed chunk, then single-row decode steps."""
    ours, tokens, positions, ref, _ = case
    cache = new_cache(ours, page_size=3)  # page boundaries fall inside chunks
    logits = [prefill(ours, cache, "s", tokens[:10], positions=positions[:10]).logits,
              prefill(ours, cache, "s", tokens[10:17], positions=positions[10:17], explicit=False).logits]
    logits += [prefill(ours, cache, "s", [tokens[t]], positions=[positions[t]], explicit=False).logits
               for t in range(17, len(tokens))]
    assert rel_err(torch.cat(logits), ref.logits[0]) < REL_TOL


def test_batched_sessions_match_hf(case):
    """Two sessions in one forward: the same sequence split differently must not interact."""
    ours, tokens, positions, ref, _ = case
    cache = new_cache(ours)
    prefill(ours, cache, "a", tokens[:5], positions=positions[:5])
    cache.table.open("b")
    seqs = []
    for sid, start in (("a", 5), ("b", 0)):
        slots = cache.table.extend(sid, len(tokens) - start)
        seqs.append(SeqRows(tokens[start:], chain_parents(len(tokens) - start), start,
                            cache.table.pages(sid), slots, positions[start:]))
    out = ours.forward(build_plan(seqs, logit_rows=[0, 18, 19, 20, 37, 38]), cache.kv)
    expect = ref.logits[0][[5, 23, 0, 1, 18, 19]]
    assert rel_err(out.logits, expect) < REL_TOL


def test_expert_sets_match_hf(case):
    """Same inputs to the router -> same expert sets; and our own forward picks HF's sets."""
    ours, tokens, positions, _, captured = case
    seen: dict[int, torch.Tensor] = {}
    ours.on_experts = lambda layer, ids: seen.__setitem__(layer, ids.clone())
    try:
        prefill(ours, new_cache(ours), "s", tokens, positions=positions)
    finally:
        ours.on_experts = None
    bias_mattered = groups_mattered = False
    for layer, (x, hf_ids) in captured.items():
        w = ours.weights.layers[layer].mlp
        assert isinstance(w, MoEWeights)
        ids, _ = route(x, w, ours.cfg)
        assert ids.sort(-1).values.tolist() == hf_ids.sort(-1).values.tolist(), layer
        assert seen[layer].sort(-1).values.tolist() == hf_ids.sort(-1).values.tolist(), layer
        no_bias = MoEWeights(w.gate, torch.zeros_like(w.e_score_correction_bias), w.experts, w.shared_experts)
        bias_mattered |= not torch.equal(route(x, no_bias, ours.cfg)[0].sort(-1).values, ids.sort(-1).values)
        ungrouped = (x.float() @ w.gate.T).sigmoid() + w.e_score_correction_bias
        plain = ungrouped.topk(ours.cfg.num_experts_per_tok, -1).indices.sort(-1).values
        groups_mattered |= not torch.equal(plain, ids.sort(-1).values)
    assert bias_mattered, "fixture too weak: the selection bias never changed a choice"
    if ours.cfg.n_group > 1:
        assert groups_mattered, "fixture too weak: group limiting never changed a choice"


def test_bf16_no_worse_than_hf_bf16(tiny_dir):
    """bf16 weights, cache and activations: our drift from the fp32 oracle stays within HF's own bf16
    drift (the tiny random model is sensitive: near-tied routing choices flip under bf16)."""
    tokens, positions = _inputs(seed=3)
    hf = hf_model(tiny_dir)
    inputs = {"input_ids": torch.tensor([tokens]), "position_ids": torch.tensor([positions])}
    with torch.no_grad():
        ref = hf(**inputs).logits[0]
        hf_bf16 = hf.to(torch.bfloat16)(**inputs).logits[0]
    ours = load_model(tiny_dir, torch.bfloat16)
    for explicit in (True, False):
        out = prefill(ours, new_cache(ours), "s", tokens, positions=positions, explicit=explicit)
        assert out.logits.dtype == torch.float32 and out.logits.isfinite().all()
        assert rel_err(out.logits, ref) < 1.5 * rel_err(hf_bf16, ref) + 0.02
