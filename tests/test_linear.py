"""verifier_service.linear.project with `add`: on CPU (and with the kernel flag off) exactly F.linear + add,
so the reference path's numerics do not change; the GPU's one-call form is checked in test_skinny_linear_gpu."""

import torch
import torch.nn.functional as F

from verifier_service.linear import project


def test_project_add_on_cpu_is_linear_plus_add():
    g = torch.Generator().manual_seed(0)
    x, w, add = torch.randn(5, 48, generator=g), torch.randn(24, 48, generator=g), torch.randn(5, 24, generator=g)
    want = F.linear(x, w) + add
    for kernel in (False, True):  # the kernel flag changes nothing off the GPU
        assert torch.equal(project(x, w, kernel, add.clone()), want)
    assert torch.equal(project(x, w, False), F.linear(x, w))
