"""Test tensors shared by the reducer tests (eager and compiled): seeded, with planted non-finite values."""

from __future__ import annotations

import math

import torch


def gen(seed: int = 0) -> torch.Generator:
    """A private seeded generator: test data never depends on the global RNG."""
    return torch.Generator().manual_seed(seed)


def plant_nonfinite(x: torch.Tensor) -> torch.Tensor:
    """``x`` (contiguous) with NaN at every 7th element and +-inf on two other strides, in place."""
    flat = x.view(-1)
    flat[::7] = math.nan
    flat[3::11] = math.inf
    flat[5::13] = -math.inf
    return x
