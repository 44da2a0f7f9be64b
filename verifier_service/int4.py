"""compressed-tensors "pack-quantized" INT4 weights (reference/k26.md §4), reference torch code.

On-disk format of one linear with logical shape [out, in]:
- `weight_packed` int32 [out, in/8]: word j of a row holds inputs 8j..8j+7, input 8j+i in bits
  [4i, 4i+3] (LSB first); each nibble stores q + 8 for q in [-8, 7].
- `weight_scale` bf16 [out, in/group]: one scale per `group` consecutive inputs of a row.
- `weight_shape` int32 [2] = (out, in).
W[n, k] = q[n, k] · scale[n, k // group]. Symmetric: no zero point, no g_idx.

Every function accepts leading batch dims (a stack of experts is [E, out, in/8]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

NIBBLES_PER_WORD = 8
INT4_MIN, INT4_MAX = -8, 7
OFFSET = 8  # stored nibble = q + OFFSET
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # bit offset of nibble i within its word


@dataclass(frozen=True)
class Int4Weight:
    """A packed INT4 linear, or a stack of them along leading dims (e.g. [E_local, ...]).

    `tiled`: the words and scales of each matrix are stored in `tile_int4`'s order (kernels/moe_w4a16's
    load-time layout) instead of row by row; the tensors keep their shapes and every function here reads
    either order."""

    packed: torch.Tensor  # int32 [..., out, in/8]
    scale: torch.Tensor  # bf16 [..., out, in/group]
    shape: tuple[int, int]  # logical (out, in) of one matrix
    tiled: bool = False

    @property
    def group_size(self) -> int:
        return self.shape[1] // self.scale.shape[-1]

    def select(self, index: int) -> Int4Weight:
        """One matrix of a stack (index along the first dim)."""
        return Int4Weight(self.packed[index], self.scale[index], self.shape, self.tiled)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        packed, scale = untile_int4(self.packed, self.scale) if self.tiled else (self.packed, self.scale)
        return dequantize_int4(packed, scale, self.shape, dtype)

    def tile(self) -> Int4Weight:
        """This weight in the tiled order (a copy; itself when already tiled)."""
        return self if self.tiled else Int4Weight(*tile_int4(self.packed, self.scale), self.shape, True)


# The tile of the tiled order: 16 output rows x 128 inputs (16 words and 4 group-32 scales a row), the unit
# one warp of kernels/moe_w4a16 streams per step.
TILE_ROWS, TILE_INPUTS, TILE_GROUP = 16, 128, 32


def tileable(shape: tuple[int, int], group: int) -> bool:
    """Whether a matrix of logical shape (out, in) and this scale group size has a tiled order."""
    return shape[0] % TILE_ROWS == 0 and shape[1] % TILE_INPUTS == 0 and group == TILE_GROUP


def tile_int4(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row order -> tiled order, same shapes. Words [..., out, in/8] are stored as [..., out/16, in/128, 16, 16]
    (row tile, 128-input chunk, row in the tile, word in the chunk), scales [..., out, in/32] as
    [..., out/16, in/128, 16, 4]: one 16-row tile's chunk is 1 KB of words and 128 B of scales, each contiguous,
    and a tile's chunks follow each other, so a tile streams as two sequential runs (H200: 5-8 % faster
    moe_w4a16 than reading 64 B pieces of rows 3.5 KB apart)."""
    return (_swap_tile_axes(packed, TILE_ROWS, TILE_INPUTS // NIBBLES_PER_WORD),
            _swap_tile_axes(scale, TILE_ROWS, TILE_INPUTS // TILE_GROUP))


def untile_int4(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled order -> row order (the inverse of tile_int4)."""
    return (_swap_tile_axes(packed, TILE_ROWS, TILE_INPUTS // NIBBLES_PER_WORD, inverse=True),
            _swap_tile_axes(scale, TILE_ROWS, TILE_INPUTS // TILE_GROUP, inverse=True))


def _swap_tile_axes(t: torch.Tensor, rows: int, cols: int, inverse: bool = False) -> torch.Tensor:
    """[..., R, C] as [..., R/rows, rows, C/cols, cols] <-> [..., R/rows, C/cols, rows, cols], same shape."""
    *lead, R, C = t.shape
    if R % rows or C % cols:
        raise ValueError(f"{tuple(t.shape)} is not a whole number of {rows} x {cols} tiles")
    split = (R // rows, C // cols, rows, cols) if inverse else (R // rows, rows, C // cols, cols)
    return t.reshape(*lead, *split).transpose(-3, -2).contiguous().view(t.shape)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 [..., in] with values in [-8, 7] -> int32 [..., in/8] (8 nibbles per word, LSB first)."""
    if q.dtype != torch.int8:
        raise TypeError(f"pack_int4 expects int8 values, got {q.dtype}")
    if q.shape[-1] % NIBBLES_PER_WORD:
        raise ValueError(f"input dim {q.shape[-1]} is not a multiple of {NIBBLES_PER_WORD}")
    if q.numel() and (int(q.min()) < INT4_MIN or int(q.max()) > INT4_MAX):
        raise ValueError(f"values outside [{INT4_MIN}, {INT4_MAX}] cannot be packed into 4 bits")
    nibbles = (q.to(torch.int64) + OFFSET).unflatten(-1, (-1, NIBBLES_PER_WORD))  # [..., in/8, 8]
    words = (nibbles << _SHIFTS.to(q.device, torch.int64)).sum(-1)  # [..., in/8] in [0, 2^32)
    words = torch.where(words >= 2**31, words - 2**32, words)  # reinterpret as signed int32
    return words.to(torch.int32)


def unpack_int4(packed: torch.Tensor, in_features: int | None = None) -> torch.Tensor:
    """int32 [..., in/8] -> int8 [..., in] in [-8, 7]; `in_features` trims padding words."""
    if packed.dtype != torch.int32:
        raise TypeError(f"unpack_int4 expects int32 words, got {packed.dtype}")
    # Arithmetic shift keeps the sign bits of negative words; the & 0xF mask discards them.
    nibbles = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF  # [..., in/8, 8]
    q = (nibbles - OFFSET).to(torch.int8).flatten(-2)  # [..., in]
    if in_features is not None:
        q = q[..., :in_features]
    return q


def quantize_int4_groupwise(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-group INT4: w [..., out, in] -> (packed int32 [..., out, in/8], scale bf16 [..., out, in/group]).

    scale = absmax / 7 rounded to bf16 (the ±7 grid of Kimi's QAT experts); q = round(w / scale).
    """
    if w.shape[-1] % group:
        raise ValueError(f"input dim {w.shape[-1]} is not a multiple of group size {group}")
    groups = w.float().unflatten(-1, (-1, group))  # [..., out, in/group, group]
    scale = (groups.abs().amax(-1) / INT4_MAX).to(torch.bfloat16)  # [..., out, in/group]
    safe = torch.where(scale == 0, torch.ones_like(scale), scale).float().unsqueeze(-1)
    q = torch.round(groups / safe).clamp(INT4_MIN, INT4_MAX).to(torch.int8).flatten(-2)
    return pack_int4(q), scale


def dequantize_int4(
    packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """-> [..., out, in] in `dtype`. The product q·scale is formed in fp32 (exact) and rounded once
    to `dtype`, which for bf16 equals compressed-tensors' own round_bf16(q·s)."""
    out_features, in_features = shape
    q = unpack_int4(packed, in_features)  # [..., out, in]
    if q.shape[-2] != out_features or in_features % scale.shape[-1]:
        raise ValueError(f"packed {tuple(packed.shape)} / scale {tuple(scale.shape)} do not fit {shape}")
    group = in_features // scale.shape[-1]
    s = scale.float().repeat_interleave(group, dim=-1)  # [..., out, in]
    return (q.float() * s).to(dtype)


def linear(x: torch.Tensor, w: torch.Tensor | Int4Weight) -> torch.Tensor:
    """y = x Wᵀ for a dense or INT4 weight; the reference path dequantizes to x's dtype first."""
    if isinstance(w, Int4Weight):
        return F.linear(x, w.dequantize(x.dtype))
    return F.linear(x, w.to(x.dtype))
