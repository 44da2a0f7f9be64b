"""Train the tiny K2.6-architecture target on the Python corpus, quantize its routed experts to INT4
and write it in the exact K2.6 checkpoint layout.

Model: DeepSeek-V3 / Kimi K2.6 architecture scaled down (`TARGET_TEXT` in tools/target_export.py:
hidden 384, 6 layers with layer 0 dense, MLA with YaRN, 16 routed experts top-4 + 1 shared, sigmoid
noaux_tc routing), trained with the training twin (tools/k2_twin.py: same parameter names and math as
verifier_service's model) under bf16 autocast, AdamW, linear warm-up then cosine decay, next-token
cross-entropy over random non-overlapping windows of the training stream, never more than
`--max-epochs` passes. The router's selection bias follows the aux-loss-free balancing rule
(bias += rate · sign(mean load − load)).

Resumable: `--work DIR/target_train.pt` (weights, optimizer, step, schedule) is written every
`--ckpt-every-s` seconds and at the end; a rerun continues from it. `--time-budget-s` fixes the
number of steps from the measured speed of the first steps (kept in the checkpoint).

Export (`--out`, tools/target_export.py): the K2.6 layout (kimi_k25 wrapper config.json, bf16
tensors, routed experts pack-quantized INT4, sharded per layer). Held-out loss is reported for the
twin and, before and after INT4, through verifier_service's loader + K2Model.

    python -m tools.train_target --corpus .out/corpus --tokenizer models/kimi-tiny --work .out/work \
        --out models/kimi-tiny --time-budget-s 200
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python tools/train_target.py`
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from tools import corpus
from tools.k2_twin import K2Twin
from tools.target_export import eval_twin, export_and_evaluate, num_regular_ids, wrapper_config
from tools.train_loop import StepSchedule, Windows, autocast, heldout_windows, lr_at, new_train_state, step_cap
from verifier_service.model_config import K2Config

CKPT_NAME = "target_train.pt"


def count_params(twin: K2Twin) -> dict[str, int]:
    total = sum(p.numel() for p in twin.parameters())
    experts = sum(p.numel() for n, p in twin.named_parameters() if ".mlp.experts." in n)
    cfg = twin.cfg
    active = total - experts + experts * cfg.num_experts_per_tok // cfg.n_routed_experts
    return {"total": total, "routed_experts": experts, "active_per_token": active,
            "embed_and_head": 2 * cfg.vocab_size * cfg.hidden_size}


def make_optimizer(twin: K2Twin, lr: float, weight_decay: float, device: torch.device) -> torch.optim.AdamW:
    decay = [p for n, p in twin.named_parameters() if p.dim() >= 2]
    other = [p for n, p in twin.named_parameters() if p.dim() < 2]
    kwargs = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, **kwargs)


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
    cap = step_cap(data.count / batch, max_epochs, max_steps)
    state = new_train_state()
    ckpt = work / CKPT_NAME
    if ckpt.exists():
        saved = torch.load(ckpt, map_location=dev, weights_only=False)
        twin.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        log(f"target: resumed from {ckpt} at step {state['step']}/{state['total_steps']}")
    log(f"target: {params['total'] / 1e6:.2f}M params ({params['routed_experts'] / 1e6:.2f}M in routed experts, "
        f"{params['active_per_token'] / 1e6:.2f}M active/token); {data.count:,} train windows of {seq} "
        f"({data.count * seq / 1e6:.1f}M tokens), batch {batch}, step cap {cap} ({max_epochs} epochs)")

    def save() -> None:
        torch.save({"model": twin.state_dict(), "opt": opt.state_dict(), "state": state}, ckpt)

    twin.train()
    twin.text_overrides = text_overrides
    schedule = StepSchedule(state, cap, time_budget_s, ckpt_every_s, dev)
    _train_steps(twin, opt, data, schedule, save, batch=batch, lr=lr, warmup=warmup, balance_rate=balance_rate,
                 log=log)
    save()
    return twin, _trained_info(twin, data, heldout, state, params, dev, batch=batch, lr=lr,
                               eval_windows=eval_windows, log=log)


def _train_steps(twin: K2Twin, opt: torch.optim.Optimizer, data: Windows, schedule: StepSchedule, save, *,
                 batch: int, lr: float, warmup: int, balance_rate: float, log) -> None:
    """Steps until the schedule's total: next-token loss over a batch of windows, clipped AdamW step,
    router bias balancing."""
    state, dev, seq, epoch_steps = schedule.state, schedule.device, data.seq, data.count / batch
    while schedule.running():
        step = state["step"]
        per_step = schedule.measure(step)
        if per_step is not None:
            log(f"target: {per_step:.3f}s/step -> {state['total_steps']} steps "
                f"({state['total_steps'] * batch * seq / 1e6:.1f}M tokens, "
                f"{state['total_steps'] / epoch_steps:.2f} epochs)")
            if step >= state["total_steps"]:
                break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, schedule.lr_total, lr, warmup)
        w = data.batch(step, batch)
        with autocast(dev):
            logits, _ = twin(w[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
        opt.step()
        twin.balance_router(balance_rate)
        if schedule.advance(step):
            lv = float(loss.detach())
            state["losses"].append([step, round(lv, 4)])
            log(f"target: step {step} loss {lv:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                f"[{schedule.seconds():.0f}s]")
        schedule.checkpoint(save)


def _trained_info(twin: K2Twin, data: Windows, heldout: torch.Tensor, state: dict, params: dict,
                  dev: torch.device, *, batch: int, lr: float, eval_windows: int, log) -> dict:
    """The run's numbers: held-out loss and a train-sample loss through the twin, steps, tokens, curve."""
    seq, epoch_steps = data.seq, data.count / batch
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
