"""The adaptive tree budget end to end (drafter, verifier, gateway processes) with the shipped trained tiny pair, whose
drafter is good enough that its trees get cut, not dropped: greedy DDTree output equals plain AR decoding's while
each step verifies only the nodes the budget keeps."""

from __future__ import annotations

from pathlib import Path

import pytest
from stack import first_difference, gen_request, generate, generate_many, new_stack, ok, pb

MODEL = Path(__file__).resolve().parents[1] / "models" / "kimi-tiny"
PROMPTS = ["import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n",
           "class Node:\n    def __init__(self, value, children=None):\n        self.value = value\n",
           "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n"]
N = 96


@pytest.fixture(scope="module")
def trained(request, tmp_path_factory):
    with new_stack(request, MODEL, tmp_path_factory) as st:
        st.add_drafter(wait=False)
        st.add_verifier(adaptive=True)
        st.add_gateway()
        yield st


def test_cut_trees_are_lossless(trained):
    refs = [generate(trained.generation, gen_request(p, N, mode=pb.SPEC_MODE_AR)) for p in PROMPTS]
    got = ok(generate_many(trained.generation, [gen_request(p, N, mode=pb.SPEC_MODE_DDTREE, budget=16)
                                                for p in PROMPTS]))
    drafted = steps = 0
    for i, (r, ref) in enumerate(zip(got, refs)):
        assert r.ids == ref.ids, f"prompt {i}: {first_difference(r.ids, ref.ids)}"
        s = r.final.spec_stats
        assert s.mode == pb.SPEC_MODE_DDTREE and s.tree_budget == 16 and s.draft_unavailable_steps == 0, s
        drafted, steps = drafted + s.draft_tokens, steps + s.verify_steps
    assert drafted > 0 and steps < len(PROMPTS) * (N - 1)  # trees were verified and accepted tokens...
    print(f"{drafted / steps:.1f} nodes verified a step, {len(PROMPTS) * (N - 1) / steps:.2f} tokens")
    assert drafted < 16 * steps  # ...and cut: fewer nodes than the budget
