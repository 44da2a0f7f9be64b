"""Per-session arithmetic of a step: the target's token for each verified row (argmax, or a sample
with the session's per-position uniforms), the acceptance walk, and emitted-token logprobs.

Greedy rows need only their argmax on the host: `fetch_outputs` computes it for every logit row of a
step in one device op and brings it back (with the logprobs and feature rows the step needs) under ONE
host sync; the walks then run on those host lists. Sampled sessions filter and sample on the device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verifier_service.acceptance import (Walk, children_by_token, filter_probs, forced_walk, sample_with_uniforms,
                                         tree_depths, walk_tree)
from verifier_service.grammar import greedy_choice, single_token, unpack
from verifier_service.session import Session


@dataclass
class HostOutputs:
    """What the host reads of one forward, fetched together."""

    argmax: list[int] | None  # the target's argmax per logit row
    logprobs: list[float] | None  # log-softmax of each logit row at its argmax
    hidden: torch.Tensor | None  # host copy of every row's features
    top: dict[int, tuple[list[int], list[float]]] | None = None  # logit row -> its TOP_K (ids, values), descending

    def top_of(self, rows: slice) -> list[tuple[list[int], list[float]]] | None:
        """The TOP_K of each of `rows` (a job's logit rows), or None where they were not fetched."""
        if not self.top or rows.start not in self.top:
            return None
        return [self.top[r] for r in range(rows.start, rows.stop)]


TOP_K = 32  # a structured-output greedy row picks its masked argmax on the host from these when it can


def fetch_outputs(logits: torch.Tensor, hidden: torch.Tensor | None, *, argmax: bool, logprobs: bool,
                  raw: torch.Tensor | None = None, top_rows: list[int] = ()) -> HostOutputs:
    """logits [Rl, V] (device) -> argmax per row (and the log-softmax of `raw`, the model's own logits when
    `logits` are penalized, at it, with `logprobs`), the TOP_K of `top_rows`, plus a host copy of `hidden` (if
    given): one device op each, non-blocking copies into pinned memory, one sync."""
    top = logits.argmax(-1) if argmax or logprobs else None
    raw = logits if raw is None else raw
    lp = torch.log_softmax(raw, dim=-1).gather(-1, top.unsqueeze(-1)).squeeze(-1) if logprobs else None
    best = logits[list(top_rows)].topk(min(TOP_K, logits.shape[-1]), dim=-1) if top_rows else None
    values, ids = (None, None) if best is None else (best.values.float(), best.indices)
    if logits.device.type != "cpu":
        top, lp, hidden, values, ids = (None if t is None else t.to("cpu", non_blocking=True)
                                        for t in (top, lp, hidden, values, ids))
        torch.cuda.current_stream(logits.device).synchronize()
    tops = None if best is None else dict(zip(top_rows, zip(ids.tolist(), values.tolist())))
    return HostOutputs(None if top is None else top.tolist(), None if lp is None else lp.tolist(), hidden, tops)


def target_tokens(s: Session, logits: torch.Tensor, depths: list[int]) -> list[int]:
    """logits [R, V] fp32 for rows at `depths` → the target's token per row. Row at depth d predicts
    output index s.emitted + d, so it samples with that index's uniform (SessionRng)."""
    p = s.params
    if p.greedy:
        return logits.argmax(-1).tolist()
    u = s.rng.peek(max(depths) + 1)[torch.tensor(depths)]
    probs = filter_probs(logits, p.temperature, p.top_k, p.top_p, p.min_p)
    return sample_with_uniforms(probs, u.to(probs.device)).tolist()


def accept_session(s: Session, tokens: list[int], parents: list[int], logits: torch.Tensor,
                   force_depth: int = 0, *, argmax: list[int] | None = None,
                   argmax_logprobs: list[float] | None = None, raw: torch.Tensor | None = None,
                   top: list[tuple[list[int], list[float]]] | None = None) -> tuple[Walk, list[float]]:
    """logits [N+1, V] for rows [root, nodes…] → the walk and the logprob of each emitted token (under
    `raw`, the model's own logits when `logits` are penalized).
    force_depth > 0: the TEST ONLY forced walk (acceptance.forced_walk), not the target's choice.
    Greedy sessions may pass the rows' argmax (and its logprob, per row) already on the host."""
    greedy = s.params.greedy
    if s.constraint is not None and not force_depth:
        walk = constrained_walk(s, tokens, parents, logits, argmax=argmax, top=top)
        argmax_logprobs = None  # the emitted tokens need not be the rows' argmax
    else:
        targets = argmax if greedy and argmax is not None else target_tokens(s, logits, tree_depths(parents))
        walk = (forced_walk(tokens, parents, targets, force_depth) if force_depth
                else walk_tree(tokens, parents, targets))
    logprobs = []
    if s.params.return_logprobs:
        # Emitted token j was predicted by accepted row j (root first); bonus by the last accepted row.
        rows = walk.accepted_rows
        if greedy and not force_depth and argmax_logprobs is not None:  # emitted = each row's argmax
            logprobs = [argmax_logprobs[r] for r in rows]
        else:
            lsm = torch.log_softmax((logits if raw is None else raw)[rows], dim=-1)  # [k+1, V]
            logprobs = lsm.gather(-1, torch.tensor(walk.tokens, device=lsm.device).unsqueeze(-1)).squeeze(-1).tolist()
    return walk, logprobs


def constrained_walk(s: Session, tokens: list[int], parents: list[int], logits: torch.Tensor, *,
                     argmax: list[int] | None = None, top: list[tuple[list[int], list[float]]] | None = None) -> Walk:
    """walk_tree for a structured-output session (verifier_service/grammar.py): a row's allowed tokens depend on its
    path, so the target's token is chosen row by row down the accepted path, each from the row's logits restricted
    by the grammar state after the path (one mask per emitted token; those on the likeliest path were computed during
    the forward); the session's matcher consumes them."""
    kids, (ahead, drawn) = children_by_token(tokens, parents), s.constraint.take_ahead()
    free = None  # every row's unconstrained token, one batched choice, for the rows before the grammar opens
    row, depth, accepted, emitted = 0, 0, [0], []
    while True:
        if s.constraint.open:
            token = drawn[row] if row in drawn else _constrained_choice(s, row, depth, logits, ahead, top)
        else:  # e.g. the thinking block: as walk_tree chooses
            if free is None:
                free = (argmax if s.params.greedy and argmax is not None
                        else target_tokens(s, logits, tree_depths(parents)))
            token = free[row]
        s.constraint.advance(token)
        emitted.append(token)
        child = kids[row].get(token)
        if child is None:
            return Walk(accepted_rows=accepted, tokens=emitted, bonus_row=row)
        accepted.append(child)
        row, depth = child, depth + 1


def _constrained_choice(s: Session, row: int, depth: int, logits: torch.Tensor, ahead: dict, top) -> int:
    """The target's token at `row` under the open grammar: on the host when it can tell (the grammar allows one
    token: that one, whatever the logits or the draw; a greedy row: the masked argmax from its top-k), else
    restricted and chosen on the device."""
    c, greedy = s.constraint, s.params.greedy
    bits = ahead.pop(row, None) or c.mask()
    token = single_token(bits)
    if token is None and greedy and top is not None:
        token = greedy_choice(bits, *top[row])
    if token is None:
        token = target_tokens(s, c.restrict(logits[row], bits).unsqueeze(0), [depth])[0]
    return token


def draw_ahead(s: Session, logits: torch.Tensor, parents: list[int]) -> None:
    """A sampled structured-output session: its draws at the rows of the likeliest path whose masks the look-ahead
    computed (and that allow more than one token), in one batched op: each row restricted by its mask and drawn with
    its position's uniform, as `_constrained_choice` would one by one. Read by the walk (`take_ahead`)."""
    if s.params.greedy:
        return
    c = s.constraint
    masks = {r: bits for r, bits in c.ahead_masks().items() if single_token(bits) is None}
    if not masks:
        return
    rows = list(masks)
    allowed = torch.from_numpy(unpack(list(masks.values()), logits.shape[-1])).to(logits.device)
    restricted = torch.where(allowed, logits[rows], float("-inf"))
    depths = tree_depths(parents)
    u = s.rng.peek(max(depths[r] for r in rows) + 1)[torch.tensor([depths[r] for r in rows])]
    p = s.params
    probs = filter_probs(restricted, p.temperature, p.top_k, p.top_p, p.min_p)
    c.drawn = rows, sample_with_uniforms(probs, u.to(logits.device))


def top_logprobs(logits: torch.Tensor, rows: list[int], k: int) -> list[tuple[list[int], list[float]]]:
    """logits [R, V] -> for each of `rows`, its k most likely token ids and their log-softmax (raw logits, as the
    emitted tokens' logprobs), most likely first. One device op and one read, only for sessions that ask."""
    if not k or not rows:
        return []
    return _most_likely(torch.log_softmax(logits[rows].float(), dim=-1), k)


def _most_likely(logprobs: torch.Tensor, k: int) -> list[tuple[list[int], list[float]]]:
    """[R, V] log-softmax -> per row its k most likely (ids, logprobs), most likely first."""
    values, ids = logprobs.topk(k, dim=-1)
    return list(zip(ids.tolist(), values.tolist()))


def prompt_logprobs(s: Session, start: int, logits: torch.Tensor) -> None:
    """A prefill chunk's logit rows [n, V] (prompt positions start ..) -> the logprob of the prompt token each row
    predicts, and its top_logprobs alternatives, appended to the session's; the prompt's last row predicts the
    first output token, not a prompt token, and adds none."""
    targets = s.prompt[start + 1: start + logits.shape[0] + 1]
    if not targets:
        return
    lsm = torch.log_softmax(logits[: len(targets)].float(), dim=-1)
    s.prompt_logprobs += lsm.gather(-1, torch.tensor(targets, device=lsm.device).unsqueeze(-1)).squeeze(-1).tolist()
    if s.params.top_logprobs:  # from the same log-softmax
        s.prompt_top_logprobs += _most_likely(lsm, s.params.top_logprobs)


def first_token(s: Session, logits: torch.Tensor, raw: torch.Tensor | None = None) -> tuple[int, float]:
    """The token after the prompt, from the prefill's last row (output index 0); its logprob under `raw`."""
    raw = logits if raw is None else raw
    if s.constraint is not None:
        logits = s.constraint.restrict(logits)
    token = target_tokens(s, logits.unsqueeze(0), [0])[0]
    if s.constraint is not None:
        s.constraint.advance(token)
    logprob = float(torch.log_softmax(raw, dim=-1)[token]) if s.params.return_logprobs else 0.0
    return token, logprob
