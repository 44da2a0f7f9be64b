"""Train the tiny K2.6-architecture target on the Python corpus, quantize its routed experts to INT4
and write it in the exact K2.6 checkpoint layout.

Model: DeepSeek-V3 / Kimi K2.6 architecture scaled down (`TARGET_TEXT`: hidden 384, 6 layers with
layer 0 dense, MLA with YaRN, 16 routed experts top-4 + 1 shared, sigmoid noaux_tc routing), trained
with the training twin (tools/k2_twin.py: same parameter names and math as verifier_service's model)
under bf16 autocast, AdamW, linear warm-up then cosine decay, next-token cross-entropy over random
non-overlapping windows of the training stream, never more than `--max-epochs` passes. The router's
selection bias follows the aux-loss-free balancing rule (bias += rate · sign(mean load − load)).

Resumable: `--work DIR/target_train.pt` (weights, optimizer, step, schedule) is written every
`--ckpt-every-s` seconds and at the end; a rerun continues from it. `--time-budget-s` fixes the
number of steps from the measured speed of the first steps (kept in the checkpoint).

Export (`--out`): wrapper config.json (kimi_k25 + text_config + compressed-tensors
quantization_config), `language_model.`-prefixed bf16 tensors, routed experts pack-quantized INT4
(group 32, symmetric, verifier_service/int4.py), fp32 router bias, a few placeholder vision tensors
(skipped by the loader, as K2.6's vision tower is), one shard per layer + one for the tables,
`model.safetensors.index.json`. Held-out loss is reported for the twin and, before and after INT4,
through verifier_service's loader + K2Model.

    python -m tools.train_target --corpus .out/corpus --tokenizer models/kimi-tiny --work .out/work \
        --out models/kimi-tiny --time-budget-s 200
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python tools/train_target.py`
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tools import corpus
from tools.k2_twin import EXPERT_PROJS, K2Twin
from tools.train_tokenizer import special_ids
from verifier_service.int4 import quantize_int4_groupwise
from verifier_service.model_config import K2Config
from verifier_service.tiny_checkpoint import GROUP_SIZE, PREFIX, QUANTIZATION_CONFIG, TEXT_DEFAULTS, _write_shards

TARGET_TEXT = dict(
    hidden_size=384, num_hidden_layers=6, first_k_dense_replace=1, num_attention_heads=6, num_key_value_heads=6,
    q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    intermediate_size=1024, moe_intermediate_size=192, n_routed_experts=16, num_experts_per_tok=4,
    n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.827, max_position_embeddings=262144,
)
CKPT_NAME = "target_train.pt"


# ------------------------------------------------------------------ config

def wrapper_config(num_regular: int, text_overrides: dict | None = None, quantized: bool = True) -> dict:
    """config.json of the K2.6 layout (kimi_k25 wrapper) for this tokenizer."""
    ids = special_ids(num_regular)
    vocab, bos, eos = ids["vocab_size"], ids["bos_token_id"], [ids["eos_token_id"], ids["im_end_id"]]
    text = copy.deepcopy(TEXT_DEFAULTS)
    text.update(copy.deepcopy(TARGET_TEXT))
    text.update(vocab_size=vocab, bos_token_id=bos, eos_token_id=eos, pad_token_id=ids["pad_token_id"])
    if quantized:
        text["quantization_config"] = copy.deepcopy(QUANTIZATION_CONFIG)
    text.update(copy.deepcopy(text_overrides or {}))
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                     "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
                     "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
        "model_type": "kimi_k25",
        "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": ids["pad_token_id"],
        "tie_word_embeddings": False, "use_unified_vision_chunk": True,
        "text_config": text,
        "vision_config": {"model_type": "moonvit3d", "hidden_size": 8, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "patch_size": 2, "merge_kernel_size": [2, 2],
                          "mm_projector_type": "patchmerger", "text_hidden_size": text["hidden_size"]},
        "torch_dtype": "bfloat16",
    }


def num_regular_ids(tokenizer_dir: str | Path) -> int:
    return sum(1 for line in (Path(tokenizer_dir) / "tiktoken.model").read_text().splitlines() if line.strip())


def count_params(twin: K2Twin) -> dict[str, int]:
    total = sum(p.numel() for p in twin.parameters())
    experts = sum(p.numel() for n, p in twin.named_parameters() if ".mlp.experts." in n)
    cfg = twin.cfg
    active = total - experts + experts * cfg.num_experts_per_tok // cfg.n_routed_experts
    return {"total": total, "routed_experts": experts, "active_per_token": active,
            "embed_and_head": 2 * cfg.vocab_size * cfg.hidden_size}


# ------------------------------------------------------------------ data

class Windows:
    """Non-overlapping windows of `seq + 1` tokens of a stream, in a seeded order per epoch."""

    def __init__(self, stream: np.ndarray, seq: int, device: torch.device, seed: int = 0):
        self.seq, self.seed = seq, seed
        self.count = (len(stream) - 1) // seq
        self.tokens = torch.from_numpy(stream[: self.count * seq + 1].astype(np.int64)).to(device)
        self.offsets = torch.arange(seq + 1, device=device)

    def batch(self, step: int, batch: int) -> torch.Tensor:
        """Windows step*batch .. step*batch+batch-1 of the epoch order -> [batch, seq + 1]."""
        lo, hi = step * batch, (step + 1) * batch
        e0, e1 = lo // self.count, (hi - 1) // self.count
        if e0 == e1:
            idx = self._perm(e0)[lo - e0 * self.count: hi - e0 * self.count]
        else:  # the batch spans an epoch boundary
            idx = torch.stack([self._perm(k // self.count)[k % self.count] for k in range(lo, hi)])
        starts = idx * self.seq
        return self.tokens[starts[:, None] + self.offsets]

    def _perm(self, epoch: int) -> torch.Tensor:
        if getattr(self, "_perm_epoch", None) != epoch:
            gen = torch.Generator().manual_seed(self.seed * 1000 + epoch)
            self._perm_cache, self._perm_epoch = torch.randperm(self.count, generator=gen).to(self.tokens.device), epoch
        return self._perm_cache


def heldout_windows(stream: np.ndarray, seq: int, max_windows: int) -> torch.Tensor:
    n = min((len(stream) - 1) // seq, max_windows)
    starts = np.linspace(0, (len(stream) - 1) // seq - 1, n).astype(np.int64) * seq if n else np.zeros(0, np.int64)
    return torch.from_numpy(np.stack([stream[s:s + seq + 1].astype(np.int64) for s in starts]))


# ------------------------------------------------------------------ training

def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


def make_optimizer(twin: K2Twin, lr: float, weight_decay: float, device: torch.device) -> torch.optim.AdamW:
    decay = [p for n, p in twin.named_parameters() if p.dim() >= 2]
    other = [p for n, p in twin.named_parameters() if p.dim() < 2]
    kwargs = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, **kwargs)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def eval_twin(twin: K2Twin, windows: torch.Tensor, device: torch.device, batch: int = 16) -> float:
    twin.eval()
    total, count = 0.0, 0
    for lo in range(0, windows.shape[0], batch):
        w = windows[lo:lo + batch].to(device)
        with autocast(device):
            logits, _ = twin(w[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum")
        total, count = total + float(loss), count + w[:, 1:].numel()
    twin.train()
    return total / max(count, 1)


def train(*, corpus_dir: str | Path, tokenizer_dir: str | Path, work_dir: str | Path, device: str = "cuda",
          time_budget_s: float = 200.0, max_steps: int | None = None, batch: int = 64, seq: int = 512,
          lr: float = 3e-3, warmup: int = 100, weight_decay: float = 0.1, max_epochs: float = 2.0,
          balance_rate: float = 1e-3, ckpt_every_s: float = 60.0, eval_windows: int = 64, seed: int = 0,
          text_overrides: dict | None = None, log=print) -> tuple[K2Twin, dict]:
    dev = torch.device(device)
    torch.manual_seed(seed)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    cfg = K2Config.from_json(wrapper_config(num_regular_ids(tokenizer_dir), text_overrides))
    twin = K2Twin(cfg).init_weights(seed).to(dev)
    params = count_params(twin)
    data = Windows(corpus.load_stream(corpus_dir, "train"), seq, dev, seed)
    heldout = heldout_windows(corpus.load_stream(corpus_dir, "heldout"), seq, eval_windows)
    opt = make_optimizer(twin, lr, weight_decay, dev)
    epoch_steps = data.count / batch
    step_cap = int(max_epochs * epoch_steps)
    if max_steps is not None:
        step_cap = min(step_cap, max_steps)
    state = {"step": 0, "total_steps": None, "elapsed_s": 0.0, "losses": []}
    ckpt = work / CKPT_NAME
    if ckpt.exists():
        saved = torch.load(ckpt, map_location=dev, weights_only=False)
        twin.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        log(f"target: resumed from {ckpt} at step {state['step']}/{state['total_steps']}")
    log(f"target: {params['total'] / 1e6:.2f}M params ({params['routed_experts'] / 1e6:.2f}M in routed experts, "
        f"{params['active_per_token'] / 1e6:.2f}M active/token); {data.count:,} train windows of {seq} "
        f"({data.count * seq / 1e6:.1f}M tokens), batch {batch}, step cap {step_cap} ({max_epochs} epochs)")

    def save() -> None:
        torch.save({"model": twin.state_dict(), "opt": opt.state_dict(), "state": state}, ckpt)

    twin.train()
    twin.text_overrides = text_overrides
    t_start, t_ckpt = time.monotonic() - state["elapsed_s"], time.monotonic()
    timing_from = None  # (time, step) where the speed measurement started
    if state["total_steps"] is None and (step_cap <= 30 or not time_budget_s):
        state["total_steps"] = step_cap
    while state["total_steps"] is None or state["step"] < state["total_steps"]:
        step = state["step"]
        if state["total_steps"] is None:  # fix the schedule from the speed of 20 steps after 5 warm-up steps
            if timing_from is None and step >= 5:
                _sync(dev)
                timing_from = (time.monotonic(), step)
            elif timing_from is not None and step - timing_from[1] >= 20:
                _sync(dev)
                per_step = (time.monotonic() - timing_from[0]) / (step - timing_from[1])
                fit = step + int((time_budget_s - (time.monotonic() - t_start)) / per_step)
                state["total_steps"] = max(step, min(step_cap, fit))
                log(f"target: {per_step:.3f}s/step -> {state['total_steps']} steps "
                    f"({state['total_steps'] * batch * seq / 1e6:.1f}M tokens, "
                    f"{state['total_steps'] / epoch_steps:.2f} epochs)")
                if step >= state["total_steps"]:
                    break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, state["total_steps"] or step_cap, lr, warmup)
        w = data.batch(step, batch)
        with autocast(dev):
            logits, _ = twin(w[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
        opt.step()
        twin.balance_router(balance_rate)
        state["step"] = step + 1
        if step % 50 == 0 or state["step"] == state["total_steps"]:
            lv = float(loss.detach())
            state["losses"].append([step, round(lv, 4)])
            log(f"target: step {step} loss {lv:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                f"[{time.monotonic() - t_start:.0f}s]")
        state["elapsed_s"] = time.monotonic() - t_start
        if time.monotonic() - t_ckpt > ckpt_every_s:
            save()
            t_ckpt = time.monotonic()
    save()
    heldout_loss = eval_twin(twin, heldout, dev)
    train_loss = eval_twin(twin, data.batch(0, min(eval_windows, data.count))[:eval_windows], dev)
    load = [l.tolist() for l in twin.last_load]
    info = {"params": params, "steps": state["step"], "batch": batch, "seq": seq, "lr": lr,
            "tokens_seen": state["step"] * batch * seq, "epochs": round(state["step"] / epoch_steps, 3),
            "train_seconds": round(state["elapsed_s"], 1), "train_loss_sample": round(train_loss, 4),
            "heldout_loss_twin_bf16": round(heldout_loss, 4), "heldout_ppl_twin_bf16": round(math.exp(heldout_loss), 2),
            "heldout_eval_tokens": int(heldout[:, 1:].numel()), "expert_load_last_batch": load,
            "loss_curve": state["losses"]}
    log(f"target: {state['step']} steps, {info['tokens_seen'] / 1e6:.1f}M tokens ({info['epochs']} epochs) in "
        f"{info['train_seconds']}s; held-out loss {heldout_loss:.4f} (ppl {math.exp(heldout_loss):.2f}), "
        f"train-sample loss {train_loss:.4f}")
    return twin, info


# ------------------------------------------------------------------ export

def _vision_placeholders(hidden: int) -> dict[str, torch.Tensor]:
    """Placeholder multimodal tensors at K2.6's names (the text loader skips them)."""
    gen = torch.Generator().manual_seed(0)
    t = lambda *s: (torch.randn(*s, generator=gen) * 0.02).to(torch.bfloat16)  # noqa: E731
    return {"vision_tower.patch_embed.proj.weight": t(8, 3, 2, 2),
            "vision_tower.encoder.blocks.0.wqkv.weight": t(24, 8),
            "vision_tower.encoder.final_layernorm.weight": torch.ones(8, dtype=torch.bfloat16),
            "mm_projector.pre_norm.weight": torch.ones(32, dtype=torch.bfloat16),
            "mm_projector.proj.0.weight": t(32, 32), "mm_projector.proj.2.weight": t(hidden, 32)}


def export(twin: K2Twin, out_dir: str | Path, num_regular: int, *, quantize: bool = True) -> dict:
    """Write config.json + shards + index (K2.6 layout). quantize=False keeps routed experts bf16 (and
    writes no quantization_config): the 'before INT4' model for the same loader."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = wrapper_config(num_regular, getattr(twin, "text_overrides", None), quantized=quantize)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: v.cpu() for k, v in twin.checkpoint_tensors().items()}
    cfg = twin.cfg
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(cfg.num_hidden_layers)]
    tables: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        target = shards[int(name.split(".")[2])] if name.startswith("model.layers.") else tables
        full = PREFIX + name
        if name.endswith("e_score_correction_bias"):
            target[full] = t.float()
        elif ".mlp.experts." in name and quantize:
            packed, scale = quantize_int4_groupwise(t, GROUP_SIZE)
            base = full[: -len(".weight")]
            target[base + ".weight_packed"] = packed
            target[base + ".weight_scale"] = scale
            target[base + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int32)
        else:
            target[full] = t.to(torch.bfloat16)
    _write_shards(out, [*shards, tables, _vision_placeholders(cfg.hidden_size)])
    return config


def dequantized_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Canonical name -> fp32 tensor of a written checkpoint, INT4 experts dequantized (for the twin)."""
    from safetensors.torch import load_file

    from verifier_service.int4 import dequantize_int4

    raw = {}
    for f in sorted(Path(model_dir).glob("model-*.safetensors")):
        raw.update(load_file(str(f)))
    out = {}
    for name, t in raw.items():
        if not name.startswith(PREFIX):
            continue
        name = name[len(PREFIX):]
        if name.endswith(".weight_packed"):
            base = name[: -len(".weight_packed")]
            shape = tuple(raw[PREFIX + base + ".weight_shape"].tolist())
            out[base + ".weight"] = dequantize_int4(t, raw[PREFIX + base + ".weight_scale"], shape, torch.float32)
        elif name.endswith((".weight_scale", ".weight_shape")):
            continue
        else:
            out[name] = t.float()
    return out


@torch.no_grad()
def eval_verifier(model_dir: str | Path, windows: torch.Tensor, *, device: str = "cpu",
                  dtype: torch.dtype = torch.float32, batch: int = 8) -> float:
    """Mean next-token loss of windows [N, S+1] through verifier_service's loader + K2Model (prefill plans)."""
    from verifier_service.model import K2Model
    from verifier_service.plan import SeqRows, build_plan, chain_parents
    from verifier_service.weights import load_target_weights

    cfg = K2Config.from_json(model_dir)
    w = load_target_weights(model_dir, cfg, dtype=dtype, device=device, progress=lambda p: None)
    model = K2Model(cfg, w)
    seq, page_size = windows.shape[1] - 1, 64
    pages_per = -(-seq // page_size)
    total, count = 0.0, 0
    for lo in range(0, windows.shape[0], batch):
        chunk = windows[lo:lo + batch]
        kv = torch.zeros(cfg.num_hidden_layers, pages_per * len(chunk), page_size, cfg.kv_cache_width,
                         dtype=dtype, device=device)
        seqs = []
        for b, row in enumerate(chunk):
            pages = list(range(b * pages_per, (b + 1) * pages_per))
            seqs.append(SeqRows(row[:-1].tolist(), chain_parents(seq), 0, pages,
                                [pages[p // page_size] * page_size + p % page_size for p in range(seq)]))
        out = model.forward(build_plan(seqs, explicit_mla=True, device=device), kv)
        loss = F.cross_entropy(out.logits, chunk[:, 1:].flatten().to(device), reduction="sum")
        total, count = total + float(loss), count + chunk[:, 1:].numel()
    return total / max(count, 1)


def export_and_evaluate(twin: K2Twin, out_dir: str | Path, work_dir: str | Path, corpus_dir: str | Path,
                        num_regular: int, *, device: str = "cpu", eval_windows: int = 32, seq: int = 512,
                        log=print) -> dict:
    dev = torch.device(device)
    windows = heldout_windows(corpus.load_stream(corpus_dir, "heldout"), seq, eval_windows)
    dense_dir = Path(work_dir) / "target_bf16"
    export(twin, dense_dir, num_regular, quantize=False)
    export(twin, out_dir, num_regular, quantize=True)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    before = eval_verifier(dense_dir, windows, device=device, dtype=dtype)
    after = eval_verifier(out_dir, windows, device=device, dtype=dtype)
    # The twin with the dequantized experts loaded back, same windows: isolates the INT4 effect.
    twin_q = K2Twin(twin.cfg).to(dev)
    twin_q.text_overrides = getattr(twin, "text_overrides", None)
    twin_q.load_checkpoint_tensors({k: v.to(dev) for k, v in dequantized_tensors(out_dir).items()})
    twin_before, twin_after = eval_twin(twin, windows, dev), eval_twin(twin_q, windows, dev)
    info = {"eval_tokens": int(windows[:, 1:].numel()), "verifier_dtype": str(dtype).removeprefix("torch."),
            "heldout_loss_bf16": round(before, 4), "heldout_ppl_bf16": round(math.exp(before), 2),
            "heldout_loss_int4": round(after, 4), "heldout_ppl_int4": round(math.exp(after), 2),
            "twin_heldout_loss_bf16": round(twin_before, 4), "twin_heldout_loss_int4": round(twin_after, 4),
            "files": {p.name: p.stat().st_size for p in sorted(Path(out_dir).iterdir()) if p.is_file()}}
    log(f"target: held-out through verifier_service ({info['eval_tokens']} tokens, {info['verifier_dtype']}): "
        f"bf16 experts loss {before:.4f} (ppl {math.exp(before):.2f}) -> INT4 loss {after:.4f} "
        f"(ppl {math.exp(after):.2f}); twin {twin_before:.4f} -> {twin_after:.4f}")
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", required=True)
    p.add_argument("--tokenizer", required=True, help="dir with tiktoken.model")
    p.add_argument("--work", required=True, help="checkpoint dir (resumable)")
    p.add_argument("--out", required=True, help="model dir to write (K2.6 layout)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--time-budget-s", type=float, default=200.0)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--max-epochs", type=float, default=2.0)
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--text-overrides", type=json.loads, default=None, help="JSON dict over TARGET_TEXT (tests)")
    a = p.parse_args(argv)
    twin, info = train(corpus_dir=a.corpus, tokenizer_dir=a.tokenizer, work_dir=a.work, device=a.device,
                       time_budget_s=a.time_budget_s, max_steps=a.max_steps, batch=a.batch, seq=a.seq, lr=a.lr,
                       warmup=a.warmup, max_epochs=a.max_epochs, eval_windows=a.eval_windows,
                       text_overrides=a.text_overrides)
    info["export"] = export_and_evaluate(twin, a.out, a.work, a.corpus, num_regular_ids(a.tokenizer),
                                         device=a.device, eval_windows=min(a.eval_windows, 32), seq=a.seq)
    (Path(a.work) / "target_train.json").write_text(json.dumps(info, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
