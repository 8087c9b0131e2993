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
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from layertap.server.drift.baseline import Baseline
from layertap.server.drift.builder import BaselineBuilder, BuilderState
from layertap.server.drift.exchange import (
    builder_state_from_proto,
    builder_state_to_proto,
    frozen_from_bytes,
    frozen_to_bytes,
    merge_states,
)
from layertap.server.drift.files import baseline_filename, load_baselines, save_baseline
from layertap.server.drift.layer import SAVE_RETRY_FIRST_SECONDS, SAVE_RETRY_MAX_SECONDS, LayerEntry, layer_reducers
from layertap.server.drift.names import baseline_tap_id, check_not_baseline_name
from layertap.server.drift.scores import DriftScore
from layertap.server.drift.thresholds import DRIFT_METRICS, DriftThresholds
from layertap.server.drift.window import SlidingWindow
from layertap.server.errors import AlreadyExists, InvalidField, NotFound, Unsupported
from layertap.server.host.hooks import POINT_BY_NAME, POINT_NAMES
from layertap.server.host.model_host import PassContext
from layertap.server.limits import check_name
from layertap.server.reducers.spec import default_feature_axis
from layertap.server.stream.sinks import Sink, TapView
from layertap.server.taps.engine import TapEngine
from layertap.server.taps.selectors import select_layers
from layertap.server.taps.tap import SERVER_OWNER
from layertap.v1 import telemetry_pb2 as pb

log = logging.getLogger("layertap.server")

DEFAULT_PASSES = 100
MAX_PASSES = 100_000


def _results(summary: pb.Summary) -> dict[str, pb.ReducerResult]:
    return {r.WhichOneof("value"): r for r in summary.results}

#: ``(tap, layer, point name, score or None, thresholds)``: one layer's new drift.
ScoreListener = Callable[[str, str, str, DriftScore | None, DriftThresholds], None]


class DriftMonitor(Sink):
    """Owns baseline taps, their builders and windows; a sink of the tap engine."""

    def __init__(self, engine: TapEngine, *, on_score: ScoreListener | None = None,
                 baseline_dir: str | None = None, default_window: int = 50,
                 on_load_error: Callable[[str], None] | None = None,
                 on_save_error: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Create the monitor (a sink of ``engine``).

        Args:
            on_score: Called with every new score of a layer (and None while its
                baseline collects); the app points it at the metrics' store, so
                drift knows nothing of export.
            on_load_error: Called with each message of a baseline file refused at start-up.
            on_save_error: Called with each failed write of a frozen baseline, retries included.
            clock: Monotonic seconds, for the save retries' backoff.
        """
        self.engine = engine
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
        self._layers: dict[tuple[str, str], LayerEntry] = {}
        #: Taps this monitor created (the only ones SetBaseline may replace).
        self._own: set[str] = set()
        #: Passes refused by any builder, ever: kept here because builders go
        #: away when they freeze or their tap is deleted.
        self._skipped = 0

    def baseline_for(self, layer: str, point: str) -> Baseline | None:
        """A frozen baseline of ``layer`` at ``point`` (any tap): the flight recorder's mean trigger."""
        with self._lock:
            for e in self._layers.values():
                if e.layer == layer and e.point == point and e.baseline is not None:
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
        host = self.engine.host
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
        tap_id = baseline_tap_id(req)
        thresholds = DriftThresholds.from_message(req.thresholds)
        per_channel = all(self._channels(layer) is not None for layer in layers)
        spec = pb.TapSpec(name=tap_id, selector=req.selector, point=point, sampling=req.sampling,
                          reducers=layer_reducers(per_channel=per_channel, edges=None))
        existing = {t.id for t in self.engine.all_taps()}
        if tap_id in existing:
            if tap_id not in self._own:
                raise AlreadyExists(f"name: a tap named {tap_id!r} exists and is not a baseline; pick another name")
            self.engine.delete(tap_id, reason="replaced")
        entries = {layer: LayerEntry(tap_id, layer, POINT_NAMES[point], passes, window, thresholds,
                                 builder=BaselineBuilder(tap_id, layer, POINT_NAMES[point], passes=passes),
                                 hold=req.hold)
                   for layer in layers}
        with self._lock:
            self._layers.update({(tap_id, layer): e for layer, e in entries.items()})
        try:
            tap = self.engine.create(spec, forever=True)
        except Exception:
            with self._lock:
                for layer in layers:
                    self._layers.pop((tap_id, layer), None)
            raise
        self._own.add(tap_id)
        for entry in entries.values():
            entry.handle = tap
            self._export(entry)
        log.info("baseline %s collecting %d passes over %d layer(s)", tap_id, passes, len(layers))
        return tap_id, layers

    def drift(self, selector: str = "") -> list[pb.LayerDrift]:
        """Current scores, one entry per baselined layer."""
        with self._lock:
            entries = list(self._layers.values())
        if selector:
            keep = set(select_layers(selector, self.engine.host.layer_names))
            entries = [e for e in entries if e.layer in keep]
        out = []
        for e in entries:
            msg = pb.LayerDrift(
                tap=e.tap, layer=e.layer, point=POINT_BY_NAME[e.point],
                state=e.state, save_error=e.save_error,
                baseline_passes=e.baseline.passes if e.baseline else (e.builder.passes if e.builder else 0),
                thresholds=pb.DriftThresholds(**e.thresholds.as_dict()),
                channel_drift_fraction=-1.0,
            )
            s = e.score
            # Collecting, or an empty window: no score yet (NaN, never 0.0).
            for metric, value in (dict.fromkeys(DRIFT_METRICS, math.nan) if s is None else s.as_dict()).items():
                setattr(msg, metric, value)
            if s is not None:
                msg.window_passes = s.window_passes
                msg.drifted = s.drifted
                if s.channel_drift_fraction is not None:
                    msg.channel_drift_fraction = s.channel_drift_fraction
            out.append(msg)
        return out

    # -- fleet-wide baselines (see ``exchange``) -----------------------------
    def _entries(self, tap: str) -> dict[str, LayerEntry]:
        with self._lock:
            entries = {e.layer: e for e in self._layers.values() if e.tap == tap}
        if not entries:
            raise NotFound(f"tap: no baseline tap {tap!r}; SetBaseline returns its id", field="tap")
        return entries

    def export(self, tap: str) -> list[pb.LayerBaseline]:
        """Each layer of baseline ``tap``: its builder's state, or its frozen document."""
        out = []
        with self._build_lock:
            for e in self._entries(tap).values():
                msg = pb.LayerBaseline(layer=e.layer, point=POINT_BY_NAME[e.point])
                if e.baseline is not None:
                    msg.state, msg.frozen = e.state, frozen_to_bytes(e.baseline)
                elif e.builder is not None:
                    msg.state = pb.BASELINE_STATE_COLLECTING
                    msg.builder.CopyFrom(builder_state_to_proto(e.builder.state()))
                else:
                    continue  # being reloaded at start-up
                out.append(msg)
        return out

    def install(self, req: pb.InstallBaselineRequest) -> list[Baseline]:
        """Freeze the merged ``req.builders`` (or take ``req.frozen``) as the reference of ``req.tap``'s layers.

        Every baseline is checked before any is installed, so a refusal changes nothing.

        Raises:
            InvalidField: A malformed state or document, or a layer or point the tap does not have.
            NotFound: No such baseline tap.
            Unsupported: Merged builders that hold no data yet.
        """
        if bool(req.builders) == bool(req.frozen):
            raise InvalidField("builders", "give exported builders or frozen documents (exactly one of the two)")
        entries = self._entries(req.tap)
        baselines: dict[str, Baseline] = {}
        if req.builders:
            groups: dict[str, list[BuilderState]] = {}
            for i, msg in enumerate(req.builders):
                state = builder_state_from_proto(msg, f"builders[{i}]")
                self._check_layer(entries, state.layer, state.point, f"builders[{i}]")
                groups.setdefault(state.layer, []).append(state)
            for layer, states in groups.items():
                e = entries[layer]
                try:
                    baselines[layer] = merge_states(req.tap, states).freeze(window=e.window_len, thresholds=e.thresholds)
                except ValueError as exc:
                    raise Unsupported(f"builders: {exc}; collect more passes first", field="builders") from None
        else:
            known = {name: self._channels(name) for name in self.engine.host.layer_names}
            for i, data in enumerate(req.frozen):
                b = frozen_from_bytes(data, f"frozen[{i}]", known)
                self._check_layer(entries, b.layer, b.point, f"frozen[{i}]")
                if b.layer in baselines:
                    raise InvalidField(f"frozen[{i}]", f"a second document for layer {b.layer!r}")
                e = entries[b.layer]
                baselines[b.layer] = replace(b, tap=req.tap, window=e.window_len, thresholds=e.thresholds)
        with self._build_lock:
            for layer, b in baselines.items():
                if not self._freeze(entries[layer], b):
                    raise NotFound(f"tap: baseline tap {req.tap!r} was deleted or replaced meanwhile", field="tap")
        return list(baselines.values())

    @staticmethod
    def _check_layer(entries: dict[str, LayerEntry], layer: str, point: str, field: str) -> None:
        if layer not in entries:
            raise InvalidField(f"{field}.layer", f"{layer!r} is not a layer of this baseline tap ({', '.join(entries)})")
        if entries[layer].point != point:
            raise InvalidField(f"{field}.point", f"{point!r}, but the tap reads {layer!r} at {entries[layer].point!r}")

    def skipped_passes(self) -> int:
        """Passes refused while collecting baselines, over every builder this monitor ran.

        Monotonic (a Prometheus counter): a steady rise means the tapped
        tensors carry no finite data and the baselines will not freeze.
        """
        return self._skipped

    # -- start-up ------------------------------------------------------------
    def load(self) -> int:
        """Reload saved baselines and recreate their taps; returns how many."""
        if not self.baseline_dir:
            return 0
        known = {name: self._channels(name) for name in self.engine.host.layer_names}
        baselines, errors = load_baselines(self.baseline_dir, known)
        for err in errors:
            log.error("baseline refused: %s", err)
            if self._on_load_error is not None:
                self._on_load_error(err)
        by_tap: dict[tuple[str, str], list[Baseline]] = {}
        for b in baselines:
            by_tap.setdefault((b.tap, b.point), []).append(b)
        loaded = 0
        for (tap_id, point), group in by_tap.items():
            selector = "re:" + "|".join(re.escape(b.layer) for b in group)
            per_channel = all(b.channel_mean is not None for b in group)
            spec = pb.TapSpec(name=tap_id, selector=selector, point=POINT_BY_NAME[point],
                              reducers=layer_reducers(per_channel=per_channel, edges=None))
            with self._lock:
                for b in group:
                    self._layers[(tap_id, b.layer)] = LayerEntry(tap_id, b.layer, point, b.passes, b.window, b.thresholds)
            try:
                tap = self.engine.create(spec, forever=True, trusted_selector=True)
                self._own.add(tap_id)
            except Exception as exc:  # noqa: BLE001 - one bad group must not stop start-up
                msg = f"{tap_id}: cannot recreate its tap: {exc}"
                log.error("baseline refused: %s", msg)
                if self._on_load_error is not None:
                    self._on_load_error(msg)
                with self._lock:
                    for b in group:
                        self._layers.pop((tap_id, b.layer), None)
                continue
            for b in group:
                entry = self._layers[(tap_id, b.layer)]
                entry.handle = tap
                if self._install(entry, b):
                    loaded += 1
        if loaded:
            log.info("reloaded %d baseline(s) from %s", loaded, self.baseline_dir)
        return loaded

    # -- host-transfer thread ----------------------------------------------------
    def on_summaries(self, ctx: PassContext, summaries: list[pb.Summary]) -> None:
        for s in summaries:
            if s.output_index != 0 or s.call_index != 0 or s.unsampled:
                continue
            with self._lock:
                entry = self._layers.get((s.tap, s.layer))
            if entry is None:
                continue
            res = _results(s)
            if "moments" not in res:
                continue
            if entry.baseline is None and entry.builder is not None:
                with self._build_lock:
                    if entry.builder is not None:  # an install may have landed meanwhile
                        self._collect(entry, res)
            elif entry.baseline is not None and entry.window is not None:
                self._observe(entry, res)

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
                         channel_std=np.asarray(pc.std) if pc and pc.channels == len(pc.std) else None)
        # Only this (host-transfer) thread writes the total; readers see an int.
        self._skipped += builder.skipped_passes - before
        if builder.done and not entry.hold:
            self._freeze(entry, builder.freeze(window=entry.window_len, thresholds=entry.thresholds))

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
            key = (entry.tap, entry.layer)
            if key not in self._layers or self._layers[key] is not entry:
                return False
            entry.baseline = baseline
            entry.retry_delay = SAVE_RETRY_FIRST_SECONDS
            self._save(entry)
        if not self._install(entry, baseline):
            return False
        log.info("baseline %s/%s frozen after %d passes", entry.tap, entry.layer, baseline.passes)
        return True

    def _save(self, entry: LayerEntry) -> bool:
        """Write the entry's baseline file (caller holds ``_lock``); on failure mark it UNSAVED.

        Why not refuse the baseline: it is valid and scores drift now; only
        its survival of a restart is at risk, which the state, the error and
        ``layertap_baselines_unsaved`` say until a retry writes it.
        """
        assert entry.baseline is not None
        if not self.baseline_dir:
            entry.save_error = ""
            return True
        try:
            save_baseline(self.baseline_dir, entry.baseline)
        except OSError as exc:
            first = not entry.save_error
            entry.save_error = f"cannot write baseline file to {self.baseline_dir}: {exc}"
            entry.retry_at = self._clock() + entry.retry_delay
            (log.error if first else log.warning)(
                "baseline %s/%s unsaved (retry in %.0f s): %s", entry.tap, entry.layer, entry.retry_delay, exc)
            entry.retry_delay = min(entry.retry_delay * 2, SAVE_RETRY_MAX_SECONDS)
            if self._on_save_error is not None:
                self._on_save_error(entry.save_error)
            return False
        if entry.save_error:
            log.info("baseline %s/%s saved after earlier failures", entry.tap, entry.layer)
        entry.save_error = ""
        entry.retry_delay = SAVE_RETRY_FIRST_SECONDS
        return True

    def retry_saves(self) -> int:
        """Retry writing every UNSAVED baseline whose backoff has passed; returns how many are still unsaved.

        Called once a second by the server's housekeeping thread, so a baseline
        is saved once the disk has room again whether or not traffic flows.
        """
        now = self._clock()
        with self._lock:
            for e in self._layers.values():
                if e.save_error and e.baseline is not None and e.retry_at <= now:
                    self._save(e)
            return sum(1 for e in self._layers.values() if e.save_error)

    def unsaved(self) -> int:
        """Frozen baselines whose file is not written yet (``layertap_baselines_unsaved``)."""
        with self._lock:
            return sum(1 for e in self._layers.values() if e.save_error)

    def _install(self, entry: LayerEntry, baseline: Baseline) -> bool:
        """Switch the layer to the frozen edges; False when its tap went meanwhile."""
        entry.baseline = baseline
        entry.builder = None
        entry.window = SlidingWindow.for_baseline(baseline, entry.window_len)
        try:
            self.engine.set_layer_reducers(entry.tap, entry.layer, layer_reducers(
                per_channel=baseline.channel_mean is not None, edges=baseline.edges), tap=entry.handle)
        except NotFound:  # deleted or replaced: on_tap_removed forgot the entry and its file
            return False
        self._export(entry)
        return True

    def _observe(self, entry: LayerEntry, res: dict[str, pb.ReducerResult]) -> None:
        baseline, window = entry.baseline, entry.window
        assert baseline is not None and window is not None
        hist = res["histogram"].histogram if "histogram" in res else None
        if hist is None or len(hist.edges) != len(baseline.edges):
            return  # a pass computed before the edges froze
        m = res["moments"].moments
        mm = res["minmax"].minmax if "minmax" in res else None
        pc = res["per_channel"].per_channel if "per_channel" in res else None
        chan = None
        if pc is not None and baseline.channel_mean is not None and len(pc.mean) == len(baseline.channel_mean):
            chan = np.asarray(pc.mean, dtype=np.float64)
        window.add(np.asarray(hist.counts, dtype=np.int64), m.count, m.mean, m.std,
                   mm.min if mm else math.nan, mm.max if mm else math.nan, channel_mean=chan)
        entry.score = window.score(baseline, entry.thresholds)
        self._export(entry)

    def _export(self, entry: LayerEntry) -> None:
        if self._on_score is not None:
            self._on_score(entry.tap, entry.layer, entry.point, entry.score, entry.thresholds)

    def on_tap_removed(self, tap: TapView, reason: str) -> None:
        if not tap.durable:
            return
        with self._lock:
            self._own.discard(tap.id)
            gone = [self._layers.pop(k) for k in [k for k in self._layers if k[0] == tap.id]]
        # A deleted (or replaced) baseline must not come back at the next start.
        if self.baseline_dir:
            for entry in gone:
                if entry.baseline is not None:
                    path = Path(self.baseline_dir) / baseline_filename(entry.baseline)
                    try:
                        path.unlink(missing_ok=True)
                    except OSError as exc:
                        log.error("cannot remove baseline file %s: %s", path, exc)

    def _channels(self, layer: str) -> int | None:
        shapes = self.engine.host.layer_shapes.get(layer)
        if shapes is None or not shapes.outputs or len(shapes.outputs[0]) < 2:
            return None
        shape = shapes.outputs[0]
        return int(shape[default_feature_axis(len(shape), tokens=self.engine.token_model)])
