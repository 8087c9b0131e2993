"""Generate's token choice: the chosen token's logprob and the rows that can choose, against float64."""

from __future__ import annotations

import math

import pytest
import torch

from layertap.server.generate.request import log_normalizer

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("scale", [1.0, 30.0, 1e4, 1e6, 3e38])
def test_the_logprob_error_does_not_grow_with_the_logits(scale: float) -> None:
    logits = torch.tensor([[scale, scale, scale, -math.inf], [scale, scale / 2, 0.0, -scale]], dtype=torch.float32)
    shifted, lse, ok = log_normalizer(logits)
    got = (shifted[:, 0] - lse).double()
    want = torch.log_softmax(logits.double(), dim=-1)[:, 0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert ok.tolist() == [True, True]


def test_rows_with_nan_or_plus_inf_or_nothing_finite_cannot_choose() -> None:
    inf, nan = math.inf, math.nan
    logits = torch.tensor([[1.0, 2.0, 3.0], [nan, 1.0, 2.0], [inf, 1.0, 2.0], [-inf, -inf, -inf],
                           [-inf, 1.0, 2.0], [inf, -inf, 0.0], [3e38, 3e38, -3e38]])
    _shifted, _lse, ok = log_normalizer(logits)
    assert ok.tolist() == [True, False, False, False, True, False, True]
