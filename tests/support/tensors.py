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


def drawn_sample(x: torch.Tensor, size: int, seed: int = 0) -> torch.Tensor:
    """The non-NaN float64 values of the sample a plan seeded ``seed`` draws first from contiguous ``x``.

    Replayed from the sampling contract (uniform with replacement through the
    plan's private generator, or the whole tensor when it has at most ``size``
    elements), not through the workspace, so a reference built on it does not
    share the sort or the draw under test. Unsorted.
    """
    flat = x.reshape(-1)
    if flat.numel() > size:
        flat = flat[torch.randint(0, flat.numel(), (size,), generator=gen(seed))]
    values = flat.to(torch.float64)
    return values[~values.isnan()]


def batch_rows(dtype: torch.dtype, rows: int = 6, n: int = 700) -> torch.Tensor:
    """Rows with an offset mean, planted non-finite values, an all-NaN row, an all-inf row and zeros."""
    x = torch.randn((rows, n), generator=gen(1)) * 3 + 1e3
    plant_nonfinite(x[1])
    x[2] = math.nan
    x[3] = math.inf
    x[4, :50] = 0
    return x.to(dtype)
