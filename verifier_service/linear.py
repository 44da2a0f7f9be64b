"""Dense projections: F.linear, or kernels/skinny_linear for the few rows of a decode or tree-verify step on
a GPU (`kernel`: the model's kernel flag). The kernel computes each row the same way whatever the row count,
so a tree's root row matches a one-row decode step bit for bit (kernels/skinny_linear.py says why it exists).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def on_kernel(x: torch.Tensor, weight: torch.Tensor, kernel: bool) -> bool:
    """Whether `project(x, weight, kernel)` runs kernels/skinny_linear (imported only on a GPU: CPU-only
    installs never load kernels)."""
    if not (kernel and x.is_cuda):
        return False
    from kernels.skinny_linear import fits

    return fits(x, weight)


def project(x: torch.Tensor, weight: torch.Tensor, kernel: bool = False,
            add: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ weight [N, K]ᵀ (+ add [T, N]) -> [T, N] in x's dtype. With `kernel` on a GPU the sum is one
    cuBLAS call that accumulates into `add` (overwritten, returned): one launch, one rounding."""
    if on_kernel(x, weight, kernel):
        from kernels.skinny_linear import skinny_linear

        y = skinny_linear(x, weight)
        return y if add is None else y + add
    if add is None:
        return F.linear(x, weight)
    if kernel and x.is_cuda and x.dim() == 2:
        return add.addmm_(x, weight.t())
    return F.linear(x, weight) + add


def fuse_rows(weights, fused: str, first: str, second: str) -> None:
    """In a frozen weights dataclass's __post_init__: field `fused` = [first ; second] (rows, one new tensor)
    and the two named fields become views of it, so projections that read the same input run as one GEMM
    and the weights are held once."""
    a, b = getattr(weights, first), getattr(weights, second)
    cat = torch.cat([a, b])
    object.__setattr__(weights, fused, cat)
    object.__setattr__(weights, first, cat[: a.shape[0]])
    object.__setattr__(weights, second, cat[a.shape[0]:])
