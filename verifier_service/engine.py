"""The verifier's decode loop: continuous batching of prefill chunks and tree verifies.

One step = (1) admit waiting sessions while KV pages last; (2) the decoding sessions' drafts: the
Propose calls sent at the end of earlier steps, plus one now for sessions without one; (3) ONE
target forward over every prefill chunk and every session's [root, tree nodes…] rows; (4) accept per
session (greedy walk or sample-and-walk) and keep the accepted rows' features; (5) send the next
step's Propose (with a prefilling session's chunk rows, which go ahead to the drafter while the next
chunk prefills), then commit the accepted rows' KV and emit path + bonus tokens while it drafts.
The loop runs in its own thread; gRPC handlers talk to it through `submit` and `cancel`.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

import torch

from ddtree.v1 import generation_pb2 as pb
from service_kit import busy_poll
from service_kit.logs import get_logger
from verifier_service import metrics
from verifier_service.acceptance import tree_depths
from verifier_service.budget import AdaptiveBudget
from verifier_service.drafting import DraftPlanner, InFlight
from verifier_service.forcing import forced_logits
from verifier_service.grammar import GrammarError, load_vocabulary
from verifier_service.prefix_cache import FeatureStore
from verifier_service.penalties import penalized_logits
from verifier_service.plan import SeqRows, build_plan, chain_parents, tree_parents
from verifier_service.session import AR, Emission, Session
from verifier_service.stepping import (accept_session, draw_ahead, fetch_outputs, first_token, prompt_logprobs,
                                      top_logprobs)

log = get_logger("verifier.engine")
# A step's feature rows are read back whole (with the argmax, one sync) up to this size; above it only
# the accepted rows are gathered and read after the walks (K2.6: ~72 KB per row).
HIDDEN_FETCH_BYTES = 2 << 20


class Engine:
    def __init__(self, runner, config, drafters=None):
        self.runner = runner  # owns model + cache (runner.forward(plan) -> ForwardOutput)
        self.config = config
        self.cache = runner.cache
        self.table = runner.cache.table
        self.drafting = (DraftPlanner(drafters, config, runner.cfg.vocab_size)
                         if drafters is not None and drafters.enabled else None)
        self.eos_ids = frozenset(runner.cfg.eos_token_id)
        # how many drafted nodes each step verifies (None: all of them)
        self.budget = (AdaptiveBudget()
                       if self.drafting and config.adaptive_tree_budget else None)
        # token bytes for structured output's grammar masks (None: refused), from the checkpoint's tokenizer
        self.vocabulary = load_vocabulary(getattr(config, "model", ""), runner.cfg.vocab_size, self.eos_ids)
        self.feature_store = (FeatureStore(config.prefix_feature_mb << 20)
                              if self.drafting and config.prefix_cache and config.prefix_feature_mb > 0 else None)
        self.block_size = 0  # the drafter's, once it has told us
        self.on_fatal = None  # set at world size > 1: called (from the loop thread) when a step fails
        self.inflight: list[InFlight] = []  # Propose calls sent ahead, oldest first
        self.waiting: deque[Session] = deque()
        self.active: dict[str, Session] = {}
        self.reserved: dict[str, int] = {}  # pages promised to each admitted session
        self._cancel: set[str] = set()
        self._wake = threading.Condition()
        self._stop = False
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    # ---- called from gRPC handlers (any thread) ----
    def submit(self, session: Session) -> None:
        with self._wake:
            self.waiting.append(session)
            self._wake.notify()

    def is_live(self, session_id: str) -> bool:
        """Waiting or active. Under the lock: the loop thread moves sessions out of `waiting`, and
        iterating a deque while another thread pops it raises."""
        with self._wake:
            return session_id in self.active or any(s.id == session_id for s in self.waiting)

    def cancel(self, session_id: str) -> bool:
        with self._wake:
            known = self.is_live(session_id)
            if known:
                self._cancel.add(session_id)
                self._wake.notify()
            return known

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self.thread.join(timeout=10)

    def fail_all(self, message: str, code: str = "UNAVAILABLE") -> None:
        """Fatal path (a rank died): end every stream with `code` now, from any thread."""
        with self._wake:
            sessions = [*self.active.values(), *self.waiting]
        for s in sessions:
            s.emit(Emission([], [], 0, finish_reason=pb.FINISH_REASON_UNSPECIFIED, error=message, error_code=code))

    @property
    def live_sessions(self) -> int:
        return len(self.active) + len(self.waiting)

    # ---- the loop ----
    def _loop(self) -> None:
        self.runner.bind_thread()
        while True:
            with self._wake:
                while not self._stop and not self.active and not self.waiting:
                    self._wake.wait()
                if self._stop:
                    return
                cancelled, self._cancel = self._cancel, set()
            for sid in cancelled:
                self._finish_cancelled(sid)
            self._admit()
            if self.active:
                try:
                    self.step()
                except Exception as e:  # a failed forward fails the step's sessions, not the service
                    log.exception("step_failed")
                    if self.on_fatal is not None:  # multi-rank: a failed collective means a lost rank
                        self.on_fatal(f"step failed: {type(e).__name__}: {e}")
                        return
                    for s in list(self.active.values()):
                        self._finish(s, Emission([], [], 0, finish_reason=pb.FINISH_REASON_UNSPECIFIED,
                                                 error=f"{type(e).__name__}: {e}"))

    def _pages_needed(self, s: Session) -> int:
        ps = self.table.page_size
        total = min(len(s.prompt) + s.params.max_new_tokens, self.config.max_context)
        return math.ceil(total / ps) + math.ceil((self.config.max_tree_budget + 1) / ps) + 1

    def _admit(self) -> None:
        metrics.WAITING.set(len(self.waiting))
        metrics.RUNNING.set(len(self.active))
        metrics.KV_USAGE.set(1 - self.table.num_free / self.table.num_pages)
        with self._wake:  # `waiting` is shared with the gRPC threads (submit, is_live)
            self._admit_waiting()

    def _admit_waiting(self) -> None:
        while self.waiting and len(self.active) < self.config.max_batch:
            s = self.waiting[0]
            need = self._pages_needed(s)
            if sum(self.reserved.values()) + need > self.table.num_pages:
                if not self.active:  # can never fit: fail instead of waiting forever
                    self.waiting.popleft()
                    s.emit(Emission([], [], 0, finish_reason=pb.FINISH_REASON_UNSPECIFIED,
                                    error=f"needs {need} KV pages, the cache has {self.table.num_pages}",
                                    error_code="RESOURCE_EXHAUSTED"))
                break
            self.waiting.popleft()
            s.admitted_s = time.monotonic()
            # prompt logprobs need every prompt row's logits: no prefix reuse then
            cached = self.table.open(s.id, None if s.params.prompt_logprobs else s.prompt)
            s.skip_cached(cached, self._stored_features(s, cached))
            metrics.observe_prefix_cache(len(s.prompt), s.cached_tokens)
            self.reserved[s.id] = need
            self.active[s.id] = s

    def step(self) -> None:
        t0 = time.perf_counter()
        decoding = [s for s in self.active.values() if s.decoding]
        drafts = self._drafts(decoding) if self.drafting else {}
        chunks = self._prefill_chunks()
        if self.budget is not None and drafts:
            drafts = self.budget.trim(drafts, len(decoding), len(decoding) + sum(n for _, _, n in chunks))
        t1 = time.perf_counter()
        seqs, jobs = self._rows(decoding, drafts, chunks)
        logit_rows = [r for job in jobs for r in job["logit_rows"]]
        # A host plan: the runner pads it for a CUDA graph on the host, or moves it in one copy.
        plan = build_plan(seqs, logit_rows=logit_rows, pin=self.runner.device.type == "cuda")
        out = self.runner.forward(plan)
        top_rows = self._look_ahead(jobs)  # host work while the GPU runs the forward
        if self.budget is not None:  # so is the next step's budget (from this one's estimates)
            self.budget.plan_next([s.id for s in decoding if s.params.mode != AR])
        self.runner.sync()  # the GPU forward runs asynchronously: time it here, not in the accept phase
        t2 = time.perf_counter()
        self._finish_step(jobs, out, top_rows)
        t3 = time.perf_counter()
        metrics.observe_step(draft_s=t1 - t0, verify_s=t2 - t1, accept_s=t3 - t2, rows=plan.num_rows,
                             sessions=len(decoding), prefill=any(job["kind"] == "prefill" for job in jobs))
        if self.budget is not None:  # the step waited for drafts if it verified any
            self.budget.observe_step(plan.num_rows, t2 - t1, t1 - t0 if drafts else None, t0, t3)

    def _prefill_chunks(self) -> list[tuple[Session, int, int]]:
        """This step's prompt chunks (session, first position, tokens): up to prefill_chunk tokens in all, sessions in
        admission order."""
        chunks, budget = [], self.config.prefill_chunk
        for s in self.active.values():
            if s.decoding or budget <= 0:
                continue
            n = min(budget, len(s.prompt) - s.prefilled)
            chunks.append((s, s.prefilled, n))
            budget -= n
        return chunks

    def _drafts(self, decoding: list[Session]) -> dict:
        """The drafts sent for ahead (sessions finished since are dropped by `_rows`), and a Propose
        now for decoding sessions that have none in flight (just prefilled, or sent none). A call is
        waited for only if a decoding session is in it; one that carries only prefill rows sent ahead is
        collected once answered, so a prefill never waits for the drafter. (Folding calls out of send
        order is safe: a session's failure is never undone by an older success, see drafting.py.)"""
        ids = {s.id for s in decoding}
        drafts, sent, kept = {}, set(), []
        for f in self.inflight:  # oldest first: a later call's tree replaces an earlier one's
            if f.session_ids & ids or f.answered():
                drafts.update(self.drafting.receive(f))
                sent |= f.session_ids
            else:
                kept.append(f)
        self.inflight = kept
        rest = [s for s in decoding if s.id not in sent]
        if rest and not self._draft_pays(rest):  # a root-only step: no wait for the drafter
            skipped = [s for s in rest if s.params.mode != AR]
            for s in skipped:
                s.skipped_draft = True
            metrics.DRAFT_SKIPPED.inc(len(skipped))
            return drafts
        return drafts | self.drafting.draft(rest) if rest else drafts

    def _draft_pays(self, sessions: list[Session]) -> bool:
        """Whether the next step waits for these sessions' trees (AR-mode sessions, which draft nothing, left out)."""
        drafted = [s.id for s in sessions if s.params.mode != AR]
        return self.budget is None or not drafted or self.budget.draft_pays(drafted)

    def _rows(self, decoding: list[Session], drafts: dict, chunks: list[tuple[Session, int, int]]):
        """Per-session SeqRows (verify trees first, then the prefill chunks) and what to do with the output."""
        seqs, jobs, row = [], [], 0
        for s in decoding:
            d = drafts.get(s.id)
            tokens, parents = (d.tokens, d.parents) if d is not None else ([], [])
            n = len(tokens) + 1
            seqs.append(SeqRows([s.pending, *tokens], tree_parents(parents), self.table.length(s.id),
                                self.table.pages(s.id), self.table.scratch(s.id, n)))
            jobs.append(dict(kind="verify", s=s, tokens=tokens, parents=parents, rows=range(row, row + n),
                             logit_rows=range(row, row + n), drafted=d is not None or s.skipped_draft))
            s.skipped_draft = False
            row += n
        for s, start, n in chunks:
            chunk = s.prompt[start: start + n]
            slots = self.table.extend(s.id, len(chunk))
            seqs.append(SeqRows(chunk, chain_parents(len(chunk)), start, self.table.pages(s.id), slots))
            last = start + len(chunk) == len(s.prompt)
            logit_rows = (range(row, row + len(chunk)) if s.params.prompt_logprobs
                          else [row + len(chunk) - 1] if last else [])
            jobs.append(dict(kind="prefill", s=s, start=start, n=len(chunk), rows=range(row, row + len(chunk)),
                             logit_rows=logit_rows))
            row += len(chunk)
        return seqs, jobs

    def _finish_step(self, jobs, out, top_rows: list[int]) -> None:
        """Accept, commit and emit every job's rows. The host reads the forward once (argmax of every
        logit row, the top-k of `top_rows`, and the feature rows unless they are large; sampled sessions sample
        on the device), the KV commits of all sessions are one copy, and large feature rows one gather + one read."""
        live = [job for job in jobs if not job["s"].finished]
        greedy = [job for job in live if job["logit_rows"] and job["s"].params.greedy]
        features = out.hidden.shape[-1] > 0 and any(job["s"].features_on for job in live)
        eager = features and out.hidden.numel() * out.hidden.element_size() <= HIDDEN_FETCH_BYTES
        # what the target chooses from: its logits with the sessions' bias, penalties and forced tokens
        scores = forced_logits(live, penalized_logits(live, out.logits, self.runner.cfg.vocab_size), out.logits,
                               self.eos_ids)
        for job in live:  # sampled structured-output sessions draw their likeliest paths' rows at once
            if job["s"].constraint is not None and job["kind"] == "verify":
                draw_ahead(job["s"], scores[job["logits"]], job["parents"])
        host = fetch_outputs(scores, out.hidden if eager else None, argmax=bool(greedy),
                             logprobs=any(job["s"].params.return_logprobs for job in greedy), raw=out.logits,
                             top_rows=top_rows)
        commits, keep, emits = [], [], []
        for job in live:
            try:
                self._accept(job, out, scores, host, features, commits, keep, emits)
            except GrammarError as e:  # this request's grammar failed (a parser limit): it ends, the others go on
                self._finish(job["s"], Emission([], [], 0, finish_reason=pb.FINISH_REASON_UNSPECIFIED, error=str(e),
                                                error_code="INVALID_ARGUMENT"))
        kept = self._kept_features(keep, out.hidden, host.hidden) if keep else []
        ends = [(s, *self._settle(s, tokens), logprobs, tops, steps) for s, tokens, logprobs, tops, steps in emits]
        if self.drafting:  # the drafter works on the next step while this one fills rings, commits and streams
            ready = [s for s, _, reason, *_ in ends if reason is None]
            if ready and not self._draft_pays(ready):  # the next step is root-only (`_drafts` decides the same)
                ready = []
            chunked = [s for s in (job["s"] for job in live if job["kind"] == "prefill")  # mid-prompt: rows go ahead
                       if s.prefilled < len(s.prompt) and features and s.features_on and not s.finished]
            sent = self.drafting.send(ready + chunked, {s.id: (position, rows) for s, position, rows in kept},
                                      ahead={s.id: s.prompt[s.prefilled] for s in chunked})
            if sent is not None:
                self.inflight.append(sent)
        for s, position, rows in kept:
            if s.features.end != position + rows.shape[0]:  # else a reset request appended them already
                s.features.append(position, rows)  # raises unless the ring ends at `position`
        for job in live:  # a session's prompt is one prefill job a step
            if job["kind"] == "prefill" and job["s"].prefilled == len(job["s"].prompt) and not job["s"].finished:
                self._publish_pages(job["s"], job["s"].prompt)  # its full pages serve later requests from now on
        if commits:
            self.cache.commit_many(commits)
        for s, kept, reason, stop_id, logprobs, tops, steps in ends:
            self._publish(s, kept, reason, stop_id, logprobs, tops, steps)

    @staticmethod
    def _look_ahead(jobs: list[dict]) -> list[int]:
        """Numbers each job's logit rows (job["logits"]: its run of the forward's logits, listed job by job). For
        structured-output sessions: the grammar masks of their trees' likeliest paths, computed while the GPU runs
        the forward -> the logit rows whose top-k the greedy ones choose from."""
        rows, at = [], 0
        for job in jobs:
            job["logits"] = slice(at, at + len(job["logit_rows"]))
            at += len(job["logit_rows"])
            c = job["s"].constraint
            if c is not None and job["kind"] == "verify" and not job["s"].finished:
                c.look_ahead(job["tokens"], job["parents"])
                if job["s"].params.greedy:
                    rows += range(job["logits"].start, job["logits"].stop)
        return rows

    def _accept(self, job: dict, out, scores: torch.Tensor, host, features: bool, commits: list, keep: list,
                emits: list) -> None:
        """One job's rows: its walk (or the prompt's first token), into the step's commits, kept feature rows
        and emits."""
        s, lr = job["s"], job["logits"]
        if job["kind"] == "prefill":
            emits += self._prefilled(s, job, out, scores, host)
            if features and s.features_on:
                keep.append((s, job["start"], job["rows"]))
            return
        greedy_rows = host.argmax is not None and s.params.greedy
        position = self.table.length(s.id)
        walk, logprobs = accept_session(
            s, job["tokens"], job["parents"], scores[lr], self.config.force_accept_depth,
            argmax=host.argmax[lr] if greedy_rows else None,
            argmax_logprobs=host.logprobs[lr] if greedy_rows and host.logprobs is not None else None,
            raw=out.logits[lr], top=host.top_of(lr))
        commits.append((s.id, walk.accepted_rows))
        if features and s.features_on:
            keep.append((s, position, [job["rows"].start + r for r in walk.accepted_rows]))
        drafted = len(job["tokens"])
        if self.budget is not None and s.params.mode != AR:
            self.budget.record(s.id, drafted, walk.accepted_rows, sampled=not s.params.greedy)
        s.stats.record(len(walk.accepted_rows) - 1, drafted, unavailable=not job["drafted"])
        metrics.observe_acceptance(len(walk.accepted_rows), drafted, max(tree_depths(job["parents"])))
        emits.append((s, walk.tokens, logprobs, top_logprobs(out.logits[lr], walk.accepted_rows,
                                                             s.params.top_logprobs), 1))

    def _prefilled(self, s: Session, job: dict, out, scores: torch.Tensor, host) -> list[tuple]:
        """A prefill chunk's rows are in: its prompt logprobs if asked for, and after the prompt's last chunk the
        first token, from that chunk's last logit row -> [its emit] (none before the last chunk)."""
        lr = job["logits"]
        if s.params.prompt_logprobs:
            prompt_logprobs(s, job["start"], out.logits[lr])
        s.prefilled += job["n"]
        if s.prefilled < len(s.prompt):
            return []
        last = lr.stop - 1
        if host.argmax is not None and s.params.greedy and s.constraint is None:
            token = host.argmax[last]
            logprob = host.logprobs[last] if s.params.return_logprobs else 0.0
        else:
            token, logprob = first_token(s, scores[last], out.logits[last])
        return [(s, [token], [logprob], top_logprobs(out.logits[last:last + 1], [0], s.params.top_logprobs), 0)]

    def _publish_pages(self, s: Session, tokens: list[int]) -> None:
        """The session's full pages into the prefix cache, and the feature rows its ring still holds of each."""
        published = self.table.publish(s.id, tokens)
        ring, ps = s.features, self.table.page_size
        if self.feature_store is None or ring.rows is None:
            return
        for i, key in published:
            if ring.start <= i * ps and (i + 1) * ps <= ring.end:
                self.feature_store.put(key, ring.rows[i * ps - ring.start: (i + 1) * ps - ring.start])

    def _stored_features(self, s: Session, cached: int) -> tuple[int, torch.Tensor] | None:
        """On a prefix-cache hit: the stored feature rows of the last cached pages (up to the feature window) ->
        (their first position, rows), or None."""
        if self.feature_store is None or not cached or not s.features_on:
            return None
        ps = self.table.page_size
        limit = s.window // ps if s.window else cached // ps
        rows = self.feature_store.trailing(self.table.shared_keys(s.id), limit)  # the cached pages, just matched
        return (cached - len(rows) * ps, torch.cat(rows)) if rows else None

    @staticmethod
    def _kept_features(keep, hidden: torch.Tensor, on_host: torch.Tensor | None) -> list:
        """Each (session, position, rows) -> (session, position, its feature rows on the host): feature rings
        stay off the GPU. Without a host copy of every row: one gather of the kept rows, one read. The rows
        go into the rings after the next Propose is sent, which carries them (DraftPlanner.send)."""
        if on_host is None:
            index = [r for _, _, rows in keep for r in rows]
            on_host = hidden[torch.tensor(index, device=hidden.device)].cpu()
            parts = on_host.split([len(rows) for _, _, rows in keep])
            return [(s, position, part) for (s, position, _), part in zip(keep, parts)]
        return [(s, position, on_host[rows.start: rows.stop] if isinstance(rows, range) else on_host[rows])
                for s, position, rows in keep]

    def _settle(self, s: Session, tokens: list[int]):
        """A step's tokens → (kept, finish reason or None, stop id); advances the session's counters."""
        kept, reason, stop_id = s.truncate(tokens, self.eos_ids, self.config.max_context)
        now = time.monotonic()
        if s.first_token_s is None:
            s.first_token_s = now
        if reason is None and s.params.max_duration_s is not None and now - s.submitted_s >= s.params.max_duration_s:
            reason = pb.FINISH_REASON_TIME_LIMIT  # every token of the step is kept: the time ran out after them
        s.emitted += len(kept)
        s.output += kept
        if s.penalties is not None:  # made at the session's first penalized row, which this step had
            s.penalties.add(kept)
        if not s.params.greedy:  # greedy sessions never draw from their uniform stream
            s.rng.advance(len(tokens) if reason is None else len(kept))
        if reason is None:
            s.pending = tokens[-1]
        return kept, reason, stop_id

    def _publish(self, s: Session, kept: list[int], reason, stop_id, logprobs: list[float], tops: list,
                 steps: int) -> None:
        lp = logprobs[: len(kept)] if s.params.return_logprobs else []
        if kept or reason is None or s.prompt_logprobs:  # the first emission carries the prompt's logprobs
            s.emit(Emission(kept, lp, steps, top_logprobs=tops[: len(kept)], prompt_logprobs=s.prompt_logprobs,
                            prompt_top_logprobs=s.prompt_top_logprobs))
            s.prompt_logprobs, s.prompt_top_logprobs = [], []
        if reason is not None:
            self._finish(s, Emission([], [], 0, finish_reason=reason, matched_stop_token_id=stop_id))

    def _finish_cancelled(self, sid: str) -> None:
        with self._wake:
            queued = [s for s in self.waiting if s.id == sid]
            for s in queued:
                self.waiting.remove(s)
        for s in queued:
            s.emit(Emission([], [], 0, finish_reason=pb.FINISH_REASON_CANCELLED))
        if sid in self.active:
            self._finish(self.active[sid], Emission([], [], 0, finish_reason=pb.FINISH_REASON_CANCELLED))

    def _finish(self, s: Session, final: Emission) -> None:
        s.finished, s.finished_s = True, time.monotonic()
        metrics.observe_phases(s.phase_seconds(s.finished_s))
        self.active.pop(s.id, None)
        self.reserved.pop(s.id, None)
        if s.id in self.table.sessions():
            if final.error is None:  # after a failed step its pages' KV may be incomplete
                self._publish_pages(s, s.prompt + s.output)
            self.table.close(s.id)
        if self.drafting:
            self.drafting.release(s, self.inflight)
        if self.budget is not None:
            self.budget.forget(s.id)
        s.emit(final)


def build_engine(config, info=None) -> Engine:
    from verifier_service.drafter_client import DrafterClient
    from verifier_service.runner import Runner

    runner = Runner(config, info)
    if config.force_accept_depth:
        log.warning("force_accept_depth_on", depth=config.force_accept_depth,
                    note="TEST ONLY: drafted paths are accepted without the target's agreement")
    drafters = (DrafterClient(config.drafter, deadline_s=config.draft_deadline_ms / 1000,
                              max_message_mb=config.drafter_max_message_mb, transport=config.drafter_transport,
                              busy_poll_s=busy_poll.auto_ms(config.busy_poll_ms, config.device) / 1000)
                if config.drafter else None)
    return Engine(runner, config, drafters)
