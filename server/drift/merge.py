"""Exact merging of running moments, shared by builders and frozen baselines.

Replicas build baselines independently; Chan's parallel formula lets their
moments combine in float64 as if one process had seen every pass.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import numpy.typing as npt

__all__ = ["chan_merge"]

_M = TypeVar("_M", float, "npt.NDArray[np.float64]")


def chan_merge(n_a: float, mean_a: _M, m2_a: _M, n_b: float, mean_b: _M, m2_b: _M) -> tuple[float, _M, _M]:
    """Merge two (count, mean, M2) triples with Chan et al.'s parallel formula.

    ``M2 = Σ (x - mean)^2``. Works element-wise on numpy arrays too.
    """
    n = n_a + n_b
    if n == 0:
        return 0.0, mean_a * 0.0, m2_a * 0.0
    delta = mean_b - mean_a
    mean = mean_a + delta * (n_b / n)
    m2 = m2_a + m2_b + delta * delta * (n_a * n_b / n)
    return n, mean, m2
