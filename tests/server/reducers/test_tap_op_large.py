"""``layertap::tap_stats`` past 2^31 elements, against a closed form (slow: it reads 2^31 values)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from layertap.server.reducers.op import new_rows, tap_stats
from layertap.server.reducers.op.reference import sample_positions

pytestmark = pytest.mark.slow


def test_more_than_2_pow_31_elements_match_their_closed_form() -> None:
    """2^31 + 2^11 logical elements, as an expanded view of one 2,048-value row (no 8 GiB allocation):
    every index and count in the op is 64-bit, so nothing wraps at 2^31."""
    width, rows = 2048, 2**20 + 1
    x = torch.arange(width, dtype=torch.float32).expand(rows, width)
    assert x.numel() > 2**31
    out = new_rows(1, "cpu")
    tap_stats(x, out, torch.tensor([0]), torch.ones(1, dtype=torch.int32))
    got = out[0].numpy()
    sample = sorted(float(i % width) for i in sample_positions(x.numel()))
    k = sample[(len(sample) - 1) // 2]  # the op's shift: the lower median of 32 evenly spaced values
    j = np.arange(width, dtype=np.float64)
    want = np.array([rows, 0, rows * width, rows * (j - k).sum(), rows * ((j - k) ** 2).sum(), k, 0.0, width - 1.0])
    assert got[[0, 1, 2, 5, 6, 7]].tolist() == want[[0, 1, 2, 5, 6, 7]].tolist()  # zeros, NaN, count, K, min, max
    np.testing.assert_allclose(got[3:5], want[3:5], rtol=1e-9)
