"""Train DFlash drafters for the tiny target, on the frozen target's features (reference/ddtree.md §1.10).

The drafter is drafter_service's own DFlashDrafter module (same parameters, rope and attention code
that serve it), fed the target's features the way the service injects them. Objective
(tools/drafter_objective.py): `--anchors` blocks [x_a, mask × (block − 1)] per window of `seq` corpus
tokens, attending to the frozen target's features before their anchor a, slot k scored by
cross-entropy against the label at a + k, weighted by exp(−(k − 1)/γ); labels `corpus` (the corpus
token) or `target` (the target's greedy token). `--labels corpus,target` trains one drafter per label
kind on the same batches (one target forward per step) and writes each to OUT/<label>/. Resumable
from `--work DIR/drafter_train.pt`.

Saved as a released DFlash checkpoint (drafter_service/tiny_checkpoint.py layout: config.json with
block_size, dflash_config.{target_layer_ids, mask_token_id}, YaRN rope; bf16 model.safetensors with
names without `model.`; index), loadable by drafter_service.weights.load_drafter with the target's
embed_tokens / lm_head read from the target dir.

    python -m tools.train_drafter --target models/kimi-tiny --corpus .out/corpus --work .out/work \
        --out .out/drafters --time-budget-s 150
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python tools/train_drafter.py`
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from drafter_service.model import DFlashDrafter
from drafter_service.model_config import DFlashConfig
from drafter_service.tiny_checkpoint import tiny_drafter_config
from tools import corpus
from tools.drafter_objective import block_logits, evaluate, labels_for, sample_anchors, slot_weights
from tools.k2_twin import K2Twin
from tools.target_export import dequantized_tensors
from tools.train_loop import StepSchedule, Windows, autocast, heldout_windows, lr_at, new_train_state, step_cap
from tools.train_tokenizer import special_ids
from verifier_service.model_config import K2Config

CKPT_NAME = "drafter_train.pt"
DRAFTER = dict(num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=64,
               intermediate_size=1024, block_size=8)


def drafter_config(target_cfg: K2Config, target_layer_ids: list[int], overrides: dict | None = None) -> dict:
    o = {**DRAFTER, **(overrides or {})}
    vocab = target_cfg.vocab_size
    num_regular = vocab - 256
    cfg = tiny_drafter_config(target_hidden_size=target_cfg.hidden_size,
                              target_num_layers=target_cfg.num_hidden_layers, vocab_size=vocab,
                              mask_token_id=special_ids(num_regular)["mask_token_id"],
                              block_size=o["block_size"], num_layers=o["num_hidden_layers"])
    cfg.update(num_attention_heads=o["num_attention_heads"], num_key_value_heads=o["num_key_value_heads"],
               head_dim=o["head_dim"], intermediate_size=o["intermediate_size"],
               rms_norm_eps=target_cfg.rms_norm_eps)
    cfg["dflash_config"]["target_layer_ids"] = list(target_layer_ids)
    return cfg


def default_layer_ids(num_layers: int) -> list[int]:
    """Three target layers spread over the target, the last one included: [1, L/2, L-1] (6 layers: [1, 3, 5])."""
    return sorted({1, num_layers // 2, num_layers - 1})


def frozen_target(target_dir: str | Path, device: torch.device) -> K2Twin:
    """The served target (INT4 experts dequantized) as a no-grad twin."""
    cfg = K2Config.from_json(target_dir)
    twin = K2Twin(cfg)
    twin.load_checkpoint_tensors(dequantized_tensors(target_dir))
    return twin.to(device).eval().requires_grad_(False)


def new_drafter(cfg_dict: dict, target: K2Twin, device: torch.device, seed: int) -> DFlashDrafter:
    torch.manual_seed(seed)
    d = DFlashDrafter(DFlashConfig.from_dict(cfg_dict), vocab_size=target.cfg.vocab_size)
    d.embed_tokens = target.model.embed_tokens.weight.detach().clone()
    d.lm_head = target.lm_head.weight.detach().clone()
    return d.to(device)


def save_drafter(d: DFlashDrafter, cfg_dict: dict, out_dir: str | Path) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n")
    tensors = {n: p.detach().to("cpu", torch.bfloat16).contiguous() for n, p in d.named_parameters()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
             "weight_map": {name: "model.safetensors" for name in sorted(tensors)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def train(*, target_dir: str | Path, corpus_dir: str | Path, work_dir: str | Path, out_dir: str | Path,
          labels: tuple[str, ...] = ("corpus", "target"), device: str = "cuda", time_budget_s: float = 150.0,
          max_steps: int | None = None, batch: int = 32, seq: int = 512, anchors: int = 32, gamma: float = 4.0,
          lr: float = 1.5e-3, warmup: int = 50, weight_decay: float = 0.01, max_epochs: float = 2.0,
          layer_ids: list[int] | None = None, overrides: dict | None = None, eval_windows: int = 32,
          ckpt_every_s: float = 60.0, seed: int = 0, log=print) -> dict:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    work, out = Path(work_dir), Path(out_dir)
    work.mkdir(parents=True, exist_ok=True)
    target = frozen_target(target_dir, dev)
    layer_ids = layer_ids or default_layer_ids(target.cfg.num_hidden_layers)
    cfg_dict = drafter_config(target.cfg, layer_ids, overrides)
    block = cfg_dict["block_size"]
    drafters = {k: new_drafter(cfg_dict, target, dev, seed + i) for i, k in enumerate(labels)}
    kw = {"fused": True} if dev.type == "cuda" else {}
    opts = {k: torch.optim.AdamW([p for p in d.parameters()], lr=lr, betas=(0.9, 0.95),
                                 weight_decay=weight_decay, **kw) for k, d in drafters.items()}
    data = Windows(corpus.load_stream(corpus_dir, "train"), seq, dev, seed + 7)
    heldout = heldout_windows(corpus.load_stream(corpus_dir, "heldout"), seq, eval_windows)
    epoch_steps = data.count / batch
    cap = step_cap(epoch_steps, max_epochs, max_steps)
    state = new_train_state()
    ckpt = work / CKPT_NAME
    if ckpt.exists():
        saved = torch.load(ckpt, map_location=dev, weights_only=False)
        for k in drafters:
            drafters[k].load_state_dict(saved["drafters"][k], strict=False)
            opts[k].load_state_dict(saved["opts"][k])
        state = saved["state"]
        log(f"drafter: resumed from {ckpt} at step {state['step']}/{state['total_steps']}")
    n_params = sum(p.numel() for p in next(iter(drafters.values())).parameters())
    log(f"drafter: {n_params / 1e6:.2f}M params each, labels {list(labels)}, target layers {layer_ids}, "
        f"block {block}, {anchors} anchors x batch {batch} x seq {seq}, gamma {gamma}")

    def save() -> None:
        torch.save({"drafters": {k: d.state_dict() for k, d in drafters.items()},
                    "opts": {k: o.state_dict() for k, o in opts.items()}, "state": state}, ckpt)

    schedule = StepSchedule(state, cap, time_budget_s, ckpt_every_s, dev)
    _train_steps(drafters, opts, target, data, schedule, save, layer_ids=layer_ids, batch=batch, anchors=anchors,
                 gamma=gamma, lr=lr, warmup=warmup, log=log)
    save()
    metrics = evaluate(drafters, target, heldout, layer_ids, anchors=anchors, device=dev)
    for k, d in drafters.items():
        save_drafter(d, cfg_dict, out / k)
    info = {"params": n_params, "labels": list(labels), "target_layer_ids": layer_ids, "block_size": block,
            "steps": state["step"], "batch": batch, "seq": seq, "anchors": anchors, "gamma": gamma, "lr": lr,
            "epochs": round(state["step"] / epoch_steps, 3), "train_seconds": round(state["elapsed_s"], 1),
            "heldout": metrics, "loss_curve": state["losses"]}
    log(f"drafter: {state['step']} steps ({info['epochs']} epochs) in {info['train_seconds']}s; held-out "
        + "; ".join(f"{k}: chain proxy tau {m['chain_proxy_tau']}, slot acc {m['slot_accuracy'][:3]}"
                    for k, m in metrics.items()))
    return info


def _train_steps(drafters: dict[str, DFlashDrafter], opts: dict[str, torch.optim.Optimizer], target: K2Twin,
                 data: Windows, schedule: StepSchedule, save, *, layer_ids: list[int], batch: int, anchors: int,
                 gamma: float, lr: float, warmup: int, log) -> None:
    """Steps until the schedule's total: one frozen-target forward per batch (features, and its greedy
    tokens when a drafter learns them), then one slot-weighted cross-entropy step per drafter."""
    state, dev, seq, epoch_steps = schedule.state, schedule.device, data.seq, data.count / batch
    block = next(iter(drafters.values())).cfg.block_size
    weights = slot_weights(block, gamma, dev)
    while schedule.running():
        step = state["step"]
        per_step = schedule.measure(step)
        if per_step is not None:
            log(f"drafter: {per_step:.3f}s/step -> {state['total_steps']} steps "
                f"({state['total_steps'] / epoch_steps:.2f} epochs)")
            if step >= state["total_steps"]:
                break
        w = data.batch(step, batch)[:, :-1]
        with torch.no_grad(), autocast(dev):
            logits, feats = target(w, capture=layer_ids, logits="target" in drafters)
            greedy = logits.argmax(-1) if logits is not None else None
            feats = torch.cat(feats, dim=-1)
        anc = sample_anchors(batch, seq, block, anchors, dev)
        losses = {}
        for k, d in drafters.items():
            for g in opts[k].param_groups:
                g["lr"] = lr_at(step, schedule.lr_total, lr, warmup)
            with autocast(dev):
                out_logits = block_logits(d, feats, w, anc)  # [B, A, Bk-1, V]
            y = labels_for(k, w, greedy, anc, block)
            ce = F.cross_entropy(out_logits.flatten(0, 2), y.flatten(), reduction="none").view_as(y)
            loss = (ce * weights).sum(-1).mean() / weights.sum()
            opts[k].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(d.parameters(), 1.0)
            opts[k].step()
            losses[k] = loss
        if schedule.advance(step):
            lv = {k: round(float(v.detach()), 4) for k, v in losses.items()}
            state["losses"].append([step, lv])
            log(f"drafter: step {step} loss {lv} [{schedule.seconds():.0f}s]")
        schedule.checkpoint(save)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="target checkpoint dir (K2.6 layout)")
    p.add_argument("--corpus", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True, help="writes OUT/<label>/ per label kind")
    p.add_argument("--labels", default="corpus,target")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--time-budget-s", type=float, default=150.0)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--anchors", type=int, default=32)
    p.add_argument("--gamma", type=float, default=4.0)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--layer-ids", type=lambda s: [int(x) for x in s.split(",")], default=None)
    p.add_argument("--overrides", type=json.loads, default=None, help="JSON dict over DRAFTER (tests)")
    a = p.parse_args(argv)
    info = train(target_dir=a.target, corpus_dir=a.corpus, work_dir=a.work, out_dir=a.out,
                 labels=tuple(a.labels.split(",")), device=a.device, time_budget_s=a.time_budget_s,
                 max_steps=a.max_steps, batch=a.batch, seq=a.seq, anchors=a.anchors, gamma=a.gamma, lr=a.lr,
                 warmup=a.warmup, layer_ids=a.layer_ids, overrides=a.overrides)
    (Path(a.work) / "drafter_train.json").write_text(json.dumps(info, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
