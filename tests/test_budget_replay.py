"""`ddtree bench budget` (tools/budget_replay.py): the recorded trees and the replay against decoding itself, with the
shipped trained tiny pair on CPU."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from tools import budget_replay
from tools.budget_replay import COST_TABLES, Adaptive, Fixed, matched_nodes, record, replay

MODEL = Path(__file__).resolve().parents[1] / "models" / "kimi-tiny"
PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n"


@pytest.mark.parametrize("seed", range(20))
def test_matched_nodes_are_the_paths_that_spell_the_text(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 12)
    parents = [rng.randrange(i + 1) for i in range(n)]
    tokens = [rng.randrange(3) for _ in range(n)]
    following = [rng.randrange(3) for _ in range(rng.randint(0, 6))]
    got = matched_nodes(np.array(tokens), np.array(parents), following)
    for i in range(1, n + 1):
        path, node = [], i
        while node:
            path.append(tokens[node - 1])
            node = parents[node - 1]
        assert got[i - 1] == (path[::-1] == following[:len(path)])


@pytest.fixture(scope="module")
def pair_and_prompt():
    from gateway.tokenizer import KimiTokenizer
    from tools.spec_inprocess import InProcessPair

    return InProcessPair(MODEL, device="cpu"), KimiTokenizer.from_dir(MODEL).encode(PROMPT)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_replaying_a_fixed_budget_is_decoding_with_it(pair_and_prompt, temperature):
    """The recorded continuation is plain decoding's (greedy, or sampled with the same seed), and replaying a fixed
    budget takes the steps that DDTree decoding with that budget takes (the target's output does not depend on the
    trees)."""
    pair, prompt = pair_and_prompt
    trace = record(pair, prompt, 40, 16, temperature, seed=5)
    assert trace.emitted == pair.generate(prompt, 40, "ar", temperature=temperature, seed=5).tokens
    assert len(trace.positions) == 39 and sum(p.matched.sum() for p in trace.positions) > 20  # the drafter helps
    table = COST_TABLES["k26-model"]
    for n in (4, 16):
        decoded = pair.generate(prompt, 40, "ddtree", budget=n, temperature=temperature, seed=5)
        replayed = replay([trace], Fixed(n), table)
        assert replayed["steps"] == decoded.steps and replayed["tokens"] == 39
    adaptive = replay([trace], Adaptive(table), table)
    assert adaptive["tokens"] == 39 and adaptive["rows_per_step"] <= 17


def test_traces_round_trip_through_json(pair_and_prompt, tmp_path):
    pair, prompt = pair_and_prompt
    traces = [record(pair, prompt, 12, 8, 1.0, seed=2)]
    path = tmp_path / "t.json"
    path.write_text(budget_replay.json.dumps([budget_replay._trace_to(t) for t in traces]))
    args = budget_replay.configure(budget_replay.argparse.ArgumentParser()).parse_args(["--trace", str(path)])
    back = budget_replay.load_or_record(args)
    assert back[0].emitted == traces[0].emitted and back[0].temperature == 1.0
    for a, b in zip(traces[0].positions, back[0].positions):
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
        assert a.logprobs.tolist() == b.logprobs.tolist() and a.matched.tolist() == b.matched.tolist()
