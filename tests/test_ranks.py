"""verifier_service.ranks on CPU: when the one-shot all-reduce (kernels/all_reduce) is used at all. The kernel
itself runs on two GPUs in tests/test_all_reduce_gpu.py."""

import torch

from kernels import all_reduce
from verifier_service import ranks


class TwoRanks:
    """The gather of a 2-rank control group, the other rank's answers given."""

    def __init__(self, other):
        self.info, self.other, self.calls = ranks.RankInfo(0, 2, 0), list(other), 0

    def gather(self, obj):
        self.calls += 1
        return [obj, self.other.pop(0)]


def test_no_peers_on_cpu_or_when_off():
    control = TwoRanks([])
    assert ranks.open_peers(control, torch.device("cpu"), 1024, 1.0) is None
    assert ranks.open_peers(control, torch.device("cuda", 0), 0, 1.0) is None
    assert control.calls == 0  # no collective either: every rank decides alike from its config


def test_one_shot_only_if_every_rank_mapped_the_others(monkeypatch):
    monkeypatch.setattr(all_reduce.PeerBuffers, "open", classmethod(lambda cls, *a: "mapped"))
    assert ranks.open_peers(TwoRanks([True]), torch.device("cuda", 0), 1024, 1.0) == "mapped"
    control = TwoRanks([False])  # rank 1 could not map rank 0's buffer: both ranks keep NCCL
    assert ranks.open_peers(control, torch.device("cuda", 0), 1024, 1.0) is None
    assert control.calls == 1


def test_a_failed_map_still_joins_the_agreement(monkeypatch):
    def fail(cls, *a):
        raise RuntimeError("peer access not supported")

    monkeypatch.setattr(all_reduce.PeerBuffers, "open", classmethod(fail))
    control = TwoRanks([True])
    assert ranks.open_peers(control, torch.device("cuda", 0), 1024, 1.0) is None
    assert control.calls == 1  # the other rank is not left waiting in its gather
