"""Dense projections: F.linear, or a few-row kernel for the rows of a decode or tree-verify step on a GPU
(`kernel`: the model's kernel flag): kernels/skinny_linear in fp32 (the tiny pair), kernels/skinny_gemm in bf16
(K2.6). Both compute each row the same way whatever the row count, so a tree's root row matches a one-row
decode step bit for bit (kernels/skinny_linear.py and skinny_gemm.py say why they exist).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def on_kernel(x: torch.Tensor, weight: torch.Tensor, kernel: bool) -> bool:
    """Whether `project(x, weight, kernel)` runs a few-row kernel (else F.linear / cuBLAS). The kernels are
    imported only on a GPU: CPU-only installs never load them."""
    if not (kernel and x.is_cuda):
        return False
    from kernels import skinny_gemm, skinny_linear

    return skinny_linear.fits(x, weight) or skinny_gemm.fits(x, weight)


def project(x: torch.Tensor, weight: torch.Tensor, kernel: bool = False,
            add: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ weight [N, K]ᵀ (+ add [T, N]) -> [T, N] in x's dtype. With `kernel` on a GPU a bf16 sum is one
    launch that accumulates into `add` (skinny_gemm, or cuBLAS past its rows): a contiguous `add` is overwritten
    and returned, another is copied first; use the returned tensor either way."""
    if on_kernel(x, weight, kernel):
        if x.dtype == torch.bfloat16:  # the two kernels' fits() split by dtype
            from kernels.skinny_gemm import skinny_gemm

            return skinny_gemm(x, weight, None if add is None else add.contiguous())
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
