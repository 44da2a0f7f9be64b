"""The DFlash drafter's training objective, computed for many anchors of a window at once.

Per training window of `seq` corpus tokens:
- the frozen target (training twin with the exported INT4 experts dequantized, bf16 autocast) gives
  the outputs of `target_layer_ids` at every position and its own greedy next tokens;
- `anchors` random anchor positions a ∈ [1, seq − block]; each anchor makes a block
  [x_a, mask × (block − 1)] at positions a .. a + block − 1;
- every block's queries attend to the fused context features (fc → hidden_norm → per-layer k_norm'd,
  rotated K and V) at positions < a, plus their own block (bidirectional) — exactly the service's
  attention at a root at position a;
- slot k (1 … block − 1) is scored by cross-entropy against a label at position a + k, weighted by
  exp(−(k − 1)/γ). Labels: `corpus` = the corpus token; `target` = the target's greedy token there
  (its argmax given the corpus prefix up to a + k − 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from drafter_service.model import DFlashDrafter
from tools.k2_twin import K2Twin
from tools.train_loop import autocast


def sample_anchors(batch: int, seq: int, block: int, count: int, device: torch.device) -> torch.Tensor:
    """[batch, count] distinct sorted anchors in [1, seq - block]."""
    span = seq - block
    count = min(count, span)
    return (torch.rand(batch, span, device=device).topk(count, dim=1).indices + 1).sort(dim=1).values


def block_logits(d: DFlashDrafter, feats: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """The service's draft computation for every anchor at once.

    feats [B, S, |ids|·H] target features; tokens [B, S]; anchors [B, A] -> logits [B, A, block-1, V]
    for slots 1 .. block-1 (slot j predicts position anchor + j)."""
    cfg = d.cfg
    B, S = tokens.shape
    A, Bk = anchors.shape[1], cfg.block_size
    c = d.hidden_norm(d.fc(feats.to(d.dtype)))  # [B, S, H]
    ctx_pos = torch.arange(S, device=tokens.device)
    cos_c, sin_c = d.rope(ctx_pos[None].expand(B, S), c.dtype)  # [B, S, 1, hd]
    block_pos = (anchors[:, :, None] + torch.arange(Bk, device=tokens.device)).flatten(1)  # [B, A*Bk]
    ids = torch.full((B, A, Bk), cfg.mask_token_id, dtype=torch.long, device=tokens.device)
    ids[:, :, 0] = tokens.gather(1, anchors)
    x = F.embedding(ids.flatten(1), d.embed_tokens) * cfg.input_embedding_scale  # [B, A*Bk, H]
    cos_b, sin_b = d.rope(block_pos, x.dtype)
    q_anchor = anchors.repeat_interleave(Bk, dim=1)  # [B, A*Bk] anchor of each query's block
    q_block = torch.arange(A, device=tokens.device).repeat_interleave(Bk)  # [A*Bk]
    sees_ctx = ctx_pos[None, None, :] < q_anchor[:, :, None]  # [B, A*Bk, S]: strictly before the anchor
    sees_blk = (q_block[:, None] == q_block[None, :])[None].expand(B, -1, -1)  # own block, bidirectional
    mask = torch.cat([sees_ctx, sees_blk], dim=2)  # [B, A*Bk, S + A*Bk]
    delta = None  # each layer's MLP output, added by the next norm (DecoderLayer.forward)
    for layer in d.layers:
        ctx_k, ctx_v = layer.self_attn.kv(c, cos_c, sin_c)
        x, delta = layer(x, cos_b, sin_b, (ctx_k, ctx_v), mask, delta)
    hidden = d.norm.add(x, delta)[1].view(B, A, Bk, -1)[:, :, 1:]  # [B, A, Bk-1, H]
    return d.logits(hidden)  # fp32, through the target's lm_head


def labels_for(kind: str, tokens: torch.Tensor, greedy: torch.Tensor, anchors: torch.Tensor, block: int) -> torch.Tensor:
    """[B, A, block-1] label of slot k at position anchor + k."""
    pos = anchors[:, :, None] + torch.arange(1, block, device=anchors.device)  # [B, A, Bk-1]
    if kind == "corpus":
        return tokens.gather(1, pos.flatten(1)).view_as(pos)
    if kind == "target":  # greedy[p] = the target's argmax after position p, i.e. its token at p + 1
        return greedy.gather(1, (pos - 1).flatten(1)).view_as(pos)
    raise ValueError(f"unknown label kind {kind!r}")


def slot_weights(block: int, gamma: float, device: torch.device) -> torch.Tensor:
    return torch.exp(-torch.arange(block - 1, device=device, dtype=torch.float32) / gamma)


@torch.no_grad()
def evaluate(drafters: dict, target: K2Twin, windows: torch.Tensor, layer_ids: list[int], *, anchors: int,
             device: torch.device, batch: int = 8, seed: int = 1) -> dict:
    """Held-out: per-slot accuracy against the target's greedy tokens and the teacher-forced chain
    acceptance proxy E[1 + longest prefix of slots matching]."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    out = {}
    for name, d in drafters.items():
        d.eval()
        hits, chain, n = None, 0.0, 0
        for lo in range(0, windows.shape[0], batch):
            w = windows[lo:lo + batch, :-1].to(device)
            with autocast(device):
                logits, feats = target(w, capture=layer_ids)
                greedy = logits.argmax(-1)
                anc = sample_anchors(w.shape[0], w.shape[1], d.cfg.block_size, anchors, device)
                pred = block_logits(d, torch.cat(feats, -1), w, anc).argmax(-1)
            ok = pred == labels_for("target", w, greedy, anc, d.cfg.block_size)  # [B, A, Bk-1]
            hits = ok.float().sum((0, 1)) if hits is None else hits + ok.float().sum((0, 1))
            chain += float((1 + ok.long().cumprod(-1).sum(-1)).sum())
            n += ok.shape[0] * ok.shape[1]
        d.train()
        out[name] = {"slot_accuracy": [round(float(h) / n, 4) for h in hits], "chain_proxy_tau": round(chain / n, 3)}
    torch.random.set_rng_state(gen_state)
    return out
