"""The prefix cache under page pressure, end to end: a verifier with 85 KV pages of 16 tokens serves rounds of
concurrent DDTree streams whose prompts share a two-page prefix, so published pages are matched, held by
several sessions at once, released and evicted. Every output must equal the same request's on a verifier with
the prefix cache off, and the pages must all come back."""

from __future__ import annotations

import pytest
from stack import first_difference, gen_request, generate_many, new_stack, ok, pb, tiny_ckpt, wait_until  # noqa: F401

N = 24
COMMON = [(i * 41 + 7) % 1792 for i in range(32)]
FIRST = [COMMON + [(i * 13 + k * 5 + 1) % 1792 for k in range(20)] for i in range(6)]
SECOND = [COMMON + [(i * 29 + k * 3 + 2) % 1792 for k in range(20)] for i in range(6)]


def small_stack(request, tiny_ckpt, tmp_path_factory, cache: str):  # noqa: F811
    st_cm = new_stack(request, tiny_ckpt, tmp_path_factory)
    st = st_cm.__enter__()
    st.add_drafter(wait=False)
    st.add_verifier("--kv-cache-mb", "1", "--max-batch", "6", "--prefix-cache", cache, wait=False)
    st.add_gateway()
    return st_cm, st


@pytest.fixture(scope="module")
def stacks(request, tiny_ckpt, tmp_path_factory):  # noqa: F811
    cms = [small_stack(request, tiny_ckpt, tmp_path_factory, c) for c in ("true", "false")]
    try:
        yield [st for _, st in cms]
    finally:
        for cm, _ in cms:
            cm.__exit__(None, None, None)


def rounds(st) -> tuple[dict, list[int]]:
    outputs, cached = {}, []
    for prompts in (FIRST, FIRST, SECOND, FIRST):
        results = ok(generate_many(st.generation, [gen_request(p, N, mode=pb.SPEC_MODE_DDTREE, budget=16)
                                                   for p in prompts]))
        for p, r in zip(prompts, results):
            assert outputs.setdefault(tuple(p), r.ids) == r.ids, "a repeat gave other tokens"
        cached.append(sum(r.final.usage.cached_prompt_tokens for r in results))
    wait_until(lambda: st.verifier_info().pages_used == 0, 10, "every page back")
    info = st.verifier_info()
    assert (info.pages_cached > 0) == (cached[1] > 0) and info.pages_cached <= info.pages_total, info
    return outputs, cached


def test_rounds_under_page_pressure_equal_the_uncached_verifier(stacks):
    cache_on, cache_off = stacks
    info = cache_on.verifier_info()
    assert info.pages_total in (84, 85) and info.page_size == 16, info  # 84 on a GPU: one for the graphs
    got, cached = rounds(cache_on)
    want, none = rounds(cache_off)
    assert cached[0] < cached[1] and cached[2] >= 5 * 32, cached  # repeats and the shared prefix are found
    assert none == [0, 0, 0, 0]
    for prompt, ids in want.items():
        assert got[prompt] == ids, first_difference(got[prompt], ids)
