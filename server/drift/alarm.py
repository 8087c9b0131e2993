"""The calibrated drift alarm of one layer: tumbling windows, and a CUSUM per component.

A :class:`WindowAlarm` reads each scored pass's components
(:func:`~layertap.server.drift.null.components`) on the host-transfer thread,
never in a hook. The window test is decided once per completed tumbling
window of ``W`` usable passes; the CUSUMs run on every pass and may raise the
alarm before a window completes. A raised alarm stays up until a later window
completes with neither test firing. Passes whose components are not finite
(NaN-only, empty) are left out and counted; they never complete a window.

Calibration states (``DriftScore.alarm.calibration``):

``calibrated``
    The baseline's null model is usable: thresholds follow the server's
    false-alarm rate.
``uncalibrated``
    The baseline is too short, a saved file from before calibration, or every
    feature is constant: the alarm never fires, and ``reason`` says why.
``fixed``
    SetBaseline gave explicit thresholds: the alarm is today's rule, any of
    the four pooled scores over its threshold (on the sliding window).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from layertap.server.drift.null import CUSUM_CLIP, CUSUM_K, NullModel

__all__ = ["CALIBRATED", "FIXED", "UNCALIBRATED", "AlarmReading", "WindowAlarm"]

CALIBRATED, UNCALIBRATED, FIXED = "calibrated", "uncalibrated", "fixed"


@dataclass(frozen=True)
class AlarmReading:
    """A layer's calibrated alarm as of its last scored pass.

    ``score`` is the last completed window's ``max |z|`` (NaN before the
    first); ``ratio`` is score / threshold; ``detection_passes`` the passes
    from the change's estimated start (the CUSUM's last reset, or the window's
    first pass) to the pass that raised the alarm (0 while not raised);
    ``alarm_pass`` the scored pass that raised it.
    """

    calibration: str
    reason: str = ""
    score: float = math.nan
    threshold: float = math.nan
    p_value: float = math.nan
    alarm: bool = False
    detection_passes: int = 0
    alarm_pass: int = 0
    passes: int = 0
    windows: int = 0
    ignored_passes: int = 0
    constant_features: int = 0
    false_alarm_rate: float = 0.0
    #: Fraction of the features whose own window z is past the threshold (None before a window, or without features).
    feature_fraction: float | None = None

    @property
    def ratio(self) -> float:
        if math.isnan(self.score) or not self.threshold > 0:
            return math.nan
        return self.score / self.threshold


class WindowAlarm:
    """Tumbling-window test and CUSUMs against one :class:`NullModel`; not thread-safe (host-transfer thread)."""

    def __init__(self, model: NullModel, rate: float) -> None:
        self.model = model
        k = model.mean.shape[0]
        self._sum = np.zeros(k, dtype=np.float64)
        self._wsum = 0.0
        self._n = 0
        #: Whether a CUSUM (or a moved constant) fired during the last completed window.
        self._last_fired = False
        self._up = np.zeros(model.tested, dtype=np.float64)
        self._down = np.zeros(model.tested, dtype=np.float64)
        #: Scored pass at which each CUSUM last left zero (the change's estimated start).
        self._since_up = np.ones(model.tested, dtype=np.int64)
        self._since_down = np.ones(model.tested, dtype=np.int64)
        self.passes = 0
        self.windows = 0
        self.ignored = 0
        self._alarm = False
        self._fired_in_window = False
        self._detection = 0
        self._alarm_pass = 0
        self._score = math.nan
        self._fraction: float | None = None
        self.set_rate(rate)

    def set_rate(self, rate: float) -> None:
        """Set this layer's share of the server's per-window rate; thresholds follow from the saved null.

        The last completed window is decided again at the new threshold, so that the alarm and its
        ratio (score / threshold) never disagree.
        """
        self.rate = float(rate)
        m = self.model
        self.threshold = m.threshold(self.rate) if m.calibrated else math.nan
        self.limit = m.cusum_limit(self.rate) if m.calibrated else math.nan
        if m.calibrated and self.windows and not math.isnan(self._score):
            if self._score > self.threshold:
                self._raise(m.window)
            elif not (self._last_fired or self._fired_in_window):
                self._alarm, self._detection, self._alarm_pass = False, 0, 0

    def add(self, x: npt.ArrayLike, weight: float = 1.0) -> None:
        """One scored pass's components; ``weight`` its elements (see :meth:`.NullAccumulator.add`)."""
        m = self.model
        v = np.asarray(x, dtype=np.float64).ravel()
        w = float(weight)
        if not m.calibrated:
            return
        if v.shape != m.mean.shape or not np.all(np.isfinite(v)) or not (math.isfinite(w) and w > 0):
            self.ignored += 1
            return
        self.passes += 1
        self._sum += w * v
        self._wsum += w
        self._n += 1
        if m.moved_constants(v):  # a dead unit came alive: no spread to test it against, and no need
            self._raise(1)
            self._fired_in_window = True
        z = np.clip(m.pass_z(v, w), -CUSUM_CLIP, CUSUM_CLIP)
        self._up = np.maximum(self._up + z - CUSUM_K, 0.0)
        self._down = np.maximum(self._down - z - CUSUM_K, 0.0)
        # A CUSUM at zero restarts its excursion at the next pass.
        self._since_up = np.where(self._up > 0.0, self._since_up, self.passes + 1)
        self._since_down = np.where(self._down > 0.0, self._since_down, self.passes + 1)
        over = np.concatenate((self._up, self._down)) > self.limit
        if over.any():
            since = np.concatenate((self._since_up, self._since_down))[over]
            self._raise(self.passes - int(since.min()) + 1)
            self._fired_in_window = True
            self._up[:] = 0.0
            self._down[:] = 0.0
            self._since_up[:] = self.passes + 1
            self._since_down[:] = self.passes + 1
        if self._n == m.window:
            self._complete()

    def _raise(self, detection: int) -> None:
        if not self._alarm:
            self._alarm, self._detection, self._alarm_pass = True, max(detection, 1), self.passes

    def _complete(self) -> None:
        m = self.model
        z = m.zscores(self._sum / self._wsum, self._wsum)
        self._score = float(np.max(np.abs(z))) if z.size else math.nan
        fired = bool(self._score > self.threshold)
        if m.features:
            live = m.live
            feat = np.abs(z[: int(np.count_nonzero(live[: m.features]))])
            self._fraction = float(np.mean(feat > self.threshold)) if feat.size else None
        self.windows += 1
        if fired:
            self._raise(self._n)
        elif not self._fired_in_window:
            self._alarm, self._detection, self._alarm_pass = False, 0, 0
        self._last_fired = self._fired_in_window
        self._fired_in_window = False
        self._sum[:] = 0.0
        self._wsum = 0.0
        self._n = 0

    def reading(self) -> AlarmReading:
        m = self.model
        if not m.calibrated:
            return AlarmReading(UNCALIBRATED, m.reason, ignored_passes=self.ignored, constant_features=m.constant,
                                false_alarm_rate=self.rate)
        return AlarmReading(
            CALIBRATED, "", self._score, self.threshold, m.p_value(self._score), self._alarm, self._detection,
            self._alarm_pass, self.passes, self.windows, self.ignored, m.constant, self.rate, self._fraction)
