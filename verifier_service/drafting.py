"""Builds each step's draft requests from session state and folds the answers back in.

Feature bookkeeping per session: the drafter holds rows [0, drafter_len); each request sends rows
[drafter_len, committed) with the root token, and drafter_len moves to their end as it is sent (the
replica's stream answers in order, so a later request builds on it). Whenever the verifier cannot be
sure what the drafter holds (a resync answer, an item error, a late or failed call, a move to another
replica) the next request is a `reset` with the last `window` rows from the session's FeatureRing.
A prefilling session's rows go ahead chunk by chunk (`ahead`): the drafter injects them while the
verifier prefills the next chunk, and the tree it answers is dropped.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch

from ddtree.internal.v1 import drafter_pb2 as dpb
from service_kit.logs import get_logger
from verifier_service import metrics
from verifier_service.drafter_client import Draft, DraftRequest, DrafterClient
from verifier_service.session import AR, CHAIN, Session

log = get_logger("verifier.drafting")


@dataclass
class InFlight:
    """Propose calls sent ahead: the sessions asked for, each replica's call, and the sessions whose items
    only carry prefill rows ahead (their trees are dropped)."""

    sessions: list[Session]
    futures: dict[str, Future]
    ahead: frozenset[str] = frozenset()

    @property
    def session_ids(self) -> set[str]:
        return {s.id for s in self.sessions}

    def answered(self) -> bool:
        return all(f.done() for f in self.futures.values())


class DraftPlanner:
    def __init__(self, client: DrafterClient, config, vocab_size: int):
        self.client = client
        self.config = config
        self.vocab_size = vocab_size

    def _request(self, s: Session, fresh: tuple[int, torch.Tensor] | None = None,
                 root: int | None = None) -> DraftRequest | None:
        """fresh: (position, rows) of feature rows kept this step and not yet in the session's ring (the
        engine appends them after sending). A reset resends the ring's window, so it appends them first.
        root: the token after the rows (default: the session's pending token; the next prompt token when a
        prefilling session's rows go ahead)."""
        replica = self.client.route(s.id)
        if replica is None:
            return None
        if replica.address != s.drafter_replica:
            s.drafter_replica, s.needs_reset = replica.address, True
        reset = s.needs_reset or s.drafter_len < s.features.start
        if fresh is not None and (reset or s.features.rows is None):
            s.features.append(*fresh)
            fresh = None
        start, rows = s.features.since(s.features.start if reset else s.drafter_len)
        if fresh is not None:
            rows = torch.cat([rows, fresh[1]]) if rows.shape[0] else fresh[1]
        # What the replica holds once it has answered (see the docstring); a failed answer sets needs_reset.
        s.drafter_len, s.needs_reset = start + rows.shape[0], False
        return DraftRequest(session_id=s.id, start_position=start, features=rows,
                            root_token=s.pending if root is None else root, tree_budget=s.params.tree_budget,
                            chain=s.params.mode == CHAIN, reset=reset)

    def draft(self, sessions: list[Session]) -> dict[str, Draft]:
        """session_id → Draft for the sessions that got one this step (others verify root-only)."""
        wanted, requests, replica_of = self._requests(sessions, {}, {})
        if not requests:
            return {}
        return self._fold(wanted, self.client.propose(requests, replica_of))

    def send(self, sessions: list[Session], fresh: dict[str, tuple[int, torch.Tensor]],
             ahead: dict[str, int] | None = None) -> InFlight | None:
        """`draft` without the wait: the engine sends the next step's Propose as soon as the accepted
        paths are known, and fills feature rings, commits KV and streams tokens while the drafter works.
        fresh: session_id → (position, rows) kept this step, not yet in its ring (see `_request`).
        ahead: session_id → next prompt token, for prefilling sessions whose rows go ahead (in `sessions`)."""
        wanted, requests, replica_of = self._requests(sessions, fresh, ahead or {})
        if not requests:
            return None
        return InFlight(wanted, self.client.start(requests, replica_of), frozenset(ahead or ()))

    def receive(self, inflight: InFlight) -> dict[str, Draft]:
        """`send`'s drafts (sessions finished since then are skipped by the caller); none for `ahead` items."""
        drafts = self._fold(inflight.sessions, self.client.collect(inflight.futures))
        return {sid: d for sid, d in drafts.items() if sid not in inflight.ahead}

    def _requests(self, sessions: list[Session], fresh: dict[str, tuple[int, torch.Tensor]], roots: dict[str, int]):
        wanted = [s for s in sessions if s.params.mode != AR and (s.features.rows is not None or s.id in fresh)]
        requests = [r for r in (self._request(s, fresh.get(s.id), roots.get(s.id)) for s in wanted) if r is not None]
        sent = {r.session_id for r in requests}
        wanted = [s for s in wanted if s.id in sent]
        return wanted, requests, {s.id: self.client.replicas[s.drafter_replica] for s in wanted}

    def _fold(self, wanted: list[Session], answers: dict[str, object]) -> dict[str, Draft]:
        drafts = {}
        for s in wanted:
            drafts_for = answers.get(s.id)
            if isinstance(drafts_for, Draft):
                problem = tree_problem(drafts_for, self._node_limit(s), self.vocab_size)
                if problem is None:  # drafter_len and needs_reset were set when the request was sent
                    drafts[s.id] = drafts_for
                    continue
                # A malformed tree would fail the whole batch's forward (or overrun the scratch pages
                # reserved per session): verify this session root-only instead.
                log.warning("draft_invalid", session=s.id, replica=s.drafter_replica, problem=problem)
            s.needs_reset = True  # unknown drafter state: resend the window next step
            if isinstance(drafts_for, dpb.ItemError):
                log.warning("draft_item_error", session=s.id, field=drafts_for.field, message=drafts_for.message)
            elif drafts_for is None:
                metrics.DRAFT_UNAVAILABLE.inc()
        return drafts

    def _node_limit(self, s: Session) -> int:
        """Most nodes a tree may have: the budget asked for (chain: B-1, within the scratch reserved
        for max_tree_budget)."""
        return self.config.max_tree_budget if s.params.mode == CHAIN else s.params.tree_budget

    def release(self, s: Session, inflight: list[InFlight] = ()) -> None:
        """Free the session's drafter cache. With a Propose of it still in flight, only once the last such
        call has ended: a Release that overtook it would let the Propose (re)create the session, a leak."""
        if s.drafter_replica is None:
            return
        last = next((f for f in reversed(inflight) if s.id in f.session_ids), None)
        call = last.futures.get(s.drafter_replica) if last is not None else None
        if call is None:
            self.client.release(s.id)
        else:
            call.add_done_callback(lambda _: self.client.release(s.id))


def tree_problem(d: Draft, max_nodes: int, vocab_size: int) -> str | None:
    """Why a drafter's tree cannot be verified (None if it can): the proto's shape rules."""
    if len(d.parents) != len(d.tokens):
        return f"{len(d.tokens)} tokens but {len(d.parents)} parents"
    if len(d.tokens) > max_nodes:
        return f"{len(d.tokens)} nodes, at most {max_nodes} asked for"
    bad = next((i for i, p in enumerate(d.parents) if not 0 <= p <= i), None)
    if bad is not None:
        return f"node {bad + 1} has parent {d.parents[bad]}, not in [0, {bad + 1})"
    bad = next((t for t in d.tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        return f"token {bad} outside [0, {vocab_size})"
    if d.logprobs and len(d.logprobs) != len(d.tokens):
        return f"{len(d.tokens)} tokens but {len(d.logprobs)} logprobs"
    bad = next((i for i, lp in enumerate(d.logprobs) if not lp <= 0.0), None)  # NaN fails too
    if bad is not None:
        return f"node {bad + 1} has logprob {d.logprobs[bad]}, not a log-probability"
    return None
