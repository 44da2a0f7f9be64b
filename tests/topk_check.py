"""Top-k comparison that tolerates fp32 near-ties: two implementations may order tokens whose log-probs differ by
less than their rounding either way."""

from __future__ import annotations

import numpy as np
import torch


def assert_topk_matches(ids: np.ndarray, logprobs: np.ndarray, ref: torch.Tensor, atol: float = 2e-5) -> None:
    """ids, logprobs [R, k] of the implementation; ref [R, V] the reference log-probs. The values equal the
    reference's k best within atol, and each id is the reference's id at its rank or one whose reference
    log-prob is within atol of that rank's (a near-tie swapped)."""
    top = ref.topk(ids.shape[-1], dim=-1)
    np.testing.assert_allclose(logprobs, top.values.numpy(), rtol=0, atol=atol)
    own = ref.gather(-1, torch.as_tensor(ids, dtype=torch.long)).numpy()  # [R, k] reference log-prob of each id
    differ = ids != top.indices.numpy()
    gap = np.abs(own - top.values.numpy())
    assert not (differ & (gap > atol)).any(), (
        f"ids differ beyond near-ties at {np.argwhere(differ & (gap > atol))[:5].tolist()}")
    assert all(len(set(row)) == len(row) for row in ids.tolist()), "repeated ids"
