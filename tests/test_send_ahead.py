"""The verifier sends the next step's Propose before it commits and streams the current step (engine
`_finish_step` → drafting.send), and collects it at the start of the next step.

In process: the real Runner on the tiny checkpoint (CPU), the real DrafterClient, and the scripted
drafter (scripted_drafter.py) answering with trees built from a plain-AR run. The engine is stepped by
hand, so "sent ahead" is observable without timing: after a decode step returns, the drafter has
already received the next Propose, whose root is the step's last emitted token. The output must still
equal plain AR token for token.
"""

from __future__ import annotations

import json
import time

import pytest
from scripted_drafter import ScriptedDrafter, ScriptedDrafterServer
from stack import tiny_ckpt  # noqa: F401

from verifier_service.config import VerifierConfig
from verifier_service.engine import build_engine
from verifier_service.session import AR, DDTREE, GenParams, Session

PROMPT = [5, 17, 300, 41, 9, 77, 123, 8]
N = 40


@pytest.fixture(scope="module")
def scripted_server(tiny_ckpt):  # noqa: F811
    cfg = json.loads((tiny_ckpt / "drafter" / "config.json").read_text())
    drafter = ScriptedDrafter(block_size=cfg["block_size"], target_layer_ids=cfg["dflash_config"]["target_layer_ids"],
                              hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"],
                              mask_token_id=cfg["dflash_config"]["mask_token_id"])
    server = ScriptedDrafterServer(drafter).start()
    yield drafter, server
    server.stop()


def _engine(model, drafter_address):
    config = VerifierConfig(model=str(model), device="cpu", dtype="float32", kv_cache_mb=8, page_size=16,
                            drafter=(drafter_address,), draft_deadline_ms=5000, adaptive_tree_budget=False)
    return build_engine(config)


def _run(engine, sid: str, mode: str, on_step=None) -> list[int]:
    """Submits one session and steps the engine by hand until it ends; its emitted token ids."""
    out = []
    s = Session(sid, list(PROMPT), GenParams(max_new_tokens=N, ignore_eos=True, mode=mode, tree_budget=8),
                out.append, window=64)
    s.features_on = True
    engine.submit(s)
    while not s.finished:
        engine._admit()
        engine.step()
        if on_step is not None and not s.finished:
            on_step(s)
    assert out[-1].error is None, out[-1].error
    return [t for e in out for t in e.token_ids]


def _wait(predicate, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


def test_next_propose_is_sent_before_the_step_returns(tiny_ckpt, scripted_server):  # noqa: F811
    drafter, server = scripted_server
    engine = _engine(tiny_ckpt, server.address)
    engine.runner.target_layer_ids = tuple(drafter.layer_ids)  # what the server learns from GetInfo
    checked = []

    def sent_ahead(s):
        # After verify step k (and after the prefill step, k = 0) returns, the drafter gets Propose
        # k + 1 with no further step: the engine sent it before committing and emitting step k.
        k = s.stats.verify_steps
        trees = lambda: drafter.progress["tree"].steps if "tree" in drafter.progress else 0  # noqa: E731
        assert _wait(lambda: trees() == k + 1), f"after step {k}: the drafter has {trees()} Propose calls"
        checked.append(k)

    try:
        ar = _run(engine, "ar", AR)
        drafter.expect("tree", len(PROMPT), ar)
        tree = _run(engine, "tree", DDTREE, on_step=sent_ahead)
        assert all("tree" not in f.session_ids for f in engine.inflight)
    finally:
        engine.drafting.client.close()
    assert len(ar) == N and tree == ar, "drafts sent ahead changed the output"
    assert checked[:2] == [0, 1] and len(checked) >= 3, checked
    assert drafter.record.accepted_depths, "no drafted token was ever accepted"
    assert not drafter.record.violations, drafter.record.violations[:5]


def test_cancel_with_a_propose_in_flight_releases_after_it(tiny_ckpt, scripted_server):  # noqa: F811
    """A session cancelled while its sent-ahead Propose is still in flight: the Release goes out only
    after that call ends. The drafter here reads each Propose 0.3 s late; the first Propose of a session
    (start 0) creates its drafter cache, so a Release sent at once would find no session and the held
    Propose would then create one that nobody releases."""
    drafter, server = scripted_server
    engine = _engine(tiny_ckpt, server.address)
    engine.runner.target_layer_ids = tuple(drafter.layer_ids)
    s = Session("cancelled", list(PROMPT), GenParams(max_new_tokens=N, ignore_eos=True, mode=DDTREE, tree_budget=8),
                [].append, window=64)
    s.features_on = True
    drafter.faults.hold_s = 0.3
    try:
        engine.submit(s)
        engine._admit()
        engine.step()  # prefill: the first token, and the session's first Propose sent ahead (held)
        assert any("cancelled" in f.session_ids for f in engine.inflight)
        engine._finish_cancelled("cancelled")
        assert s.finished
        assert _wait(lambda: "cancelled" in drafter.record.releases, 5), "the drafter never saw a Release"
        assert "cancelled" not in drafter.sessions, "the held Propose re-created the released session"
    finally:
        drafter.faults.hold_s = 0.0
        engine.drafting.client.close()


def test_prefill_rows_go_ahead_chunk_by_chunk(tiny_ckpt, scripted_server):  # noqa: F811
    """A prompt prefilled in chunks: each chunk's feature rows go to the drafter as soon as the chunk is done
    (rooted at the next prompt token; the tree answered is dropped), a prefill step does not wait for that
    answer, and the first decode Propose carries only the last chunk's rows. The output still equals AR."""
    drafter, server = scripted_server
    config = VerifierConfig(model=str(tiny_ckpt), device="cpu", dtype="float32", kv_cache_mb=8, page_size=16,
                            drafter=(server.address,), draft_deadline_ms=5000, prefill_chunk=3,
                            adaptive_tree_budget=False)
    engine = build_engine(config)
    engine.runner.target_layer_ids = tuple(drafter.layer_ids)
    try:
        ar = _run(engine, "ar-chunked", AR)
        drafter.expect("chunked", len(PROMPT), ar, prompt=list(PROMPT))
        before = (drafter.record.resyncs, len(drafter.record.reset_starts), len(drafter.record.ahead))
        s = Session("chunked", list(PROMPT), GenParams(max_new_tokens=N, ignore_eos=True, mode=DDTREE, tree_budget=8),
                    [].append, window=64)
        s.features_on = True
        drafter.faults.hold_s = 3.0  # every Propose is read 3 s late (a loaded machine took 1 s for two prefill steps)
        engine.submit(s)
        engine._admit()
        engine.step()  # chunk [0, 3): its rows go ahead
        engine.step()  # chunk [3, 6) does not wait for the first call, and goes ahead too
        assert not s.decoding and len(engine.inflight) == 2 and not engine.inflight[0].answered()
        drafter.faults.hold_s = 0.0
        out = []
        s.emit = out.append
        while not s.finished:
            engine._admit()
            engine.step()
        tree = [t for e in out for t in e.token_ids]
    finally:
        drafter.faults.hold_s = 0.0
        engine.drafting.client.close()
    assert tree == ar, "prefill rows sent ahead changed the output"
    assert drafter.record.ahead[before[2]:] == [(0, 3), (3, 3)]
    # The first decode Propose started at 6 (else the drafter had answered resync_required); the only reset
    # is the session's first item, which opens its drafter cache.
    assert drafter.record.resyncs == before[0] and drafter.record.reset_starts[before[1]:] == [0]
    assert drafter.record.accepted_depths and not drafter.record.violations, drafter.record.violations[:5]
