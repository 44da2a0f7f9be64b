"""A scripted `ddtree.internal.v1.Drafter` for end-to-end tests: trees built from the known answer.

The test registers, per request id (the verifier's session id), the prompt length and the target's
true continuation (from a prior plain-AR run with the same sampling). Each Propose then answers with a
tree that mixes that continuation with wrong branches, shaped so that the verifier must accept exactly
`planned` draft tokens:

* the true path (tokens continuation[j+1 .. j+a]) hangs under the root at varying sibling ranks,
  behind wrong siblings, with decoys (a wrong node whose child carries the *true* next token);
* under the path's last node only wrong tokens (the walk stops there), the rest of the budget filled
  with wrong nodes; the planned length `a` cycles over 0..min(B-1, budget) so every accepted length
  and every branch position occurs over a run.

Here j, the output index of the root token, is start_position + len(features) - prompt_len. Since the
next Propose's root index must be j + a + 1, the double checks the verifier's acceptance step by step
and records every discrepancy in `violations` (as it does for wrong roots or broken proto semantics).
A Propose whose root lies inside the prompt (j < 0: a prefill chunk's rows sent ahead) must carry the
prompt's token there when the test gave the prompt; it gets an unscripted tree (the verifier drops it).

It honours the proto like the real drafter: GetInfo (block_size, target_layer_ids, ...), per-session
cache length with resync_required on a mismatch, `reset`, Release (unknown → INVALID_ARGUMENT), per-item
errors for bad features / root / budget, and grpc.health.v1. Knobs inject faults: forget sessions (→
resync), answer late, or send malformed trees.
"""

from __future__ import annotations

import asyncio
import threading
import time
import zlib
from collections import Counter
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ddtree.internal.v1 import drafter_pb2 as dpb
from ddtree.internal.v1 import drafter_pb2_grpc as dpb_grpc
from ddtree.internal.v1 import tensor_pb2
from drafter_service.propose_socket import ProposeSocketServer
from service_kit.errors import ServiceError
from service_kit.tensors import from_proto

SERVICE_NAME = "ddtree.internal.v1.Drafter"


@dataclass
class Expected:
    prompt_len: int
    continuation: list[int]  # the target's tokens from output index 0
    prompt: list[int] | None = None  # checks the roots of prefill rows sent ahead, when given


@dataclass
class Progress:
    steps: int = 0  # trees sent for the session
    last: tuple[int, int] | None = None  # (root index j, planned accepted count) of the last tree sent


@dataclass
class Faults:
    forget_every: int = 0  # drop a session's cache every k-th propose of it (→ resync_required next)
    late_every: int = 0  # answer every k-th Propose call after `late_s` (past the verifier's deadline)
    late_s: float = 0.0
    malformed_every: int = 0  # every k-th tree of a session is malformed (bad parent / token / size)
    hold_s: float = 0.0  # every Propose waits this long before it reads its items (Release may overtake)


@dataclass
class Record:
    """What happened over a run, for the tests' assertions."""

    proposals: int = 0
    trees: int = 0
    resyncs: int = 0
    resets: int = 0
    reset_starts: list[int] = field(default_factory=list)  # start_position of each reset item
    item_errors: int = 0
    releases: list[str] = field(default_factory=list)
    planned: Counter = field(default_factory=Counter)  # planned accepted length -> trees
    branch_ranks: Counter = field(default_factory=Counter)  # sibling rank of accepted path nodes
    accepted_depths: Counter = field(default_factory=Counter)
    ahead: list[tuple[int, int]] = field(default_factory=list)  # (start, rows) of items rooted in the prompt
    transports: Counter = field(default_factory=Counter)  # Propose calls per transport: "grpc" or "framed"
    violations: list[str] = field(default_factory=list)


class ScriptedDrafter(dpb_grpc.DrafterServicer):
    def __init__(self, *, block_size: int, target_layer_ids: list[int], hidden_size: int, vocab_size: int,
                 mask_token_id: int, max_tree_budget: int = 256, faults: Faults | None = None):
        self.block_size, self.layer_ids, self.hidden = block_size, list(target_layer_ids), hidden_size
        self.vocab, self.mask, self.max_budget = vocab_size, mask_token_id, max_tree_budget
        self.faults = faults or Faults()
        self.expected: dict[str, Expected] = {}
        self.sessions: dict[str, int] = {}  # session -> cache length (dropped by Release, reset, forget)
        self.progress: dict[str, Progress] = {}
        self.record = Record()
        self.calls = 0
        self.propose_port = 0  # the framed Propose port, once ScriptedDrafterServer listens on one
        self.lock = threading.Lock()

    # ---- test API
    def expect(self, session_id: str, prompt_len: int, continuation: list[int],
               prompt: list[int] | None = None) -> None:
        with self.lock:
            self.expected[session_id] = Expected(prompt_len, list(continuation), prompt)

    # ---- gRPC
    def GetInfo(self, request, context):
        with self.lock:
            n = len(self.sessions)
        return dpb.DrafterInfo(block_size=self.block_size, target_layer_ids=self.layer_ids,
                               mask_token_id=self.mask, target_hidden_size=self.hidden, hidden_size=self.hidden,
                               vocab_size=self.vocab, max_tree_budget=self.max_budget, sessions=n,
                               model_name="scripted", propose_port=self.propose_port)

    def Release(self, request, context):
        with self.lock:
            if request.session_id not in self.sessions:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"session_id: unknown session {request.session_id!r}")
            del self.sessions[request.session_id]
            self.record.releases.append(request.session_id)
        return dpb.ReleaseResponse()

    def Propose(self, request, context):
        if self.faults.hold_s:
            time.sleep(self.faults.hold_s)
        with self.lock:
            self.calls += 1
            self.record.transports["framed" if context is None else "grpc"] += 1  # the framed port passes None
            late = self.faults.late_every and self.calls % self.faults.late_every == 0
            seen: set[str] = set()
            results = []
            for item in request.items:
                results.append(self._item(item, seen, unused=late))
                seen.add(item.session_id)
        if late:
            time.sleep(self.faults.late_s)
        return dpb.ProposeResponse(results=results)

    def ProposeStream(self, request_iterator, context):
        for request in request_iterator:
            yield self.Propose(request, context)

    # ---- one item
    def _error(self, sid: str, field_name: str, message: str) -> dpb.ProposeResult:
        self.record.item_errors += 1
        error = dpb.ItemError(field=field_name, message=f"{field_name}: {message}")
        return dpb.ProposeResult(session_id=sid, error=error)

    def _item(self, item: dpb.ProposeItem, seen: set[str], unused: bool) -> dpb.ProposeResult:
        sid, rec = item.session_id, self.record
        rec.proposals += 1
        if not sid or sid in seen:
            return self._error(sid, "session_id", "empty or repeated in one batch")
        width = len(self.layer_ids) * self.hidden
        if item.features.dtype != tensor_pb2.DTYPE_BFLOAT16:
            return self._error(sid, "features", f"dtype {item.features.dtype}: the proto says bf16")
        try:
            rows = from_proto(item.features, "features")
        except ServiceError as e:
            return self._error(sid, "features", e.message)
        if rows.dim() != 2 or rows.shape[1] != width:
            return self._error(sid, "features", f"shape {tuple(rows.shape)}, expected [n, {width}]")
        if not 0 <= item.root_token < self.vocab:
            return self._error(sid, "root_token", f"{item.root_token} outside the vocabulary")
        chain = item.mode == dpb.DRAFT_MODE_CHAIN
        if not chain and not 1 <= item.tree_budget <= self.max_budget:
            return self._error(sid, "tree_budget", f"{item.tree_budget} outside [1, {self.max_budget}]")
        if item.start_position < 0:
            return self._error(sid, "start_position", "negative")
        p = self.progress.setdefault(sid, Progress())
        self._check_root(sid, p, item, item.start_position + rows.shape[0])
        p.last = None
        held = self.sessions.get(sid, 0)
        if not item.reset and item.start_position != held:
            rec.resyncs += 1
            return dpb.ProposeResult(session_id=sid, resync_required=dpb.ResyncRequired(cache_length=held))
        if item.reset:
            rec.resets += 1
            rec.reset_starts.append(item.start_position)
        cache_len = self.sessions[sid] = item.start_position + rows.shape[0]
        p.steps += 1
        tree, planned, j = self._tree(sid, cache_len, p, item, chain)
        p.last = None if unused or planned is None else (j, planned)
        f = self.faults
        if f.forget_every and p.steps % f.forget_every == 0:
            del self.sessions[sid]  # as if evicted: the next non-reset item gets resync_required(0)
        rec.trees += 1
        return dpb.ProposeResult(session_id=sid, tree=tree)

    def _tree(self, sid: str, cache_len: int, p: Progress, item: dpb.ProposeItem, chain: bool):
        """-> (DraftTree, planned accepted count or None when the tree is not scripted, root index)."""
        e = self.expected.get(sid)
        budget = self.block_size - 1 if chain else item.tree_budget
        if e is None or cache_len < e.prompt_len:  # an unscripted session, or prefill rows sent ahead: any tree
            n = min(budget, self.block_size - 1)
            return _chain_tree([(item.root_token + d) % self.vocab for d in range(1, n + 1)]), None, -1
        j = cache_len - e.prompt_len
        if self.faults.malformed_every and p.steps % self.faults.malformed_every == 0:
            return self._malformed(p.steps, budget), None, j
        depth_cap = self.block_size - 1
        available = max(0, len(e.continuation) - 1 - j)
        cycle = min(depth_cap, budget)
        a = min((p.steps * 3 + zlib.crc32(sid.encode())) % (cycle + 1), available)
        truth = e.continuation[j + 1: j + 1 + depth_cap + 1]
        builder = _TreeBuilder(self.vocab, budget, depth_cap, seed=zlib.crc32(f"{sid}:{j}".encode()))
        ranks = builder.chain(truth, a) if chain else builder.tree(truth, a)
        self.record.planned[a] += 1
        for depth, rank in enumerate(ranks, start=1):
            self.record.branch_ranks[rank] += 1
            self.record.accepted_depths[depth] += 1
        return builder.proto(), a, j

    def _check_root(self, sid: str, s: Progress, item, root_position: int) -> None:
        """The root must be the target's token at its output index, and the last tree's planned
        acceptance must have happened."""
        e = self.expected.get(sid)
        if e is None:
            return
        j = root_position - e.prompt_len
        v = self.record.violations
        if j < 0:  # prefill rows sent ahead: the root is the next prompt token
            self.record.ahead.append((item.start_position, root_position - item.start_position))
            if e.prompt is not None and item.root_token != e.prompt[root_position]:
                v.append(f"{sid}: root {item.root_token} at prompt position {root_position}, the prompt has "
                         f"{e.prompt[root_position]}")
            if s.last is not None:
                v.append(f"{sid}: a tree planned {s.last[1]} accepted tokens, then a root inside the prompt")
            return
        if not 0 <= j < len(e.continuation):
            v.append(f"{sid}: root index {j} outside the continuation (start {item.start_position})")
        elif item.root_token != e.continuation[j]:
            v.append(f"{sid}: root {item.root_token} at output index {j}, the target's token is {e.continuation[j]}")
        if s.last is not None and j != s.last[0] + s.last[1] + 1:
            v.append(f"{sid}: tree at root index {s.last[0]} planned {s.last[1]} accepted tokens, "
                     f"but the next root index is {j}")

    def _malformed(self, step: int, budget: int) -> dpb.DraftTree:
        kind = step // max(1, self.faults.malformed_every) % 5
        if kind == 0:  # parent not an earlier node
            return dpb.DraftTree(tokens=[1, 2], parents=[0, 2], depths=[1, 2])
        if kind == 1:  # token outside the vocabulary
            return dpb.DraftTree(tokens=[self.vocab + 5], parents=[0], depths=[1])
        if kind == 2:  # fewer log-probs than nodes
            return dpb.DraftTree(tokens=[1, 2], parents=[0, 1], depths=[1, 2], logprobs=[-0.5])
        if kind == 3:  # not a log-probability
            return dpb.DraftTree(tokens=[1, 2], parents=[0, 1], depths=[1, 2], logprobs=[-0.5, float("nan")])
        n = budget + 3  # more nodes than asked for
        return _chain_tree([(7 * d) % self.vocab for d in range(1, n + 1)])


def _chain_tree(tokens: list[int]) -> dpb.DraftTree:
    return dpb.DraftTree(tokens=tokens, parents=list(range(len(tokens))), depths=list(range(1, len(tokens) + 1)))


class _TreeBuilder:
    """Nodes appended in order (parents always earlier); siblings distinct; depth <= depth_cap."""

    def __init__(self, vocab: int, budget: int, depth_cap: int, seed: int):
        self.vocab, self.budget, self.cap = vocab, budget, depth_cap
        self.rng = _Rng(seed)
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depth = [0]  # by node index (0 = root)
        self.kids: list[set[int]] = [set()]
        self.forbidden: dict[int, int] = {}  # path node -> the true next token (never a wrong child)

    @property
    def room(self) -> int:
        return self.budget - len(self.tokens)

    def add(self, parent: int, token: int) -> int:
        assert token not in self.kids[parent] and self.depth[parent] < self.cap and self.room > 0
        self.tokens.append(token)
        self.parents.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.kids[parent].add(token)
        self.kids.append(set())
        return len(self.tokens)

    def wrong(self, parent: int) -> int:
        """A token that is neither a sibling nor the true continuation under `parent`."""
        avoid = self.kids[parent] | {self.forbidden.get(parent, -1)}
        t = self.rng.below(self.vocab)
        while t in avoid:
            t = (t + 1) % self.vocab
        return t

    def chain(self, truth: list[int], a: int) -> list[int]:
        """Chain mode: the first `a` true tokens, then wrong ones, B-1 nodes in all."""
        node = 0
        for d in range(self.cap):
            if d < a:
                node = self.add(node, truth[d])
            else:
                if d < len(truth):
                    self.forbidden[node] = truth[d]
                node = self.add(node, self.wrong(node))
        return [0] * a

    def tree(self, truth: list[int], a: int) -> list[int]:
        """DDTree mode: true path of `a` nodes behind wrong siblings and decoys, then filler."""
        path, ranks = [0], []
        for d in range(a):
            parent = path[-1]
            self.forbidden[parent] = truth[d]
            before = 0
            for _ in range(self.rng.below(4)):
                if self.room - (a - d) <= 0:  # keep room for the rest of the path
                    break
                w = self.add(parent, self.wrong(parent))
                before += 1
                if self.room - (a - d) > 0 and d + 1 < len(truth) and self.depth[w] < self.cap and self.rng.below(2):
                    self.add(w, truth[d + 1])  # decoy: the right token under a wrong parent
            ranks.append(before)
            path.append(self.add(parent, truth[d]))
        end = path[-1]
        if a < len(truth):
            self.forbidden[end] = truth[a]
        if self.room and self.depth[end] < self.cap:
            self.add(end, self.wrong(end))  # the branch the walk must refuse
        self._fill()
        return ranks

    def _fill(self) -> None:
        open_nodes = [i for i in range(len(self.depth)) if self.depth[i] < self.cap]
        for _ in range(4 * self.budget):
            if not self.room or not open_nodes:
                return
            parent = open_nodes[self.rng.below(len(open_nodes))]
            node = self.add(parent, self.wrong(parent))
            if self.depth[node] < self.cap:
                open_nodes.append(node)

    def proto(self) -> dpb.DraftTree:
        return dpb.DraftTree(tokens=self.tokens, parents=self.parents, depths=self.depth[1:])


class _Rng:
    """A small deterministic generator (xorshift), independent of Python's hash seed."""

    def __init__(self, seed: int):
        self.x = (seed or 1) & 0xFFFFFFFF

    def below(self, n: int) -> int:
        x = self.x
        x ^= (x << 13) & 0xFFFFFFFF
        x ^= x >> 17
        x ^= (x << 5) & 0xFFFFFFFF
        self.x = x
        return x % n


class ScriptedDrafterServer:
    """The double served on 127.0.0.1 in this process (health included: the verifier probes it); with
    `framed`, also on a framed Propose port (the drafter service's own ProposeSocketServer, on an event
    loop thread), advertised in GetInfo as the real drafter does."""

    def __init__(self, drafter: ScriptedDrafter, port: int = 0, framed: bool = True):
        self.drafter = drafter
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))  # a stream holds a worker
        dpb_grpc.add_DrafterServicer_to_server(drafter, self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.address = f"127.0.0.1:{self.port}"
        self.framed = ProposeSocketServer(lambda r: drafter.Propose(r, None), 64 << 20) if framed else None
        self.loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> "ScriptedDrafterServer":
        self.server.start()
        if self.framed is not None:
            self.loop = asyncio.new_event_loop()
            threading.Thread(target=self.loop.run_forever, name="scripted-framed", daemon=True).start()
            self.drafter.propose_port = self._on_loop(self.framed.start("127.0.0.1", 0))
        self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        return self

    def _on_loop(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def stop_framed(self) -> None:
        """Closes the framed port and its connections (the gRPC service stays)."""
        if self.loop is not None:
            self._on_loop(self.framed.close())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.loop = None

    def stop(self) -> None:
        self.stop_framed()
        self.server.stop(0).wait(5)
