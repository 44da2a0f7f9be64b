"""The drafter's weights stored as int8 (`--quantization int8`): each projection (fc, every layer's q/k/v/o and
gate/up/down) and the drafter's copy of the target lm_head keep int8 values with one fp32 scale per output row
(kernels/w8a16_gemm.quantize_int8), half the bytes of bf16.

Why: a Propose reads every drafter weight and the 2.3 GB lm_head once (Kimi's drafter: 9.4 GB in bf16, the
bandwidth floor of a step's draft, reference/perf.md §3.4). The drafter only chooses which tokens the verifier
checks, so its rounding can change acceptance but never the served tokens; the verifier's lm_head is untouched.

Int8Linear runs kernels/w8a16_gemm on CUDA for bf16 inputs of up to KERNEL_MAX_ROWS rows (a Propose's blocks and
new feature rows) and otherwise multiplies by the dequantized weight (CPU, fp32, and a resync's thousands of
rows, where one bf16 copy of the weight per call costs less than re-streaming it per 64 rows).

On an H200, Kimi's drafter at 1 / 4 / 8 sessions a Propose took -33 / -26 / -12 % against bf16 (BENCHMARKS.md,
session 37): from ~48 rows a weight pass is bound by the in-register decode and the MMAs, not by the bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import w8a16_gemm as w8

# Up to this many rows the kernel streams the int8 weight once per MAX_ROWS rows (1 B a parameter each pass, each
# pass bound by its decode and MMAs from ~48 rows); the dequantized path reads 1, writes 2 and reads 2 B a parameter.
KERNEL_MAX_ROWS = 2 * w8.MAX_ROWS


class Int8Linear(nn.Module):
    """nn.Linear's y = x Wᵀ (+ bias) with W = qweight · scale[:, None]: qweight int8 [out, in], scale fp32 [out]."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        return cls(*w8.quantize_int8(weight.detach()), None if bias is None else bias.detach())

    @classmethod
    def stacked(cls, parts) -> Int8Linear:
        """One Int8Linear of the parts' output rows in order (drafter_service/model.fused_rows)."""
        bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
        return cls(torch.cat([p.qweight for p in parts]), torch.cat([p.scale for p in parts]), bias)

    def rows(self, start: int) -> Int8Linear:
        """The output rows from `start` on, sharing this one's tensors (rows of a contiguous weight stay contiguous)."""
        return Int8Linear(self.qweight[start:], self.scale[start:], None if self.bias is None else self.bias[start:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] <= KERNEL_MAX_ROWS and w8.fits(flat, self.qweight, self.scale):
            y = w8.w8a16_gemm(flat, self.qweight, self.scale)
        else:
            y = F.linear(flat, w8.dequantize_int8(self.qweight, self.scale, x.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], -1)


def quantize_drafter(model: nn.Module) -> nn.Module:
    """Every nn.Linear of a DFlashDrafter and its `lm_head` table → Int8Linear, in place (each bf16 weight is
    released as soon as its int8 copy exists). Returns the model."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear.from_weight(child.weight, child.bias))
                del child
    head = model.lm_head
    model.lm_head = None  # the buffer goes first, so that the module may take its name
    model.lm_head = Int8Linear.from_weight(head)
    return model
