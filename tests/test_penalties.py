"""Logit bias and penalties on tree rows (verifier_service/penalties.py) against an independent reference applied
to each row's full context (tests/sampling_reference.py: transformers' processor and plain loops), and the checks
of the fields."""

from __future__ import annotations

import pytest
import torch
from sampling_reference import reference_penalize

from ddtree.v1 import generation_pb2 as pb
from service_kit.errors import InvalidArgument
from service_kit.sampling import check_sampling
from verifier_service.penalties import Penalties, path_counts, penalized_logits
from verifier_service.session import GenParams, Session

V = 40
CASES = [dict(presence=0.7), dict(frequency=0.45), dict(repetition=1.8), dict(repetition=0.6),
         dict(bias={3: 5.0, 17: -100.0, 39: 0.25}),
         dict(presence=-0.5, frequency=1.2, repetition=1.3, bias={0: 2.0, 5: -3.5})]


def params(case: dict) -> GenParams:
    return GenParams(presence_penalty=case.get("presence", 0.0), frequency_penalty=case.get("frequency", 0.0),
                     repetition_penalty=case.get("repetition", 1.0),
                     logit_bias=tuple(sorted(case.get("bias", {}).items())))


def random_tree(g: torch.Generator, n: int) -> tuple[list[int], list[int]]:
    """n nodes with small token ids (so that paths repeat tokens of the output and of each other)."""
    tokens = torch.randint(0, 12, (n,), generator=g).tolist()
    parents = [int(torch.randint(0, i + 1, (1,), generator=g)) for i in range(n)]
    return tokens, parents


def path_by_walking_up(tokens: list[int], parents: list[int], row: int) -> list[int]:
    path = []
    while row:
        path.append(tokens[row - 1])
        row = parents[row - 1]
    return path[::-1]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
@pytest.mark.parametrize("nodes", [0, 1, 9, 30])
def test_tree_rows_equal_plain_decoding_of_their_paths(case, nodes):
    g = torch.Generator().manual_seed(nodes)
    prompt = torch.randint(0, V, (23,), generator=g).tolist()
    output = torch.randint(0, 12, (15,), generator=g).tolist()
    tokens, parents = random_tree(g, nodes)
    logits = torch.randn(nodes + 1, V, generator=g) * 4
    pen = Penalties(params(case), prompt, V, torch.device("cpu"))
    pen.add(output[:6])
    pen.add(output[6:])
    got = pen.apply(logits, path_counts(tokens, parents))
    for r in range(nodes + 1):
        want = reference_penalize(logits[r], prompt, output + path_by_walking_up(tokens, parents, r), **case)
        torch.testing.assert_close(got[r], want, rtol=0, atol=1e-5, msg=f"row {r}")  # fp32 ops, same order


def test_only_penalized_jobs_change_and_prefill_rows_see_no_output():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, V, generator=g)
    plain = Session("a", [1, 2], GenParams(), emit=print, window=0)
    biased = Session("b", [4, 4, 9], params(CASES[-1]), emit=print, window=0)
    jobs = [dict(kind="verify", s=plain, tokens=[5, 6], parents=[0, 1], logits=slice(0, 3)),
            dict(kind="prefill", s=biased, logits=slice(3, 4)),
            dict(kind="verify", s=biased, tokens=[7, 4, 7, 1], parents=[0, 1, 0, 3], logits=slice(4, 9))]
    assert penalized_logits(jobs[:1], logits, V) is logits
    got = penalized_logits(jobs, logits, V)
    assert torch.equal(got[:3], logits[:3])
    torch.testing.assert_close(got[3], reference_penalize(logits[3], [4, 4, 9], [], **CASES[-1]), rtol=0, atol=1e-5)
    for r, path in enumerate([[], [7], [7, 4], [7], [7, 1]]):
        want = reference_penalize(logits[4 + r], [4, 4, 9], path, **CASES[-1])
        torch.testing.assert_close(got[4 + r], want, rtol=0, atol=1e-5)


BAD = {"presence_penalty": (dict(presence_penalty=2.5), "sampling.presence_penalty"),
       "frequency_penalty": (dict(frequency_penalty=-2.01), "sampling.frequency_penalty"),
       "frequency_penalty nan": (dict(frequency_penalty=float("nan")), "sampling.frequency_penalty"),
       "repetition_penalty 0": (dict(repetition_penalty=0.0), "sampling.repetition_penalty"),
       "repetition_penalty 11": (dict(repetition_penalty=11.0), "sampling.repetition_penalty"),
       "logit_bias token": (dict(logit_bias={V: 1.0}), f"sampling.logit_bias[{V}]"),
       "logit_bias negative token": (dict(logit_bias={-1: 1.0}), "sampling.logit_bias[-1]"),
       "logit_bias value": (dict(logit_bias={2: -100.5}), "sampling.logit_bias[2]"),
       "logit_bias entries": (dict(logit_bias={i: 1.0 for i in range(1025)}), "sampling.logit_bias")}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_fields_are_named(case):
    fields, name = BAD[case]
    with pytest.raises(InvalidArgument) as e:
        check_sampling(pb.SamplingParams(**fields), 2000 if case == "logit_bias entries" else V)
    assert e.value.field == name


def test_good_fields_pass():
    check_sampling(pb.SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=10,
                                     logit_bias={0: -100, V - 1: 100}), V)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_equal_the_reference():
    """The device path (counts by index_add_, paths by scatter_add_) at the K2.6 vocabulary."""
    vocab, g = 163840, torch.Generator().manual_seed(9)
    prompt = torch.randint(0, vocab, (300,), generator=g).tolist()
    output = torch.randint(0, 50, (40,), generator=g).tolist()
    tokens, parents = random_tree(g, 24)
    logits = torch.randn(25, vocab, generator=g) * 4
    case = CASES[-1]
    pen = Penalties(params(case), prompt, vocab, torch.device("cuda"))
    pen.add(output)
    got = pen.apply(logits.cuda(), path_counts(tokens, parents)).cpu()
    for r in range(25):
        want = reference_penalize(logits[r], prompt, output + path_by_walking_up(tokens, parents, r), **case)
        torch.testing.assert_close(got[r], want, rtol=0, atol=1e-5, msg=f"row {r}")
