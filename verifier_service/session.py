"""Per-generation state on the verifier: prompt, sampling, pending token, features kept for the
drafter, stop handling and speculative statistics. Plain Python; the engine mutates it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ddtree.v1 import generation_pb2 as pb
from verifier_service.acceptance import SessionRng

AR, CHAIN, DDTREE = "ar", "chain", "ddtree"


@dataclass(frozen=True)
class GenParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0  # after temperature, before top-k and top-p (acceptance.filter_probs)
    seed: int | None = None
    max_new_tokens: int = 64
    max_duration_s: float | None = None  # StoppingCriteria.max_duration_ms: FINISH_REASON_TIME_LIMIT after it
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    mode: str = DDTREE
    tree_budget: int = 16
    return_logprobs: bool = False
    top_logprobs: int = 0  # with return_logprobs: the n most likely tokens at each emitted position
    presence_penalty: float = 0.0  # these four: verifier_service/penalties.py
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, value added to its logit)
    prompt_logprobs: bool = False  # the logprob of each prompt token after the first (and top_logprobs of them)
    forced_ids: tuple[int, ...] = ()  # the output starts with these after forced_after (verifier_service/forcing.py)
    forced_after: int | None = None
    min_new_tokens: int = 0  # no EOS / stop token id before this many emitted tokens (forcing.py)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)


@dataclass
class Emission:
    """What a step hands to the session's stream: new tokens, or the end."""

    token_ids: list[int]
    logprobs: list[float]
    verify_steps: int
    finish_reason: int | None = None  # pb.FinishReason when the generation ended
    matched_stop_token_id: int | None = None
    error: str | None = None  # the generation failed (finish_reason is then FINISH_REASON_UNSPECIFIED)
    error_code: str = "INTERNAL"  # grpc.StatusCode name for `error`
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)  # per token: (ids, logprobs)
    prompt_logprobs: list[float] = field(default_factory=list)  # the first emission only, see GenParams
    prompt_top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)


class FeatureRing:
    """The last `window` target feature rows of a session (for drafter resync), with their positions.

    Rows live in one preallocated buffer and `rows` is a view of it, so an append copies only the new
    rows: the capacity doubles up to 1.5 x `window` (window 0: unbounded), and once the buffer's end is
    reached the kept rows move back to its start (<= window rows copied per window/2 rows appended)."""

    def __init__(self, window: int, start: int = 0):
        self.window = window
        self._buf: torch.Tensor | None = None  # [capacity, F]
        self._head = 0  # buffer row of position `start`
        self._end = start  # absolute position after the last row
        self.start = start  # absolute position of the oldest row kept (empty until the first append)

    @property
    def end(self) -> int:
        return self._end

    @property
    def rows(self) -> torch.Tensor | None:
        """[n, F] view of rows start .. end-1 (None before the first append)."""
        return None if self._buf is None else self._buf[self._head: self._head + self._end - self.start]

    def append(self, position: int, rows: torch.Tensor) -> None:
        if position != self.end:
            raise ValueError(f"feature rows at {position} do not follow the ring's end {self.end}")
        end, held = position + rows.shape[0], self._end - self.start
        if self.window and rows.shape[0] > self.window:  # only the last `window` rows can stay
            rows = rows[rows.shape[0] - self.window:]
        k = rows.shape[0]
        keep = min(held, self.window - k) if self.window else held  # old rows that stay
        head = self._head + held - keep  # buffer row of the first of them
        if self._buf is None or head + keep + k > self._buf.shape[0]:
            self._make_room(head, keep, k, rows)
            head = 0
        self._buf[head + keep: head + keep + k] = rows
        self._head, self._end, self.start = head, end, end - keep - k

    def _make_room(self, head: int, keep: int, k: int, rows: torch.Tensor) -> None:
        """Move the `keep` rows at buffer row `head` to row 0, with room for k more: a buffer of twice the
        capacity (up to the limit), or, at the limit, the same buffer."""
        cap = 0 if self._buf is None else self._buf.shape[0]
        need = keep + k
        limit = self.window + max(self.window // 2, 1) if self.window else 0
        if self._buf is None or need > cap or cap < limit:
            want = max(2 * cap, 1 << max(need - 1, 0).bit_length(), 16)
            if limit:
                want = max(min(want, limit), need)
            new = torch.empty(want, *rows.shape[1:], dtype=rows.dtype, device=rows.device)
            if keep:
                new[:keep] = self._buf[head: head + keep]
            self._buf = new
        elif keep:  # same buffer, rows move down (the ranges may overlap: copy through a temporary)
            self._buf[:keep] = self._buf[head: head + keep].clone()

    def since(self, position: int) -> tuple[int, torch.Tensor]:
        """Rows from `position` (or the oldest kept, if later) to the end -> (first position, rows)."""
        first = max(position, self.start)
        return first, self.rows[first - self.start:]


@dataclass
class SpecCounters:
    verify_steps: int = 0
    accepted: int = 0
    drafted: int = 0
    no_draft_steps: int = 0
    histogram: list[int] = field(default_factory=list)

    def record(self, accepted: int, drafted: int, unavailable: bool) -> None:
        """One verify step: `accepted` of its `drafted` (verified) nodes; unavailable: no draft came (a tree the
        adaptive budget cut to nothing did come)."""
        self.verify_steps += 1
        self.accepted += accepted
        self.drafted += drafted
        self.no_draft_steps += unavailable
        if len(self.histogram) <= accepted:
            self.histogram += [0] * (accepted + 1 - len(self.histogram))
        self.histogram[accepted] += 1


@dataclass
class Session:
    id: str
    prompt: list[int]
    params: GenParams
    emit: Callable[[Emission], None]
    window: int
    rng: SessionRng = field(init=False)
    features: FeatureRing = field(init=False)
    prefilled: int = 0  # prompt tokens in the KV cache
    pending: int | None = None  # the root b: emitted, not yet in the KV cache
    emitted: int = 0
    output: list[int] = field(default_factory=list)  # the emitted tokens
    cached_tokens: int = 0  # leading prompt tokens whose KV came from the prefix cache
    prompt_logprobs: list[float] = field(default_factory=list)  # collected chunk by chunk, sent with the first token
    prompt_top_logprobs: list = field(default_factory=list)
    drafter_len: int = 0  # feature rows the drafter is believed to hold
    drafter_replica: str | None = None
    needs_reset: bool = False
    skipped_draft: bool = False  # this step verifies root-only by choice (verifier_service/budget.py: draft_pays)
    features_on: bool = False  # the drafter's feature layers were known when the session started
    cancelled: bool = False
    finished: bool = False
    stats: SpecCounters = field(default_factory=SpecCounters)
    penalties: object | None = None  # penalties.Penalties, made at the first penalized step
    constraint: object | None = None  # grammar.Constraint of a structured-output request
    # time.monotonic() at submit, admission to the decode loop, the first emitted token and the finish (None: not yet)
    submitted_s: float = field(default_factory=time.monotonic)
    admitted_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None

    def phase_seconds(self, now: float) -> dict[str, float]:
        """Seconds spent waiting for admission, prefilling (admission to the first token) and decoding (first token
        to the finish, or to `now` before it), for the phases the session reached."""
        now = self.finished_s if self.finished_s is not None else now
        out, marks = {}, (("queue", self.submitted_s), ("prefill", self.admitted_s), ("decode", self.first_token_s))
        for (name, start), (_, end) in zip(marks, (*marks[1:], ("", now))):
            if start is not None:
                out[name] = (end if end is not None else now) - start
        return out

    def __post_init__(self):
        self.rng = SessionRng(self.params.seed)
        self.features = FeatureRing(self.window)

    @property
    def decoding(self) -> bool:
        return self.pending is not None

    def skip_cached(self, tokens: int, rows: tuple[int, torch.Tensor] | None = None) -> None:
        """The first `tokens` prompt tokens are in the KV cache already: prefill starts after them. The feature
        ring starts there too, or earlier with `rows` (position, [n, F]: the cached pages' stored rows, ending at
        `tokens`); a reset starts the drafter at the ring's first row."""
        self.prefilled = self.cached_tokens = tokens
        self.features = FeatureRing(self.window, start=tokens if rows is None else rows[0])
        if rows is not None:
            self.features.append(*rows)

    def truncate(self, tokens: list[int], eos_ids: frozenset[int], max_context: int):
        """Cut a step's tokens at the first stop id / EOS / length limit -> (kept, reason, stop id)."""
        p = self.params
        for i, t in enumerate(tokens):
            if t in p.stop_token_ids:
                return tokens[:i], pb.FINISH_REASON_STOP, t
            if not p.ignore_eos and t in eos_ids:
                return tokens[:i], pb.FINISH_REASON_EOS, None
            n = self.emitted + i + 1
            if n >= p.max_new_tokens or len(self.prompt) + n >= max_context:
                return tokens[: i + 1], pb.FINISH_REASON_LENGTH, None
        return tokens, None, None

    def spec_stats(self, block_size: int) -> pb.SpecStats:
        """`block_size`: the drafter's (0 while unknown); a chain step drafts block_size - 1 nodes."""
        s = self.stats
        steps = s.verify_steps
        budget = {AR: 0, CHAIN: max(block_size - 1, 0)}.get(self.params.mode, self.params.tree_budget)
        return pb.SpecStats(
            verify_steps=steps, accepted_draft_tokens=s.accepted,
            mean_acceptance_length=(s.accepted + steps) / steps if steps else 0.0,
            tree_budget=budget,
            draft_tokens=s.drafted, draft_unavailable_steps=s.no_draft_steps if self.params.mode != AR else 0,
            mode={AR: pb.SPEC_MODE_AR, CHAIN: pb.SPEC_MODE_CHAIN, DDTREE: pb.SPEC_MODE_DDTREE}[self.params.mode],
            acceptance_histogram=s.histogram)
