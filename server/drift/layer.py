"""One layer of a baseline tap in one phase: its entry (collecting, frozen, saved or not) and the reducers its tap runs."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np

from layertap.server.drift.alarm import CALIBRATED, FIXED, UNCALIBRATED, AlarmReading, WindowAlarm
from layertap.server.drift.baseline import Baseline
from layertap.server.drift.builder import BaselineBuilder
from layertap.server.drift.exchange import builder_state_to_proto, frozen_to_bytes
from layertap.server.drift.files import save_baseline
from layertap.server.drift.null import NullModel, components
from layertap.server.drift.phases import FORWARD, PHASE_BY_NAME
from layertap.server.drift.scores import DriftScore
from layertap.server.drift.thresholds import DRIFT_METRICS, DriftThresholds
from layertap.server.drift.window import SlidingWindow
from layertap.server.host.hooks import POINT_BY_NAME
from layertap.server.taps.tap import Tap
from layertap.v1 import telemetry_pb2 as pb

log = logging.getLogger("layertap.server")

__all__ = ["COLLECT_PROBABILITIES", "SAVE_RETRY_FIRST_SECONDS", "SAVE_RETRY_MAX_SECONDS", "LayerEntry",
           "layer_reducers", "pass_components", "phases_reducers"]

_CALIBRATION = {CALIBRATED: pb.DRIFT_CALIBRATION_CALIBRATED, UNCALIBRATED: pb.DRIFT_CALIBRATION_UNCALIBRATED,
                FIXED: pb.DRIFT_CALIBRATION_FIXED}
#: The reason of a baseline loaded from a file written before calibration.
OLD_FILE = ("saved by an older layertap without null statistics (baseline schema v1/v2): "
            "set the baseline again to calibrate its alarm")


def pass_components(res: dict[str, pb.ReducerResult]) -> np.ndarray | None:
    """A pass's components for the null model and the alarm (:func:`.null.components`); None without moments.

    Per-feature statistics are the ``per_channel`` reducer's, computed on the
    device in the tap's one reducer pass: past ``max_channels`` (4096) only
    the first features are reported and tested; the rest count in the pooled
    mean and std (and are not tested one by one).

    The spread components are each feature's (and the pooled) **mean of
    squares**, ``std² + mean²`` of the reducers' population moments: a mean
    over the pass's elements like the mean, so its expectation does not depend
    on the batch size. The population std does: over the few elements of one
    image's 2x2 map it misses the spread between images, and a batch-1 pass
    reads smaller stds than a batch-8 one (a false alarm on batch size alone).
    The pass's weight for the null model is its element count (``moments.count``).
    """
    if "moments" not in res:
        return None
    m = res["moments"].moments
    if m.count == 0:
        return np.array([np.nan, np.nan])
    pc = res["per_channel"].per_channel if "per_channel" in res else None
    square = m.std * m.std + m.mean * m.mean
    if pc is None or not len(pc.mean) or len(pc.std) != len(pc.mean):
        return components(m.mean, square)
    fm, fs = np.asarray(pc.mean, dtype=np.float64), np.asarray(pc.std, dtype=np.float64)
    return components(m.mean, square, fm, fs * fs + fm * fm)

#: Percentiles reported per pass while a baseline collects.
COLLECT_PROBABILITIES = tuple(round(i / 100, 2) for i in range(1, 100))
#: Backoff of the retries of a baseline file that could not be written: the
#: first retry after the first delay, doubling up to the cap (a full disk is
#: usually freed in minutes, and each try costs a write of the whole document).
SAVE_RETRY_FIRST_SECONDS = 1.0
SAVE_RETRY_MAX_SECONDS = 60.0


def layer_reducers(*, per_channel: bool, edges: Iterable[np.ndarray] = (), collect: bool = True) -> list[pb.ReducerSpec]:
    """The reducers of one layer of a baseline tap.

    Args:
        per_channel: Per-channel means (the channel drift fraction).
        edges: One histogram per frozen baseline's edges (equal edges once).
        collect: Dense quantiles, for the builders still collecting.
    """
    specs = [pb.ReducerSpec(kind=pb.REDUCER_KIND_MOMENTS), pb.ReducerSpec(kind=pb.REDUCER_KIND_MINMAX),
             pb.ReducerSpec(kind=pb.REDUCER_KIND_NONFINITE)]
    if collect:
        specs.append(pb.ReducerSpec(kind=pb.REDUCER_KIND_QUANTILES,
                                    quantiles=pb.QuantileParams(probabilities=COLLECT_PROBABILITIES)))
    seen: set[tuple[float, ...]] = set()
    for e in edges:
        key = tuple(float(x) for x in e)
        if key not in seen:  # a plan refuses a duplicate reducer
            seen.add(key)
            specs.append(pb.ReducerSpec(kind=pb.REDUCER_KIND_HISTOGRAM, histogram=pb.HistogramParams(edges=key)))
    if per_channel:
        # No dim: the model's feature axis (hidden units of a token model, channels of a map).
        specs.append(pb.ReducerSpec(kind=pb.REDUCER_KIND_PER_CHANNEL, per_channel=pb.PerChannelParams()))
    return specs


def _features(b: Baseline) -> bool:
    """Whether a frozen baseline reads per-feature statistics: its channel means, or its null's features
    (a layer past ``max_channels`` keeps no channel means but tests its first features)."""
    return b.channel_mean is not None or (b.null is not None and b.null.features > 0)


def phases_reducers(entries: Iterable[LayerEntry]) -> list[pb.ReducerSpec]:
    """The reducers one layer runs for the baselines of all its phases (one tap plan serves every pass).

    Quantiles while any phase collects, and a histogram over each frozen
    phase's edges (forward, prefill, decode order), so each phase's passes
    carry the counts on its own edges; drift reads the histogram whose edges
    are its baseline's. An entry being reloaded (neither builder nor
    baseline yet) asks for nothing.
    """
    entries = sorted(entries, key=lambda e: PHASE_BY_NAME[e.phase])
    per_channel = any(_features(e.baseline) if e.baseline is not None else e.per_channel for e in entries)
    return layer_reducers(per_channel=per_channel, edges=[e.baseline.edges for e in entries if e.baseline is not None],
                          collect=any(e.builder is not None for e in entries))


@dataclass
class LayerEntry:
    """One layer of a baseline tap in one phase: collecting, then frozen and scored; its file saved or not."""

    tap: str
    layer: str
    point: str
    passes: int
    window_len: int
    thresholds: DriftThresholds
    builder: BaselineBuilder | None = None
    baseline: Baseline | None = None
    window: SlidingWindow | None = None
    score: DriftScore | None = None
    #: The tap this entry was made for: a replacement under the same id is another tap.
    handle: Tap | None = None
    #: Collect ``passes`` and wait for :meth:`DriftMonitor.install` instead of freezing.
    hold: bool = False
    #: Why the frozen baseline's file could not be written ("" when saved, or
    #: when there is no ``--baseline-dir``): the layer is UNSAVED until a retry works.
    save_error: str = ""
    #: Monotonic time of the next save retry, and the delay after that one.
    retry_at: float = 0.0
    retry_delay: float = SAVE_RETRY_FIRST_SECONDS
    #: The passes it collects and scores (``"forward"``, ``"prefill"``, ``"decode"``).
    phase: str = FORWARD
    #: Whether the tap reports per-channel means for this layer while it collects.
    per_channel: bool = False
    #: The frozen edges as floats, to pick this phase's histogram out of a summary.
    edge_list: list[float] | None = None
    #: What the tap reads of the tensor (``pb.Derive``; 0: the tensor itself).
    derive: int = 0
    #: Explicit thresholds decide the alarm (SetBaseline gave some).
    fixed: bool = False
    #: The calibrated alarm, once frozen (uncalibrated ones never fire).
    alarm: WindowAlarm | None = None

    def arm(self, baseline: Baseline, rate: float) -> None:
        """The alarm of a newly frozen (or reloaded) baseline, at this layer's share of the rate."""
        null = baseline.null if baseline.null is not None else NullModel.uncalibrated(OLD_FILE, baseline.window)
        self.fixed = baseline.fixed
        if baseline.fixed:
            self.alarm = None
            return
        try:
            self.alarm = WindowAlarm(null, rate)
        except (ArithmeticError, ValueError) as exc:  # never a ready layer without an alarm
            log.error("baseline %s/%s (%s): cannot calibrate its alarm: %s", self.tap, self.layer, self.phase, exc)
            self.alarm = WindowAlarm(NullModel.uncalibrated(f"cannot set the alarm's thresholds: {exc}"[:500],
                                                            null.window), rate)

    @property
    def calibrated(self) -> bool:
        return self.alarm is not None and self.alarm.model.calibrated

    def save(self, baseline_dir: str | None, now: float) -> bool:
        """Write the baseline's file; on failure mark the entry UNSAVED, with its next retry's time.

        Why not refuse the baseline: it is valid and scores drift now; only
        its survival of a restart is at risk, which the state, the error and
        ``layertap_baselines_unsaved`` say until a retry writes it.
        """
        assert self.baseline is not None
        if not baseline_dir:
            self.save_error = ""
            return True
        try:
            save_baseline(baseline_dir, self.baseline)
        except OSError as exc:
            first = not self.save_error
            self.save_error = f"cannot write baseline file to {baseline_dir}: {exc}"
            self.retry_at = now + self.retry_delay
            (log.error if first else log.warning)("baseline %s/%s (%s) unsaved (retry in %.0f s): %s",
                                                  self.tap, self.layer, self.phase, self.retry_delay, exc)
            self.retry_delay = min(self.retry_delay * 2, SAVE_RETRY_MAX_SECONDS)
            return False
        if self.save_error:
            log.info("baseline %s/%s (%s) saved after earlier failures", self.tap, self.layer, self.phase)
        self.save_error = ""
        self.retry_delay = SAVE_RETRY_FIRST_SECONDS
        return True

    def observe(self, res: dict[str, pb.ReducerResult], summary: pb.Summary) -> bool:
        """Add a pass of this phase to the window and score it; False when there is nothing to score.

        The pass's histogram is the one on this phase's own edges (the layer
        runs one per frozen phase); a pass computed before the edges froze has none.
        """
        baseline, window = self.baseline, self.window
        if baseline is None or window is None:
            return False
        hist = next((r.histogram for r in summary.results
                     if r.WhichOneof("value") == "histogram" and list(r.histogram.edges) == self.edge_list), None)
        if hist is None:
            return False
        m = res["moments"].moments
        mm = res["minmax"].minmax if "minmax" in res else None
        pc = res["per_channel"].per_channel if "per_channel" in res else None
        chan = None
        if pc is not None and baseline.channel_mean is not None and len(pc.mean) == len(baseline.channel_mean):
            chan = np.asarray(pc.mean, dtype=np.float64)
        window.add(np.asarray(hist.counts, dtype=np.int64), m.count, m.mean, m.std,
                   mm.min if mm else math.nan, mm.max if mm else math.nan, channel_mean=chan)
        score = window.score(baseline, self.thresholds)
        assert score is not None
        if self.alarm is None:
            reading = AlarmReading(FIXED, alarm=any(score.flags.values()))
        else:
            x = pass_components(res)
            self.alarm.add(np.array([np.nan]) if x is None else x, weight=float(m.count) or 1.0)
            reading = self.alarm.reading()
            if self.alarm.model.calibrated:  # rebuilt on the per-feature test: features past the threshold
                score = replace(score, channel_drift_fraction=reading.feature_fraction)
        self.score = replace(score, alarm=reading)
        return True

    def drift_message(self) -> pb.LayerDrift:
        """GetDrift's entry: state, thresholds, and the scores (NaN while collecting or with an empty window, never 0.0)."""
        b, s = self.baseline, self.score
        msg = pb.LayerDrift(
            tap=self.tap, layer=self.layer, point=POINT_BY_NAME[self.point], state=self.state,
            save_error=self.save_error, baseline_passes=b.passes if b else (self.builder.passes if self.builder else 0),
            thresholds=pb.DriftThresholds(**self.thresholds.as_dict()), channel_drift_fraction=-1.0,
        )
        msg.phase = PHASE_BY_NAME[self.phase]  # type: ignore[assignment]
        msg.derive = self.derive  # type: ignore[assignment]
        for metric, value in (dict.fromkeys(DRIFT_METRICS, math.nan) if s is None else s.as_dict()).items():
            setattr(msg, metric, value)
        if s is not None:
            msg.window_passes = s.window_passes
            msg.drifted = s.drifted
            if s.channel_drift_fraction is not None:
                msg.channel_drift_fraction = s.channel_drift_fraction
        # The alarm's own reading: a rate changed since the last pass shows at once.
        a = self.alarm.reading() if self.alarm is not None else s.alarm if s is not None else None
        if a is None and b is not None and self.fixed:
            a = AlarmReading(FIXED)
        msg.score, msg.threshold, msg.p_value = math.nan, math.nan, math.nan
        if a is not None:
            msg.calibration = _CALIBRATION[a.calibration]  # type: ignore[assignment]
            msg.calibration_reason, msg.alarm = a.reason, a.alarm
            msg.score, msg.threshold, msg.p_value = a.score, a.threshold, a.p_value
            msg.detection_passes, msg.alarm_pass, msg.scored_passes = a.detection_passes, a.alarm_pass, a.passes
            msg.windows, msg.ignored_passes, msg.constant_features = a.windows, a.ignored_passes, a.constant_features
            msg.false_alarm_rate = a.false_alarm_rate
        return msg

    def export_message(self) -> pb.LayerBaseline | None:
        """ExportBaseline's entry: the builder's state, or the frozen document.

        None while being reloaded at start-up.
        """
        msg = pb.LayerBaseline(layer=self.layer, point=POINT_BY_NAME[self.point], phase=PHASE_BY_NAME[self.phase])
        if self.baseline is not None:
            msg.state, msg.frozen = self.state, frozen_to_bytes(self.baseline)
        elif self.builder is not None:
            msg.state = pb.BASELINE_STATE_COLLECTING
            msg.builder.CopyFrom(builder_state_to_proto(self.builder.state()))
        else:
            return None
        return msg

    def sibling(self, phase: str) -> LayerEntry:
        """A fresh entry of the same layer and settings for passes of ``phase``, collecting."""
        return LayerEntry(self.tap, self.layer, self.point, self.passes, self.window_len, self.thresholds,
                          builder=BaselineBuilder(self.tap, self.layer, self.point, passes=self.passes, phase=phase,
                                                  window=self.window_len),
                          handle=self.handle, hold=self.hold, phase=phase, per_channel=self.per_channel,
                          derive=self.derive, fixed=self.fixed)

    @property
    def state(self) -> pb.BaselineState.ValueType:
        if self.baseline is None:
            return pb.BASELINE_STATE_COLLECTING
        return pb.BASELINE_STATE_UNSAVED if self.save_error else pb.BASELINE_STATE_READY

