"""Dense projections: F.linear, or kernels/skinny_linear for the few rows of a decode or tree-verify step on
a GPU (`kernel`: the model's kernel flag). The kernel computes each row the same way whatever the row count,
so a tree's root row matches a one-row decode step bit for bit (kernels/skinny_linear.py says why it exists).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SKINNY_MAX_ROWS = 64  # kernels.skinny_linear.MAX_ROWS (not imported: CPU-only installs never load kernels)


def project(x: torch.Tensor, weight: torch.Tensor, kernel: bool = False) -> torch.Tensor:
    """x [T, K] @ weight [N, K]ᵀ -> [T, N] in x's dtype."""
    if kernel and x.is_cuda:
        from kernels.skinny_linear import fits, skinny_linear

        if fits(x, weight):
            return skinny_linear(x, weight)
    return F.linear(x, weight)
