"""Forced output tokens per tree row (verifier_service/forcing.py): hand-checked trees where the trigger is in the
output, on a path, or nowhere, and the logits each forced row keeps."""

from __future__ import annotations

import torch

from verifier_service.forcing import forced_logits, forced_token, row_forcing
from verifier_service.session import GenParams, Session

END, FORCED = 5, (7, 8, 9)


def session(output: list[int], after: int | None = END) -> Session:
    s = Session("s", [1, 2, 3], GenParams(forced_ids=FORCED, forced_after=after), emit=print, window=0)
    s.output = list(output)
    return s


def test_forced_token_follows_the_first_trigger():
    s = session([])
    assert [forced_token(s, c) for c in ([], [1], [5], [1, 5], [1, 5, 7], [1, 5, 7, 8], [1, 5, 7, 8, 9])] == \
        [None, None, 7, 7, 8, 9, None]
    assert forced_token(s, [5, 7, 8, 9, 5]) is None  # the first trigger counts, once
    free = session([], after=None)
    assert [forced_token(free, c) for c in ([], [4], [4, 4], [4, 4, 4])] == [7, 8, 9, None]


def test_rows_read_the_trigger_from_their_own_path():
    # rows: 0 root; 1 = 5 (under root); 2 = 7 (under 1); 3 = 6 (under root); 4 = 8 (under 2); 5 = 5 (under 3)
    tokens, parents = [5, 7, 6, 8, 5], [0, 1, 0, 2, 3]
    assert row_forcing(session([1, 2]), tokens, parents) == [(1, 7), (2, 8), (4, 9), (5, 7)]
    assert row_forcing(session([1, 5]), tokens, parents) == [(0, 7), (1, 8), (2, 9), (3, 8), (5, 9)]
    assert row_forcing(session([5, 7, 8, 9, 4]), tokens, parents) == []  # the window is behind the output
    assert row_forcing(session([4], after=None), tokens, parents) == [(0, 8), (1, 9), (3, 9)]


def test_forced_rows_keep_one_logit():
    s = session([1, 5])
    raw = torch.randn(5, 12)
    # logit rows 1-4: root, 7 (depth 1), 3 (under 7: depth 2), 8 (under the root: depth 1)
    job = dict(kind="verify", s=s, tokens=[7, 3, 8], parents=[0, 1, 0], logits=slice(1, 5))
    out = forced_logits([job], raw, raw)
    assert out is not raw and torch.equal(out[0], raw[0])
    for row, token in ((1, 7), (2, 8), (3, 9), (4, 8)):
        assert out[row].argmax() == token and out[row, token] == raw[row, token]
        assert torch.isinf(out[row]).sum() == 11
    plain = Session("p", [1], GenParams(), emit=print, window=0)
    assert forced_logits([dict(job, s=plain)], raw, raw) is raw


def test_min_new_tokens_bans_eos_and_stop_ids_on_early_rows():
    s = Session("s", [1, 2, 3], GenParams(min_new_tokens=3, stop_token_ids=frozenset({4})), emit=print, window=0)
    s.output = [6]
    raw = torch.zeros(6, 12)
    # rows 0-4 of the job: root (index 1), node 7 (2), node 3 under 7 (3), node 8 under the root (2), node 9 under 3
    job = dict(kind="verify", s=s, tokens=[7, 3, 8, 9], parents=[0, 1, 0, 2], logits=slice(1, 6))
    out = forced_logits([job], raw, raw, eos_ids=frozenset({11}))
    banned = torch.isinf(out)
    assert banned[:, [4, 11]].tolist() == [[False, False], [True, True], [True, True], [False, False], [True, True],
                                            [False, False]]
    assert banned.sum() == 6
    s.params = GenParams(min_new_tokens=3, stop_token_ids=frozenset({4}), ignore_eos=True)
    assert torch.isinf(forced_logits([job], raw, raw, eos_ids=frozenset({11}))).sum() == 3  # EOS allowed then
    prefill = dict(kind="prefill", s=s, start=0, n=3, logits=slice(0, 3))
    s.output = []
    assert torch.isinf(forced_logits([prefill], raw[:3], raw[:3], eos_ids=frozenset({11}))).nonzero().tolist() == \
        [[2, 4]]
