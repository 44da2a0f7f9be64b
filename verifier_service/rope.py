"""Interleaved-pair YaRN RoPE, DeepSeek flavour (reference/k26.md §3.4).

Pair i of a rope vector is (x[2i], x[2i+1]) rotated by angle p·f_i (DeepSeek / vLLM GPT-J style). HF's
`rope_interleave` de-interleaves q and k the same way before rotating, so q·k is unchanged; the cached
rope keys here stay in the interleaved layout. Angles are formed in fp32 (position · inv_freq) like HF
and vLLM's cos/sin caches, so far positions round identically across implementations.
"""

from __future__ import annotations

import math

import torch

from verifier_service.model_config import K2Config


def rope_inv_freq(cfg: K2Config) -> torch.Tensor:
    """-> fp32 [qk_rope_head_dim/2]: base frequencies, blended toward base/factor by the YaRN ramp."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # [dim/2]
    extrapolated = 1.0 / pos_freqs
    rs = cfg.rope_scaling
    if rs is None:
        return extrapolated
    interpolated = 1.0 / (rs.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        # The pair index whose wavelength fits `rotations` times into the original context.
        wavelengths = rs.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(wavelengths) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rs.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rs.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # share of the original (extrapolated) frequency: 1 for fast pairs, 0 for slow
    return interpolated * (1 - keep) + extrapolated * keep


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, amplitude: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int64 -> (cos, sin) fp32 [T, dim/2], scaled by the YaRN amplitude (1.0 for K2.6)."""
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]  # [T, dim/2]
    return angles.cos() * amplitude, angles.sin() * amplitude


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x [..., dim]; cos/sin broadcast against [..., dim/2]. Math in fp32."""
    pairs = x.float().unflatten(-1, (-1, 2))  # [..., dim/2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)  # [..., dim/2, 2]
    return rotated.flatten(-2).to(x.dtype)
