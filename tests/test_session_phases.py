"""Session.phase_seconds: the queue / prefill / decode split of a request's time in the verifier."""

import pytest

from verifier_service.session import GenParams, Session


def _session(**marks) -> Session:
    s = Session("r", [1, 2, 3], GenParams(), emit=lambda e: None, window=16)
    s.submitted_s = 10.0
    for name, value in marks.items():
        setattr(s, name, value)
    return s


@pytest.mark.parametrize("marks, now, want", [
    ({}, 12.0, {"queue": 2.0}),  # still waiting
    ({"admitted_s": 11.0}, 14.0, {"queue": 1.0, "prefill": 3.0}),  # prefilling
    ({"admitted_s": 11.0, "first_token_s": 11.5}, 20.0, {"queue": 1.0, "prefill": 0.5, "decode": 8.5}),
    ({"admitted_s": 11.0, "first_token_s": 11.5, "finished_s": 13.0}, 99.0,  # finished: `now` no longer counts
     {"queue": 1.0, "prefill": 0.5, "decode": 1.5}),
    ({"finished_s": 10.25}, 99.0, {"queue": 0.25}),  # ended before admission (a failed admission)
])
def test_phase_seconds(marks, now, want):
    assert _session(**marks).phase_seconds(now) == pytest.approx(want)
