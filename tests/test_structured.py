"""Structured output on the verifier (verifier_service/grammar.py, stepping.constrained_walk) against an independent
oracle: Python `regex`'s partial full-match says which token keeps a text a viable prefix of the pattern, and plain
constrained decoding is a masked argmax at each position of the accepted path."""

from __future__ import annotations

import random

import numpy as np
import pytest
import regex
import torch

from stack import tiny_ckpt  # noqa: F401

from gateway.tokenizer import KimiTokenizer
from verifier_service.acceptance import SessionRng, filter_probs, sample_with_uniforms, walk_tree
from verifier_service.grammar import Constraint, greedy_choice, load_vocabulary, single_token
from verifier_service.session import GenParams, Session
from verifier_service.stepping import TOP_K, accept_session, draw_ahead, first_token

MODEL = "models/kimi-tiny"
# ASCII only, no `.` or negated classes: a token with a non-ASCII byte (read as latin-1) can never match. No run of
# two or more forced bytes either: there llguidance allows only the first token of the run's canonical tokenization
# (after "(red|green)" and "g", "re" but not "r" or "ree"), which a prefix oracle does not model.
PATTERN = r"[yn]( [0-9]{1,3})?(,[rgb]+)*!"


@pytest.fixture(scope="module")
def tok():
    return KimiTokenizer.from_dir(MODEL)


@pytest.fixture(scope="module")
def vocab(tok):
    return load_vocabulary(MODEL, tok.vocab_size, tok.stop_ids)


def oracle_allowed(tok, text: str) -> set[int]:
    """Ids that keep `text` + token a prefix of some full match; the EOS ids once `text` itself matches."""
    allowed = {t for t in range(tok.num_regular)
               if regex.fullmatch(PATTERN, text + tok.token_bytes(t).decode("latin-1"), partial=True)}
    return allowed | (set(tok.stop_ids) if regex.fullmatch(PATTERN, text) else set())


def text_of(tok, ids: list[int]) -> str:
    return b"".join(tok.token_bytes(t) for t in ids).decode("latin-1")


def allowed_by(c: Constraint, v: int) -> set[int]:
    return set(torch.isfinite(c.restrict(torch.zeros(v))).nonzero().flatten().tolist())


def test_masks_equal_the_regex_oracle(tok, vocab):
    c, consumed = Constraint(vocab, _grammar(), None), []
    for piece in ["", "y", " 4", "2", ",r", "gb", ",b", "!"]:
        for t in tok.encode(piece):
            c.advance(t)
            consumed.append(t)
        prefix = text_of(tok, consumed)
        assert allowed_by(c, tok.vocab_size) == oracle_allowed(tok, prefix), prefix
    assert allowed_by(c, tok.vocab_size) == set(tok.stop_ids)  # complete: only EOS
    wider = c.restrict(torch.zeros(tok.vocab_size + 7))  # the model's vocab may exceed the tokenizer's
    assert not torch.isfinite(wider[tok.vocab_size:]).any()


def _grammar() -> str:
    import llguidance
    return llguidance.LLMatcher.grammar_from_regex(PATTERN)


def _tree(tok, rnd: random.Random, path: list[int], extra: int, free: int) -> tuple[list[int], list[int], list[float]]:
    """A tree holding `path` (node i + 1 under node i), a forbidden sibling ("x", "?" or EOS) next to each path node
    with a higher logit at their parent's row (lower for the first `free` path nodes, which precede the grammar),
    and `extra` random nodes -> tokens, parents and each node's logit boost at its parent's row."""
    words = ("y", "n", " 1", "2", ",", "r", "g", "!", "x", "yes", " ", "b", "gb")
    pool = [t for w in words for t in tok.encode(w)]
    bad = [tok.encode("x")[0], tok.encode("?")[0], tok.stop_ids[0]]
    tokens, parents, boost, row = [], [], [], 0
    for i, t in enumerate(path):
        tokens += [t, rnd.choice(bad)]
        parents += [row, row]
        boost += [10.0 if i < free else 8.0, 9.0]
        row = len(tokens) - 1
    for _ in range(extra):
        parents.append(rnd.randrange(0, len(tokens) + 1))
        tokens.append(rnd.choice(pool))
        boost.append(6.0 + rnd.random())  # below the path: the walk goes the whole path
    return tokens, parents, boost


def _oracle_walk(tok, output: list[int], tokens, parents, logits, after: int | None, sampled=None) -> list[int]:
    """Plain constrained decoding read down the tree: at each row, the argmax over the tokens the oracle allows after
    the output and the row's path (free before `after`), or with `sampled` = (temperature, seed) a draw from them
    with the uniform of the row's output position."""
    kids = {}
    for i, (t, p) in enumerate(zip(tokens, parents), 1):
        kids.setdefault((p, t), i)
    u = SessionRng(sampled[1]).peek(len(tokens) + 1) if sampled else None
    row, emitted = 0, []
    while True:
        context = output + emitted
        start = 0 if after is None else (context.index(after) + 1 if after in context else None)
        row_logits = logits[row].clone()
        if start is not None:
            mask = torch.full_like(row_logits, float("-inf"))
            mask[sorted(oracle_allowed(tok, text_of(tok, context[start:])))] = 0
            row_logits = row_logits + mask
        if sampled:
            probs = filter_probs(row_logits.unsqueeze(0), sampled[0], 0, 1.0)
            token = int(sample_with_uniforms(probs, u[len(emitted)].reshape(1))[0])
        else:
            token = int(row_logits.argmax())
        emitted.append(token)
        if (row, token) not in kids:
            return emitted
        row = kids[(row, token)]


@pytest.mark.parametrize("how", ["device", "host", "sampled", "sampled-ahead"])
@pytest.mark.parametrize("trial", range(6))
def test_walk_equals_constrained_decoding(tok, vocab, trial, how):
    """Random trees whose nodes' tokens get the highest logits at their parents' rows, allowed or not: the walk
    must follow the grammar state of each row's own path (a mask from the root alone, or none, diverges). `host`:
    as the engine runs it, with the likeliest path's masks computed ahead and greedy rows choosing on the host from
    their argmax and top-k; `sampled`: seeded draws at temperature 0.5 (one batched draw before the grammar opens,
    then row by row), and `sampled-ahead` with the likeliest path's rows drawn in one batch during the step."""
    rnd, think_end = random.Random(trial), tok.specials["</think>"]
    after = think_end if trial % 2 else None
    output = tok.encode("y 12") if after is None else tok.encode("hm")
    path = tok.encode("3,rgbr,gb!") if after is None else [think_end] + tok.encode("n 4,rr,g!")
    tokens, parents, boost = _tree(tok, rnd, path, 12, free=0 if after is None else 1)
    logits = torch.randn(len(tokens) + 1, tok.vocab_size, generator=torch.Generator().manual_seed(trial)) / 2
    for t, p, b in zip(tokens, parents, boost):
        logits[p, t] = max(float(logits[p, t]), b)  # a token drafted twice under one parent keeps one boost
    sampled = (0.5, trial) if how.startswith("sampled") else None
    params = GenParams(temperature=0.5, seed=trial) if sampled else GenParams()
    s = Session("s", [1, 2], params, emit=print, window=0)
    s.constraint = Constraint(vocab, _grammar(), after)
    for t in output:
        s.constraint.advance(t)
    want = _oracle_walk(tok, output, tokens, parents, logits, after, sampled)
    extra = {}
    if how == "sampled-ahead":
        s.constraint.look_ahead(tokens, parents)
        draw_ahead(s, logits, parents)
        assert s.constraint.drawn is not None or not s.constraint.open
    if how == "host":
        s.constraint.look_ahead(tokens, parents)
        best = logits.topk(TOP_K)
        extra = dict(argmax=logits.argmax(-1).tolist(), top=list(zip(best.indices.tolist(), best.values.tolist())))
    walk, _ = accept_session(s, tokens, parents, logits, **extra)
    assert walk.tokens == want
    assert len(walk.accepted_rows) == len(want)
    if sampled:  # draws may leave the boosted path early; most trials go deep
        return
    assert len(walk.accepted_rows) >= 5, "accepted several tokens deep, through constrained rows"
    free = walk_tree(tokens, parents, logits.argmax(-1).tolist())
    assert free.tokens != want, "the forbidden siblings must win without the grammar"


def test_first_token_is_constrained(tok, vocab):
    s = Session("s", [1, 2], GenParams(), emit=print, window=0)
    s.constraint = Constraint(vocab, _grammar(), None)
    logits = torch.zeros(tok.vocab_size)
    logits[tok.encode("x")[0]] = 50.0
    logits[tok.encode("n")[0]] = 10.0
    token, _ = first_token(s, logits)
    assert token == tok.encode("n")[0]
    assert allowed_by(s.constraint, tok.vocab_size) == oracle_allowed(tok, "n")


def test_bench_grammar_constrains_every_sample_answer(capsys):
    """`ddtree bench grammar` walks each format's sample answer through a Constraint (every token must be allowed)."""
    from service_kit.cli import main

    assert main(["bench", "grammar", "--vocab", f"{MODEL}/tiktoken.model", "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| json") or
            line.startswith("| regex")]
    assert len(rows) == 4, rows


def test_greedy_choice_equals_the_masked_argmax():
    """The host's pick from a row's top-k against torch's argmax of the masked row (the smallest id among equal
    maxima), on coarse logits full of ties; None only where the top-k cannot decide."""
    gen = torch.Generator().manual_seed(0)
    decided = 0
    for trial in range(400):
        logits = torch.randint(0, 150, (300,), generator=gen).float()  # many exact ties
        allowed = torch.rand(300, generator=gen) < (0.02 if trial % 2 else 0.5)
        bits = np.packbits(allowed.numpy(), bitorder="little").tobytes()
        best = logits.topk(16)
        got = greedy_choice(bits, best.indices.tolist(), best.values.tolist())
        masked = torch.where(allowed, logits, float("-inf"))
        if got is None:
            kth = float(best.values[-1])
            assert not allowed.any() or float(masked.max()) <= kth
        else:
            decided += 1
            assert got == int(masked.argmax()), trial
    assert decided > 100


def test_look_ahead_leaves_the_matcher_and_masks_the_likeliest_path(tok, vocab):
    c = Constraint(vocab, _grammar(), None)
    for t in tok.encode("n 7"):
        c.advance(t)
    before = c.mask()
    path = tok.encode("5,ggr,b!")
    tokens, parents = [], []
    for i, t in enumerate(path):  # the chain, each node with a later sibling that the grammar also allows
        tokens += [t, tok.encode("9")[0]]
        parents += [2 * i - 1 if i else 0, 2 * i - 1 if i else 0]
    c.look_ahead(tokens, parents)
    assert c.mask() == before
    ahead, drawn = c.take_ahead()
    assert drawn == {}
    text = "n 7"
    row = 0
    for i, t in enumerate(path):
        assert sorted(np.nonzero(np.unpackbits(np.frombuffer(ahead[row], np.uint8), bitorder="little"))[0]) == \
            sorted(oracle_allowed(tok, text)), (i, text)
        text += tok.token_bytes(t).decode("latin-1")
        row = 2 * i + 1
    assert c.take_ahead() == ({}, {})


def test_single_token_reads_a_one_id_mask():
    def bits(ids, n=4352):
        flags = np.zeros(n, dtype=bool)
        flags[list(ids)] = True
        return np.packbits(flags, bitorder="little").tobytes()

    assert [single_token(bits(ids)) for ids in ([5], [0], [4351], [], [3, 9], [0, 4351])] == [5, 0, 4351, None, None,
                                                                                               None]


def test_a_failing_grammar_ends_only_its_own_request(tiny_ckpt):  # noqa: F811
    """A matcher that fails mid-generation (llguidance's parser limits can) ends its request with INVALID_ARGUMENT;
    the plain request decoded in the same steps gets exactly its solo tokens, and every KV page comes back."""
    import llguidance

    from verifier_service.config import VerifierConfig
    from verifier_service.engine import build_engine
    from verifier_service.grammar import GrammarError
    from verifier_service.session import AR

    def engine():
        return build_engine(VerifierConfig(model=str(tiny_ckpt), device="cpu", dtype="float32", kv_cache_mb=8,
                                           page_size=16, prefix_cache=False))

    def run(e, sessions):
        for s in sessions:
            e.submit(s)
        while not all(s.finished for s in sessions):
            e._admit()
            e.step()

    def plain(out):
        return Session("plain", [5, 17, 300, 41], GenParams(max_new_tokens=12, ignore_eos=True, mode=AR), out.append,
                       window=0)

    solo = []
    run(engine(), [plain(solo)])
    e, together, failed = engine(), [], []
    bad = Session("bad", [9, 8, 7], GenParams(max_new_tokens=12, mode=AR), failed.append, window=0)
    bad.constraint = Constraint(e.vocabulary, llguidance.LLMatcher.grammar_from_regex("[a-z ]{1,40}"), None)
    advance, calls = bad.constraint.advance, []

    def failing(token):
        calls.append(token)
        if len(calls) > 3:
            raise GrammarError("grammar: a parser limit (test)")
        advance(token)
    bad.constraint.advance = failing
    run(e, [plain(together), bad])
    assert failed[-1].error == "grammar: a parser limit (test)" and failed[-1].error_code == "INVALID_ARGUMENT"
    assert sum(len(x.token_ids) for x in failed) == 3
    assert together[-1].error is None
    assert [t for x in together for t in x.token_ids] == [t for x in solo for t in x.token_ids]
    assert e.table.num_free == e.table.num_pages
