"""How likely a drafted node is accepted, from the drafter's own probability of its token (reference/ddtree.md P15:
a DFlash drafter's q over- or under-estimates by depth, and the calibration is per checkpoint).

A node can only be accepted once its parent is (the root always is). Given that, the target takes the node's token
with some probability c that grows with the drafter's q_d(token) at the node's depth d. `Calibration` learns c per
(depth, q bin) from every verified node whose parent was accepted, starting from c = q itself (worth PRIOR_WEIGHT
observations), and keeps it non-decreasing in q at each depth (isotonic regression weighted by trials: a bin that
happens to beat its neighbour is pooled with it, and a bin never tried takes its neighbours' rate). A node's
probability of lying on the accepted path is then the product of c over its path (`path_rates`): at most its
parent's, so the most likely nodes always form a tree.

Layout: `hits` and `trials` are [MAX_DEPTH, Q_BINS] float64 decayed counts; bin b holds q in [b/Q_BINS, (b+1)/Q_BINS).
"""

from __future__ import annotations

import math

import numpy as np

PRIOR_WEIGHT = 2.0  # observations the drafter's own q counts for in each (depth, bin) cell's rate
FIT_WEIGHT = 0.05  # ...and the weight of a cell without trials in the monotone fit: it takes its measured neighbours'
# rate (a drafter found wrong where it is sure is taken to be wrong where it is less sure), where the prior's weight
# would hold a measured cell up at the unmeasured cells' q for tens of trials
DECAY = 0.998  # per recorded tree: old observations fade (the traffic changes)
Q_BINS = 20  # cells per depth, by the node's q: [0, 0.05), [0.05, 0.1), ...
MAX_DEPTH = 16  # kernels/ddtree_build's deepest block (L <= 16); deeper nodes would share the last row


class Calibration:
    def __init__(self):
        self.trials = np.zeros((MAX_DEPTH, Q_BINS))
        self.hits = np.zeros((MAX_DEPTH, Q_BINS))
        self.prior = np.broadcast_to((np.arange(Q_BINS) + 0.5) / Q_BINS, (MAX_DEPTH, Q_BINS))
        self._table: np.ndarray | None = None  # c per cell, recomputed after records

    @property
    def table(self) -> np.ndarray:
        """c [MAX_DEPTH, Q_BINS]: each cell's decayed hit rate with the prior, non-decreasing in q per depth."""
        if self._table is None:
            rate = (self.hits + PRIOR_WEIGHT * self.prior) / (self.trials + PRIOR_WEIGHT)
            weight = self.trials + FIT_WEIGHT  # a cell without trials follows its measured neighbours
            self._table = non_increasing_rows(rate[:, ::-1], weight[:, ::-1])[:, ::-1]
        return self._table

    def path_rates(self, parents, depths, logprobs: np.ndarray) -> list[float]:
        """Probability of each node (1-based, parents before children) lying on the accepted path."""
        c = self.table[_rows(depths), _bins(logprobs)].tolist()
        a = [1.0]  # the root
        for i, p in enumerate(parents):
            a.append(c[i] * a[p])
        return a[1:]

    def record(self, parents, depths, logprobs: np.ndarray, accepted_nodes) -> None:
        """One verified tree: nodes 1..N (parents, depths, log q at their depths) of which `accepted_nodes` lay on
        the accepted path. A node whose parent was accepted is one trial of its cell, a hit if it was accepted too."""
        self.trials *= DECAY
        self.hits *= DECAY
        accepted = np.zeros(len(parents) + 1, dtype=bool)
        accepted[0] = True
        accepted[list(accepted_nodes)] = True
        tried = accepted[np.asarray(parents, dtype=np.int64)]
        cells = (_rows(depths)[tried], _bins(logprobs)[tried])
        np.add.at(self.trials, cells, 1.0)
        np.add.at(self.hits, cells, accepted[1:][tried].astype(np.float64))
        self._table = None


def _rows(depths) -> np.ndarray:
    return np.minimum(np.asarray(depths, dtype=np.int64), MAX_DEPTH) - 1


def _bins(logprobs: np.ndarray) -> np.ndarray:
    return np.minimum((np.exp(logprobs) * Q_BINS).astype(np.int64), Q_BINS - 1)


def non_increasing_rows(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Each row of x [R, n] replaced by its closest non-increasing sequence in w-weighted squared error (isotonic
    regression; the same as pooling adjacent violators, which replaces each run that rises by its weighted mean):
    y_i = min over j <= i of max over k >= i of the weighted mean of x[j..k]. Vectorized over the [R, n, n] (j, k)
    means: a pool loop in Python costs ~100 us a row."""
    R, n = x.shape
    if n < 2:
        return x.astype(float)
    zero = np.zeros((R, 1))
    cx, cw = np.concatenate([zero, np.cumsum(w * x, axis=1)], 1), np.concatenate([zero, np.cumsum(w, axis=1)], 1)
    j, k = np.arange(n)[:, None], np.arange(n)[None, :]
    upper = k >= j
    span = np.where(upper, cw[:, None, 1:] - cw[:, :-1, None], 1.0)
    mean = np.where(upper, (cx[:, None, 1:] - cx[:, :-1, None]) / span, -math.inf)  # [R, j, k]
    most = np.maximum.accumulate(mean[:, :, ::-1], axis=2)[:, :, ::-1]  # [R, j, i]: max over k >= i
    return np.where(upper, most, math.inf).min(axis=1)
