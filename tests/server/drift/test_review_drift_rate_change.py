"""Review of issue 26: after SetDriftFalseAlarmRate the alarm and its ratio disagree until the next window.

``WindowAlarm.set_rate`` recomputes ``threshold`` from the saved null, so ``reading().ratio`` (and
``layertap_activation_drift_ratio``, whose HELP says "the alarm is raised above 1") uses the new
threshold at once, while ``alarm`` keeps the decision made at the old one. Observed: last window's
score 4.29, threshold 4.87 at 1e-4 (ratio 0.88, no alarm); after the rate goes to 0.5 the threshold is
2.69, ratio 1.59, p-value 6e-4, and ``alarm`` still False (a Grafana ratio panel over 1 with no
alert). Expected: the last completed window re-decided at the new threshold (or the ratio kept at
the threshold it was decided with).
"""

from __future__ import annotations

import math

import numpy as np

from layertap.server.drift.alarm import WindowAlarm
from layertap.server.drift.null import NullModel


def test_raising_the_rate_keeps_alarm_and_ratio_consistent() -> None:
    k, w, n = 34, 50, 500
    model = NullModel(np.zeros(k), np.ones(k), n, w, 10, 1.0, 16)
    alarm = WindowAlarm(model, 1e-4)
    alarm.limit = math.inf  # the window test alone, for a deterministic score
    x = np.random.default_rng(3).standard_normal((w, k))
    x[:, 0] += 3.6 / math.sqrt(w)
    for v in x:
        alarm.add(v)
    before = alarm.reading()
    assert before.ratio < 1 and not before.alarm
    alarm.set_rate(0.5)
    after = alarm.reading()
    assert after.alarm == (after.ratio > 1), f"ratio {after.ratio:.2f} (p {after.p_value:.1e}) but alarm {after.alarm}"
