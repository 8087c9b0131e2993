"""Review of issue 26: a tiny positive false-alarm rate passes ``check_rate`` and breaks every later freeze.

``check_rate`` accepts any finite rate in (0, 0.5]. At 1e-300 the per-pass CUSUM share is ~1e-306,
``cusum_limit(1 / per_pass)`` overflows ``math.exp`` (OverflowError; 5e-324 gives StatisticsError in
the t quantile). SetDriftFalseAlarmRate answers OK, the server keeps the rate, and the next baseline
that freezes raises in ``_install`` on the host-transfer thread after its file was saved: the layer
shows ``ready`` with an empty calibration, no threshold, and never scores a pass. With calibrated
layers present the RPC itself fails (UNKNOWN) after the rate and some layers' shares were changed.
Expected: such a rate refused with INVALID_ARGUMENT (or clamped), and freezes that never raise.
"""

from __future__ import annotations

import numpy as np
import pytest

import layertap
from layertap import InvalidArgument


@pytest.mark.timeout(300)
def test_a_tiny_rate_is_refused_or_leaves_later_baselines_working(make_server) -> None:
    srv = make_server()
    rng = np.random.default_rng(0)
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        try:
            client.baselines.set_false_alarm_rate(1e-300)
        except InvalidArgument:
            return  # refused: fine
        client.set_baseline("layer1", passes=10, window=2)
        for _ in range(16):
            client.infer(rng.standard_normal((2, 3, 32, 32)).astype(np.float32))
        assert srv.state.taps.flush(20)
        (d,) = client.drift()
        assert d.state == "ready"
        assert d.calibration == "calibrated" and d.scored_passes > 0, (
            f"calibration={d.calibration!r} threshold={d.threshold} scored_passes={d.scored_passes}")
