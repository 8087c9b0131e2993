"""Review of issue 26: the window threshold's Student-t quantile on the shortest baselines that calibrate.

``MIN_WINDOWS`` is 5 and the window may be as small as 1 or 2, so a baseline of 5-10 passes is
``calibrated`` and gets ``t_quantile(p, N - 1)``. The Cornish-Fisher expansion is documented as good
for ν >= 20 only; at ν = 4..9 and the tails used (p ~ 1e-8) it is far too small: at N = 5 the
threshold is 54.9 against the exact 105.5, so the window test's real false-alarm rate is ~14x its
share. Reference: the exact t tail through the regularized incomplete beta (mpmath, float64+).
"""

from __future__ import annotations

import pytest

from layertap.server.drift.null import MIN_WINDOWS, NullAccumulator

mp = pytest.importorskip("mpmath")


def t_sf(t: float, dof: float) -> float:
    """P(T > t), Student's t on ``dof`` degrees of freedom."""
    return float(0.5 * mp.betainc(dof / 2, 0.5, 0, dof / (dof + t * t), regularized=True))


@pytest.mark.parametrize("window", [1, 2])
def test_threshold_of_a_shortest_calibrated_baseline_keeps_its_rate(window: int) -> None:
    rng = __import__("numpy").random.default_rng(0)
    acc = NullAccumulator(window)
    for _ in range(MIN_WINDOWS * window):
        acc.add(rng.standard_normal(2 * 64 + 2))
    model = acc.freeze()
    assert model.calibrated, model.reason  # a baseline of 5 or 10 passes calibrates
    rate = 1e-4 / 4
    per_component = rate / 2 / (2 * model.tested)
    real = t_sf(model.threshold(rate), model.passes - 1)
    assert real <= 1.1 * per_component, (
        f"N={model.passes}: threshold {model.threshold(rate):.2f} has tail {real:.3g}, {real / per_component:.1f}x its share")
