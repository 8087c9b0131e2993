"""Live drift: baselines frozen from live passes, scored against a sliding window.

``SetBaseline`` creates (or replaces) one durable tap over the selected layers.
While a layer's baseline collects, the tap reports moments, min/max, a dense
set of quantiles (percentiles of a bounded sample) and per-channel means; the
percentiles of each pass stand for that pass's distribution in a weighted
reservoir (:class:`~layertap.server.drift.builder.BaselineBuilder`). After N passes
the layer's baseline freezes: histogram edges at its quantiles, saved to
``--baseline-dir``, and the tap's reducers for that layer switch to a
histogram over those frozen edges, so every later pass adds exact counts to
the sliding window that drift is scored on. Everything arrives as ordinary
``Summary`` messages on the host-transfer thread; nothing here runs in a hook.

**One baseline per phase seen.** A generation's prefill, its decode steps
and plain forwards (Infer) differ in shape and distribution (a decode step's
``(batch, 1, hidden)`` against a prefill's ``(batch, prompt, hidden)``), so
a layer has one entry per phase (``Summary.phase``), each with its own
builder, baseline, window and scores: a window is scored only against the
baseline of its own phase. SetBaseline starts every layer's forward entry
(GetDrift lists it at once, as before phases); the first sampled pass of
another phase starts that phase's entry with the same settings (passes,
window, thresholds, hold); where no phase of the layer was collecting, the
plan of that first pass had no quantiles, so collection starts with the
next. A server that only generates keeps its forward entry collecting. The
tap engine keeps one plan per layer, so it serves all phases
(:func:`~.layer.phases_reducers`): quantiles while any phase collects, and
a histogram over each frozen phase's edges; each phase is scored on the
histogram with its own edges. Each phase's baseline is its own file (schema
v2 names it; a v1 file loads as forward).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import numpy as np

from layertap.server.drift.baseline import Baseline
from layertap.server.drift.builder import BaselineBuilder
from layertap.server.drift.fleet import FleetBaselines
from layertap.server.drift.layer import SAVE_RETRY_FIRST_SECONDS, LayerEntry, layer_reducers, pass_components, phases_reducers
from layertap.server.drift.names import baseline_tap_id, check_derive, check_not_baseline_name
from layertap.server.drift.null import MAX_PASSES
from layertap.server.drift.phases import FORWARD, PHASE_NAMES
from layertap.server.drift.rates import DEFAULT_FALSE_ALARM_RATE, check_rate
from layertap.server.drift.reload import BaselineReload
from layertap.server.drift.saves import BaselineSaves
from layertap.server.drift.scores import DriftScore
from layertap.server.drift.table import LayerTable
from layertap.server.drift.tap_control import TapControl
from layertap.server.drift.thresholds import DRIFT_METRICS, DriftThresholds
from layertap.server.drift.window import SlidingWindow
from layertap.server.errors import AlreadyExists, InvalidField, NotFound
from layertap.server.host.hooks import POINT_NAMES
from layertap.server.host.model_host import PassContext
from layertap.server.limits import check_name
from layertap.server.reducers.spec import default_feature_axis
from layertap.server.stream.sinks import Sink, TapView
from layertap.server.taps.selectors import select_layers
from layertap.server.taps.tap import SERVER_OWNER
from layertap.v1 import telemetry_pb2 as pb

log = logging.getLogger("layertap.server")

#: 10 windows of the default 50: enough to calibrate the alarm (at least 5 windows).
DEFAULT_PASSES = 500


def _results(summary: pb.Summary) -> dict[str, pb.ReducerResult]:
    return {r.WhichOneof("value"): r for r in summary.results}


class ScoreListener(Protocol):
    """Told one layer's new drift in one phase: its score (None while collecting) and thresholds."""

    def __call__(self, tap: str, layer: str, point: str, score: DriftScore | None, thresholds: DriftThresholds,
                 *, phase: str) -> None: ...


class DriftMonitor(Sink, BaselineReload, FleetBaselines, BaselineSaves):
    """Owns baseline taps, their builders and windows; a sink of the tap engine.

    Its mixins: start-up reloads (:mod:`.reload`), fleet-wide baselines (:mod:`.fleet`), files (:mod:`.saves`).
    """

    def __init__(self, control: TapControl, *, on_score: ScoreListener | None = None,
                 baseline_dir: str | None = None, default_window: int = 50,
                 on_load_error: Callable[[str], None] | None = None,
                 on_save_error: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, false_alarm_rate: float = DEFAULT_FALSE_ALARM_RATE) -> None:
        """Create the monitor (a sink of the tap engine).

        Args:
            control: The tap engine, as drift may use it: baseline taps made, reshaped, removed.
            on_score: Called with every new score of a layer (and None while its
                baseline collects); the app points it at the metrics' store, so
                drift knows nothing of export.
            on_load_error: Called with each message of a baseline file refused at start-up.
            on_save_error: Called with each failed write of a frozen baseline, retries included.
            clock: Monotonic seconds, for the save retries' backoff.
            false_alarm_rate: Per-window false alarms of the calibrated alarms, split across their layers.
        """
        self.false_alarm_rate = check_rate(false_alarm_rate)
        self.control = control
        self._on_score = on_score
        self.baseline_dir = baseline_dir
        self.default_window = default_window
        self._on_load_error = on_load_error
        self._on_save_error = on_save_error
        self._clock = clock
        self._lock = threading.Lock()
        #: Serialises feeding and freezing builders (host-transfer thread) with
        #: exporting and installing them (RPC threads).
        self._build_lock = threading.Lock()
        #: Serialises reading a layer's phases and installing the plan made of them.
        self._plan_lock = threading.Lock()
        #: Serialises splitting the rate over the alarms (RPC threads and the host-transfer thread).
        self._rate_lock = threading.Lock()
        #: (tap, layer) -> phase -> entry.
        self._layers = LayerTable()
        #: Taps this monitor created (the only ones SetBaseline may replace).
        self._own: set[str] = set()
        #: Passes refused by any builder, ever: kept here because builders go
        #: away when they freeze or their tap is deleted.
        self._skipped = 0

    def _all(self) -> list[LayerEntry]:
        """Every entry, all phases (the caller holds ``_lock``)."""
        return [e for phases in self._layers.values() for e in phases.values()]

    def baseline_for(self, layer: str, point: str, phase: str = FORWARD, *, derive: int = 0) -> Baseline | None:
        """A frozen baseline of ``layer`` at ``point`` in ``phase`` (any tap): the flight recorder's mean trigger.

        Only one of ``derive`` (0: the tensor's own): an entropy baseline's mean is no reference for the tensor's.
        """
        with self._lock:
            for e in self._all():
                if (e.layer == layer and e.point == point and e.phase == phase and e.derive == derive
                        and e.baseline is not None):
                    return e.baseline
        return None

    # -- spec checks (any thread creating a tap) ---------------------------------
    def check_name(self, name: str, *, owner: str, field: str) -> None:
        """Baseline ids are this monitor's: a principal's tap may not take one, or it
        could squat the id another's SetBaseline will use. The server's own taps
        (``--taps``, this monitor's) may."""
        if owner != SERVER_OWNER:
            check_not_baseline_name(name, field)

    # -- requests ------------------------------------------------------------
    def set_baseline(self, req: pb.SetBaselineRequest) -> tuple[str, list[str]]:
        """Create (or replace) the baseline tap; returns its id and layers."""
        host = self.control.host
        layers = select_layers(req.selector, host.layer_names)
        passes = req.passes or DEFAULT_PASSES
        if passes > MAX_PASSES:
            raise InvalidField("passes", f"at most {MAX_PASSES}, got {passes}")
        window = req.window or self.default_window
        if window > MAX_PASSES:
            raise InvalidField("window", f"at most {MAX_PASSES}, got {window}")
        for name in DRIFT_METRICS:
            v = getattr(req.thresholds, name)
            if v < 0 or not math.isfinite(v):
                raise InvalidField(f"thresholds.{name}", f"must be a finite value >= 0 (0 = default), got {v}")
        point = req.point or pb.POINT_OUTPUT
        if point not in POINT_NAMES:
            raise InvalidField("point", f"unknown point {req.point}")
        if req.name:
            check_name(req.name, "name")
        check_derive(req.derive)
        tap_id = baseline_tap_id(req)
        thresholds = DriftThresholds.from_message(req.thresholds)
        fixed = any(getattr(req.thresholds, m) > 0 for m in DRIFT_METRICS)
        # A derived tensor (one value per token) has no channels.
        per_channel = not req.derive and all(self._channels(layer) is not None for layer in layers)
        spec = pb.TapSpec(name=tap_id, selector=req.selector, point=point, sampling=req.sampling,
                          reducers=layer_reducers(per_channel=per_channel), derive=req.derive)
        existing = {t.id for t in self.control.all_taps()}
        if tap_id in existing:
            if tap_id not in self._own:
                raise AlreadyExists(f"name: a tap named {tap_id!r} exists and is not a baseline; pick another name")
            self.control.delete(tap_id, reason="replaced")
        entries = {layer: LayerEntry(tap_id, layer, POINT_NAMES[point], passes, window, thresholds,
                                 builder=BaselineBuilder(tap_id, layer, POINT_NAMES[point], passes=passes, window=window),
                                 hold=req.hold, per_channel=per_channel, derive=req.derive, fixed=fixed)
                   for layer in layers}
        with self._lock:
            self._layers.update({(tap_id, layer): {FORWARD: e} for layer, e in entries.items()})
        try:
            tap = self.control.create(spec, forever=True)
        except Exception:
            with self._lock:
                for layer in layers:
                    self._layers.pop((tap_id, layer), None)
            raise
        self._own.add(tap_id)
        with self._lock:  # a phase's entry may have started from a pass since create
            for layer in layers:
                for e in self._layers.get((tap_id, layer), {}).values():
                    e.handle = tap
        for entry in entries.values():
            self._export(entry)
        log.info("baseline %s collecting %d passes over %d layer(s)", tap_id, passes, len(layers))
        return tap_id, layers

    def drift(self, selector: str = "") -> list[pb.LayerDrift]:
        """Current scores, one entry per baselined layer and phase."""
        with self._lock:
            entries = self._all()
        if selector:
            keep = set(select_layers(selector, self.control.host.layer_names))
            entries = [e for e in entries if e.layer in keep]
        return [e.drift_message() for e in entries]

    def skipped_passes(self) -> int:
        """Passes refused while collecting baselines, over every builder this monitor ran.

        Monotonic (a Prometheus counter): a steady rise means the tapped
        tensors carry no finite data and the baselines will not freeze.
        """
        return self._skipped

    # -- host-transfer thread ----------------------------------------------------
    def wants_summaries(self, tap_id: str) -> bool:
        """Only a baseline's tap: the monitor reads no other."""
        with self._lock:
            return self._layers.has_tap(tap_id)

    def on_summaries(self, ctx: PassContext, summaries: list[pb.Summary]) -> None:
        for s in summaries:
            if s.output_index != 0 or s.call_index != 0 or s.unsampled:
                continue
            phase = PHASE_NAMES.get(s.phase)
            with self._lock:
                phases = self._layers.get((s.tap, s.layer))
                entry = phases.get(phase) if phases is not None and phase is not None else None
            if phases is None or phase is None:
                continue  # not a baseline's layer, or a phase this build does not know
            res = _results(s)
            if "moments" not in res:
                continue
            if entry is None:
                with self._build_lock:
                    entry = self._add_phase(s.tap, s.layer, phase)
                if entry is None:
                    continue
            if entry.baseline is None and entry.builder is not None:
                with self._build_lock:
                    if entry.builder is not None:  # an install may have landed meanwhile
                        self._collect(entry, res)
            elif entry.observe(res, s):
                self._export(entry)

    def _add_phase(self, tap: str, layer: str, phase: str, *, replan: bool = True) -> LayerEntry | None:
        """The entry of ``phase`` on a baseline's layer, started (collecting) if this is the phase's first pass.

        None when the tap went meanwhile. The caller holds ``_build_lock``.
        """
        with self._lock:
            phases = self._layers.get((tap, layer))
            if phases is None:
                return None
            entry = phases.get(phase)
            if entry is not None:
                return entry
            entry = phases[phase] = next(iter(phases.values())).sibling(phase)
        if replan:
            if not self._replan(entry):
                return None
            log.info("baseline %s/%s: first %s pass, collecting %d", tap, layer, phase, entry.passes)
        self._export(entry)
        return entry

    def _collect(self, entry: LayerEntry, res: dict[str, pb.ReducerResult]) -> None:
        if "quantiles" not in res:
            return
        m, q = res["moments"].moments, res["quantiles"].quantiles
        mm = res["minmax"].minmax if "minmax" in res else None
        pc = res["per_channel"].per_channel if "per_channel" in res else None
        builder = entry.builder
        assert builder is not None
        if entry.hold and builder.done:
            return  # held at exactly ``passes`` for ExportBaseline
        values = np.asarray(q.values, dtype=np.float64)
        before = builder.skipped_passes
        if m.count == 0 or not np.isfinite(values).all():
            builder.skip()
        else:
            builder.feed(values, m.count, m.mean, m.std, mm.min if mm else math.nan, mm.max if mm else math.nan,
                         population=m.count,
                         channel_mean=np.asarray(pc.mean) if pc and pc.channels == len(pc.mean) else None,
                         channel_std=np.asarray(pc.std) if pc and pc.channels == len(pc.std) else None,
                         components=pass_components(res))
        # Only this (host-transfer) thread writes the total; readers see an int.
        self._skipped += builder.skipped_passes - before
        if builder.done and not entry.hold:
            self._freeze(entry, builder.freeze(window=entry.window_len, thresholds=entry.thresholds, fixed=entry.fixed,
                                               derive=entry.derive))

    def _live(self, entry: LayerEntry) -> bool:
        """Whether ``entry`` is still its layer's entry for its phase (the caller holds ``_lock``)."""
        return self._layers.get((entry.tap, entry.layer), {}).get(entry.phase) is entry

    def _freeze(self, entry: LayerEntry, baseline: Baseline) -> bool:
        """Make ``baseline`` the layer's reference: save it, then switch the tap to its edges.

        Returns False when the layer's tap was deleted or replaced meanwhile.
        """
        with self._lock:
            # A DeleteTap (or a replacing SetBaseline) may have landed since this
            # summary was read: then freeze nothing and save nothing, or the
            # deleted baseline would come back at the next start. Saved under
            # the lock, with ``entry.baseline`` set, so that a removal that comes
            # after this sees the file and deletes it.
            if not self._live(entry):
                return False
            entry.baseline = baseline
            entry.retry_delay = SAVE_RETRY_FIRST_SECONDS
            self._save(entry)
        if not self._install(entry, baseline):
            return False
        log.info("baseline %s/%s (%s) frozen after %d passes", entry.tap, entry.layer, entry.phase, baseline.passes)
        return True

    def _install(self, entry: LayerEntry, baseline: Baseline) -> bool:
        """Switch the layer to the frozen edges; False when its tap went meanwhile."""
        entry.baseline = baseline
        entry.builder = None
        entry.window = SlidingWindow.for_baseline(baseline, entry.window_len)
        entry.edge_list = baseline.edges.tolist()
        entry.arm(baseline, self.false_alarm_rate)
        self._rebalance()
        if not self._replan(entry):
            return False
        self._export(entry)
        return True

    def set_false_alarm_rate(self, rate: float) -> int:
        """Set the server-wide per-window rate (SetDriftFalseAlarmRate); returns the calibrated layers it is split across.

        Every calibrated alarm's thresholds are recomputed from its saved null statistics: no new passes.
        """
        with self._rate_lock:
            self.false_alarm_rate = check_rate(rate)
        return self._rebalance()

    def _rebalance(self) -> int:
        """Split the rate evenly (Bonferroni) over the calibrated layers; returns how many.

        Under ``_rate_lock``: a freeze (host-transfer thread) and a rate change (RPC thread) at once
        must not leave layers with the shares of two different splits.
        """
        with self._rate_lock:
            with self._lock:
                armed = [e for e in self._all() if e.calibrated and e.alarm is not None]
            for e in armed:
                assert e.alarm is not None
                e.alarm.set_rate(self.false_alarm_rate / len(armed))
                if e.score is not None:  # the exported ratio follows at once, not at the next pass
                    e.score = replace(e.score, alarm=e.alarm.reading())
                    self._export(e)
            return len(armed)

    def _replan(self, entry: LayerEntry) -> bool:
        """Give ``entry``'s layer the reducers all its phases need now; False when its tap went meanwhile."""
        with self._plan_lock:
            with self._lock:
                phases = list(self._layers.get((entry.tap, entry.layer), {}).values())
            try:
                self.control.set_layer_reducers(entry.tap, entry.layer, phases_reducers(phases), tap=entry.handle)
            except NotFound:  # deleted or replaced: on_tap_removed forgot the entry and its file
                return False
        return True

    def _export(self, entry: LayerEntry) -> None:
        if self._on_score is not None:
            self._on_score(entry.tap, entry.layer, entry.point, entry.score, entry.thresholds, phase=entry.phase)

    def on_tap_removed(self, tap: TapView, reason: str) -> None:
        if not tap.durable:
            return
        with self._lock:
            self._own.discard(tap.id)
            gone = [e for k in [k for k in self._layers if k[0] == tap.id] for e in self._layers.pop(k).values()]
        self._rebalance()
        self._remove_files(gone)  # a deleted (or replaced) baseline must not come back at the next start

    def _channels(self, layer: str) -> int | None:
        shapes = self.control.host.layer_shapes.get(layer)
        if shapes is None or not shapes.outputs or len(shapes.outputs[0]) < 2:
            return None
        shape = shapes.outputs[0]
        return int(shape[default_feature_axis(len(shape), tokens=self.control.token_model)])
