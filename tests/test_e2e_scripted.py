"""End to end through gateway and verifier processes, drafts from the scripted drafter (issue 5).

The scripted double (scripted_drafter.py) knows the target's answer from a prior plain-AR run of the
same request and proposes trees that must be accepted to exactly a planned depth, so every accepted
length 0..B-1 and every branch position occurs — which the random tiny drafter never achieves. The
output must still equal plain AR token for token, greedy and seeded sampling alike.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from scripted_drafter import Faults, Record, ScriptedDrafter, ScriptedDrafterServer
from stack import (PROMPTS, first_difference, free_port, gen_request, generate, generate_many, new_stack, ok,  # noqa: F401
                   pb, prometheus_samples, tiny_ckpt, wait_until)

N = 64  # new tokens compared per request
CONFIGS = [(pb.SPEC_MODE_DDTREE, 4), (pb.SPEC_MODE_DDTREE, 16), (pb.SPEC_MODE_DDTREE, 64), (pb.SPEC_MODE_CHAIN, None)]


@pytest.fixture(scope="module")
def scripted(request, tiny_ckpt, tmp_path_factory):
    cfg = json.loads((tiny_ckpt / "drafter" / "config.json").read_text())
    drafter = ScriptedDrafter(block_size=cfg["block_size"], target_layer_ids=cfg["dflash_config"]["target_layer_ids"],
                              hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"],
                              mask_token_id=cfg["dflash_config"]["mask_token_id"])
    server = ScriptedDrafterServer(drafter).start()
    try:
        with new_stack(request, tiny_ckpt, tmp_path_factory) as st:
            # A short feature window: resyncs resend rows from s - 16, not from 0.
            # The scripted trees plan each step's accepted length: every node is verified (no adaptive budget, the
            # stack's default).
            st.verifier_metrics = free_port()
            st.add_verifier("--feature-window", "16", "--draft-deadline-ms", "1000", "--metrics-port",
                            str(st.verifier_metrics), drafters=[server.address], wait=False)
            st.add_gateway()
            yield st, drafter
    finally:
        server.stop()


@pytest.fixture
def drafter(scripted):
    """The scripted drafter with a fresh record and no faults; checks every session was released."""
    st, d = scripted
    d.record, d.faults = Record(), Faults()
    yield d
    d.faults = Faults()
    wait_until(lambda: not d.sessions, 10, "the verifier to release every drafter session")
    info = st.verifier_info()
    assert info.pages_used == 0 and info.live_sessions == 0, info


def ar_references(st, n: int, **sampling):
    """Plain AR outputs of PROMPTS, B tokens longer than compared (the trees look ahead)."""
    return [generate(st.generation, gen_request(p, n + 8, mode=pb.SPEC_MODE_AR, **sampling)) for p in PROMPTS]


def run_scripted(st, drafter, refs, mode, budget, n=N, prompts=PROMPTS, sampling=None):
    sampling = sampling or [{}] * len(prompts)
    reqs = [gen_request(p, n, mode=mode, budget=budget, **s) for p, s in zip(prompts, sampling)]
    for req, ref in zip(reqs, refs):
        drafter.expect(req.request_id, ref.final.usage.prompt_tokens, ref.ids)
    return ok(generate_many(st.generation, reqs))


def check_same(results, refs, n, label):
    for i, (r, ref) in enumerate(zip(results, refs)):
        assert r.ids == ref.ids[:n], f"{label}, prompt {i}: {first_difference(r.ids, ref.ids[:n])}"
        assert r.final.finish_reason == pb.FINISH_REASON_LENGTH and r.final.usage.completion_tokens == n


def histogram(results) -> list[int]:
    total: list[int] = []
    for r in results:
        h = list(r.final.spec_stats.acceptance_histogram)
        total += [0] * (len(h) - len(total))
        for k, c in enumerate(h):
            total[k] += c
    return total


def check_stats(r, mode, budget, block=8):
    s = r.final.spec_stats
    h = list(s.acceptance_histogram)
    assert s.mode == mode
    assert s.tree_budget == (block - 1 if mode == pb.SPEC_MODE_CHAIN else budget), s
    assert sum(h) == s.verify_steps, s
    assert sum(k * c for k, c in enumerate(h)) == s.accepted_draft_tokens, s
    assert s.mean_acceptance_length == pytest.approx((s.accepted_draft_tokens + s.verify_steps) / s.verify_steps)
    if budget is not None:
        assert len(h) <= budget + 1, f"accepted more draft tokens than the budget {budget} of nodes: {h}"


def test_greedy_lossless_with_scripted_trees(scripted, drafter):
    st, _ = scripted
    refs = ar_references(st, N)
    block = st.verifier_info().drafter_block_size
    results = []
    for mode, budget in CONFIGS:
        got = run_scripted(st, drafter, refs, mode, budget)
        check_same(got, refs, N, f"{pb.SpecMode.Name(mode)} budget {budget}")
        for r in got:
            check_stats(r, mode, budget, block)
            assert r.final.spec_stats.verify_steps < N - 1, "the scripted drafts never got accepted"
        results += got
    rec = drafter.record
    assert rec.violations == [], rec.violations[:5]
    hist = histogram(results)
    assert len(hist) == block and all(hist), f"accepted lengths 0..{block - 1} must all occur: {hist}"
    assert set(range(1, block)) <= set(rec.accepted_depths), rec.accepted_depths
    assert {0, 1, 2, 3} <= set(rec.branch_ranks), f"accepted nodes at sibling ranks {rec.branch_ranks}"
    assert rec.item_errors == 0 and rec.resyncs == 0
    assert rec.transports["framed"] > 0 and rec.transports["grpc"] == 0, f"framed port by default: {rec.transports}"


@pytest.mark.parametrize("mode, budget", [(pb.SPEC_MODE_DDTREE, 16), (pb.SPEC_MODE_CHAIN, None)],
                         ids=["ddtree16", "chain"])
def test_seeded_sampling_with_scripted_trees(scripted, drafter, mode, budget):
    """The sampled continuation, proposed as the tree's true path, is accepted as planned: the verifier
    samples row d with the uniform of output index emitted + d, exactly as plain AR does."""
    st, _ = scripted
    n = 48
    sampling = [dict(temperature=1.0, seed=1), dict(temperature=1.0, top_k=20, seed=2),
                dict(temperature=1.0, top_p=0.9, seed=3), dict(temperature=0.8, top_k=40, top_p=0.95, seed=4),
                dict(temperature=1.0, seed=5)]
    refs = [generate(st.generation, gen_request(p, n + 8, mode=pb.SPEC_MODE_AR, **s))
            for p, s in zip(PROMPTS, sampling)]
    got = run_scripted(st, drafter, refs, mode, budget, n=n, sampling=sampling)
    check_same(got, refs, n, f"sampled {pb.SpecMode.Name(mode)}")
    for r in got:
        check_stats(r, mode, budget)
    assert drafter.record.violations == [], drafter.record.violations[:5]
    assert len(histogram(got)) >= 6, f"long sampled acceptances expected: {histogram(got)}"


@pytest.mark.slow
def test_drafter_faults_keep_greedy_output(scripted, drafter):
    """Forgotten sessions (→ resync_required, then reset with the last 16 feature rows), late answers
    (past --draft-deadline-ms) and malformed trees: each costs a root-only step, never a token."""
    st, _ = scripted
    refs = ar_references(st, N)
    drafter.faults = Faults(forget_every=5, malformed_every=7, late_every=9, late_s=1.5)
    got = run_scripted(st, drafter, refs, pb.SPEC_MODE_DDTREE, 16)
    check_same(got, refs, N, "with drafter faults")
    rec = drafter.record
    assert rec.violations == [], rec.violations[:5]
    assert rec.resyncs > 0 and rec.resets >= rec.resyncs, rec
    assert any(start > 0 for start in rec.reset_starts), f"resets resend the window: {rec.reset_starts}"
    assert sum(r.final.spec_stats.draft_unavailable_steps for r in got) > 0
    assert sum(r.final.spec_stats.accepted_draft_tokens for r in got) > N, "drafts stopped being used"


def _with_logprobs(st, req):
    req.return_logprobs = True
    ids, logprobs, final = [], [], None
    for msg in st.generation.Generate(req, timeout=60):
        if msg.HasField("chunk"):
            ids += msg.chunk.token_ids
            logprobs += msg.chunk.logprobs
        else:
            final = msg.final
    return ids, logprobs, final


def test_stop_token_and_logprobs_inside_accepted_paths(scripted, drafter):
    """A stop id met in the middle of an accepted path truncates exactly like AR; the logprobs of
    tokens committed several per step equal AR's one-per-step ones."""
    st, _ = scripted
    prompt = PROMPTS[2]
    ref_ids, ref_lp, _ = _with_logprobs(st, gen_request(prompt, N + 8, mode=pb.SPEC_MODE_AR))
    req = gen_request(prompt, N, mode=pb.SPEC_MODE_DDTREE, budget=16)
    drafter.expect(req.request_id, len(prompt), ref_ids)
    ids, lp, final = _with_logprobs(st, req)
    assert ids == ref_ids[:N], first_difference(ids, ref_ids[:N])
    assert final.spec_stats.accepted_draft_tokens > N // 2
    assert max(abs(a - b) for a, b in zip(lp, ref_lp)) < 1e-4 and len(lp) == N
    stop = ref_ids[21]
    cut = ref_ids.index(stop)
    for mode in (pb.SPEC_MODE_AR, pb.SPEC_MODE_DDTREE):
        req = gen_request(prompt, N, mode=mode, budget=16 if mode == pb.SPEC_MODE_DDTREE else None)
        req.stopping.stop_token_ids.append(stop)
        drafter.expect(req.request_id, len(prompt), ref_ids)
        r = generate(st.generation, req)
        assert r.ids == ref_ids[:cut], first_difference(r.ids, ref_ids[:cut])
        assert r.final.finish_reason == pb.FINISH_REASON_STOP and r.final.matched_stop_token_id == stop
    assert drafter.record.violations == []


PENALIZED = [dict(presence_penalty=-1.5, frequency_penalty=0.25),  # negative presence: rows echo their own paths
             dict(presence_penalty=-1.0, repetition_penalty=0.7, logit_bias={7: 4.0, 11: -100.0}),
             dict(frequency_penalty=-0.8, repetition_penalty=1.3, temperature=1.0, seed=6),
             dict(presence_penalty=-1.2, temperature=0.8, top_p=0.9, seed=7),
             dict(presence_penalty=1.0, frequency_penalty=0.5, logit_bias={3: 2.0})]


def _penalized_request(prompt, n, mode, budget, fields):
    fields = dict(fields)
    bias = fields.pop("logit_bias", {})
    penalties = {k: fields.pop(k) for k in ("presence_penalty", "frequency_penalty", "repetition_penalty")
                 if k in fields}
    req = gen_request(prompt, n, mode=mode, budget=budget, **fields)
    for name, value in penalties.items():
        setattr(req.sampling, name, value)
    req.sampling.logit_bias.update(bias)
    return req


@pytest.mark.parametrize("mode, budget", [(pb.SPEC_MODE_DDTREE, 16), (pb.SPEC_MODE_CHAIN, None)],
                         ids=["ddtree16", "chain"])
def test_penalties_inside_accepted_paths(scripted, drafter, mode, budget):
    """Bias and penalties with drafts accepted several tokens deep: each tree row is penalized for its own path,
    so the output (greedy and seeded) equals plain AR's with the same fields, token for token. Negative
    penalties make the target repeat itself, so a row that ignored its path would choose differently."""
    st, _ = scripted
    n = 48
    refs = [generate(st.generation, _penalized_request(p, n + 8, pb.SPEC_MODE_AR, None, f))
            for p, f in zip(PROMPTS, PENALIZED)]
    plain = [generate(st.generation, gen_request(p, n, mode=pb.SPEC_MODE_AR)) for p in PROMPTS[:2]]
    assert all(r.ids != ref.ids[:n] for r, ref in zip(plain, refs)), "the penalties must change the output"
    reqs = [_penalized_request(p, n, mode, budget, f) for p, f in zip(PROMPTS, PENALIZED)]
    for req, ref in zip(reqs, refs):
        drafter.expect(req.request_id, ref.final.usage.prompt_tokens, ref.ids)
    got = ok(generate_many(st.generation, reqs))
    check_same(got, refs, n, f"penalized {pb.SpecMode.Name(mode)}")
    assert drafter.record.violations == [], drafter.record.violations[:5]
    assert len(histogram(got)) >= 6, f"long penalized acceptances expected: {histogram(got)}"


def test_forced_tool_call_inside_accepted_paths(scripted, drafter):
    """tool_choice with drafts accepted through the forced window: each tree row is forced (or not) by its own
    path, so DDTree gives AR's tokens; the scripted trees also offer wrong tokens there, which the target rejects."""
    import json

    st, _ = scripted
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]

    def chat(mode, budget=None, n=40):
        req = gen_request("", n, mode=mode, budget=budget)
        req.ClearField("input")
        req.chat.messages.add(role="user", content="Weather in Paris, please.")
        req.chat.tools_json, req.chat.tool_choice, req.chat.thinking = json.dumps(tools), "get_weather", False
        return req

    ref = generate(st.generation, chat(pb.SPEC_MODE_AR, n=48))
    req = chat(pb.SPEC_MODE_DDTREE, 16)
    drafter.expect(req.request_id, ref.final.usage.prompt_tokens, ref.ids)
    got = generate(st.generation, req)
    assert got.ids == ref.ids[:40], first_difference(got.ids, ref.ids[:40])
    assert got.final.spec_stats.accepted_draft_tokens > 10 and drafter.record.violations == []


def test_structured_output_inside_accepted_paths(scripted, drafter):
    """A JSON Schema format with drafts accepted several tokens deep: each emitted token is chosen under the grammar
    state after its own path, so DDTree gives AR's tokens, greedy and seeded; the scripted trees' wrong branches
    include tokens the grammar forbids, which are never accepted."""
    st, _ = scripted
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
              "n": {"type": "integer", "minimum": 0, "maximum": 999},
              "ok": {"type": "boolean"}}, "required": ["name", "n", "ok"], "additionalProperties": False,
              "x-guidance": {"whitespace_flexible": False}}

    def req(prompt, mode, budget, n, **sampling):
        r = gen_request(prompt, n, mode=mode, budget=budget, ignore_eos=False, **sampling)
        r.response_format.json_schema = json.dumps(schema)
        return r

    for prompt, sampling in ((PROMPTS[2], {}), (PROMPTS[3], dict(temperature=1.0, seed=3))):
        ref = generate(st.generation, req(prompt, pb.SPEC_MODE_AR, None, 64, **sampling))
        json.loads(ref.text)
        r = req(prompt, pb.SPEC_MODE_DDTREE, 16, 64, **sampling)
        drafter.expect(r.request_id, ref.final.usage.prompt_tokens, ref.ids)
        got = generate(st.generation, r)
        assert got.ids == ref.ids, first_difference(got.ids, ref.ids)
        assert got.final.spec_stats.accepted_draft_tokens >= len(ref.ids) // 3, got.final.spec_stats
    assert drafter.record.violations == [], drafter.record.violations[:5]


def test_prefix_cache_hit_sends_the_stored_feature_rows(scripted, drafter):
    """A prompt whose pages were cached by an earlier one: the drafter's reset starts within the stored rows of the
    last cached page (a full feature window of 16 rows here), not at the first prefilled position, and the output
    stays AR's."""
    st, _ = scripted
    prompt = [(i * 67 + 9) % 1792 for i in range(48)]  # its prefill publishes 3 pages, the ring holds the last
    generate(st.generation, gen_request(prompt, 4, mode=pb.SPEC_MODE_AR))
    longer = prompt + [11, 12, 13, 14, 15]  # 3 cached pages; page 2's rows come from the store
    ref = generate(st.generation, gen_request(longer, N + 8, mode=pb.SPEC_MODE_AR))
    req = gen_request(longer, N, mode=pb.SPEC_MODE_DDTREE, budget=16)
    drafter.expect(req.request_id, len(longer), ref.ids)
    got = generate(st.generation, req)
    assert got.final.usage.cached_prompt_tokens == 48 and got.ids == ref.ids[:N], first_difference(got.ids, ref.ids)
    # the last 16 rows before the root, 5 prefilled and 11 from the store (without it: 48)
    assert drafter.record.reset_starts[:1] == [len(longer) - 16], drafter.record.reset_starts
    assert drafter.record.violations == []


def _samples(st) -> dict[str, float]:
    """The verifier's /metrics as {'name{labels}': value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{st.verifier_metrics}/metrics", timeout=10) as r:
        return prometheus_samples(r.read().decode())


def test_per_depth_acceptance_metrics_match_the_requests_histograms(scripted, drafter):
    """ddtree_spec_decode_num_accepted_tokens_per_pos_total{position=p} counts the steps that accepted more than p
    draft tokens; ddtree_spec_tree_depth counts one tree per step. Their deltas over a run of scripted requests
    (every accepted length 0..B-1 occurs) must equal what the requests' own acceptance histograms say."""
    st, _ = scripted
    refs = ar_references(st, N)
    before = _samples(st)
    got = run_scripted(st, drafter, refs, pb.SPEC_MODE_DDTREE, 16)
    after = _samples(st)
    hist = histogram(got)
    assert len(hist) > 2 and hist[-1] > 0, hist

    def delta(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    for p in range(len(hist) + 1):
        assert delta(f'ddtree_spec_decode_num_accepted_tokens_per_pos_total{{position="{p}"}}') == sum(hist[p + 1:]), p
    steps = sum(hist)
    assert delta("ddtree_spec_tree_depth_count") == delta("ddtree_spec_decode_num_drafts_total") == steps
    assert delta("ddtree_spec_decode_num_accepted_tokens_total") == sum(k * c for k, c in enumerate(hist))
