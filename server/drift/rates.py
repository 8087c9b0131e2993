"""The server-wide false-alarm rate of calibrated drift alarms (``serve --drift-false-alarm-rate``).

Per window, over every calibrated layer together: each layer gets
``rate / layers`` (Bonferroni), re-split whenever a baseline freezes or goes,
and changed at run time by SetDriftFalseAlarmRate (SCOPE_ADMIN).
"""

from __future__ import annotations

import math

from layertap.server.errors import InvalidField

__all__ = ["DEFAULT_FALSE_ALARM_RATE", "MAX_FALSE_ALARM_RATE", "MIN_FALSE_ALARM_RATE", "check_rate"]

#: Expected false alarms per window, all layers together: 0.01 over 100 windows.
DEFAULT_FALSE_ALARM_RATE = 1e-4
MAX_FALSE_ALARM_RATE = 0.5
#: Below this the thresholds' tail probabilities (rate / layers / window / components) leave float range.
MIN_FALSE_ALARM_RATE = 1e-12


def check_rate(rate: float, field: str = "rate") -> float:
    """``rate`` as a float in [1e-12, 0.5]; InvalidField (naming ``field``) otherwise."""
    r = float(rate)
    if not (math.isfinite(r) and MIN_FALSE_ALARM_RATE <= r <= MAX_FALSE_ALARM_RATE):
        raise InvalidField(field, f"a false-alarm rate per window must be in [{MIN_FALSE_ALARM_RATE:g}, "
                                  f"{MAX_FALSE_ALARM_RATE}], got {rate!r}")
    return r
