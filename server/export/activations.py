"""Per-layer activation series, built from the latest snapshots at scrape time.

Reading snapshots at scrape time means nothing is updated per pass and each
scrape sees one consistent copy. Every series carries ``model, layer, point,
tap, phase``; no label ever holds a channel index or another unbounded value.
``phase`` is ``forward`` (Infer and every other plain pass), ``prefill`` or
``decode``: a generation's steps never overwrite a plain forward's series, and
drift scores carry the phase of their baseline, so ``drift > threshold``
still matches one to one.

A scrape reads each family's values across all layers in one go (under
traffic every layer changes between scrapes, so caching per layer buys
nothing), lays out the sample lines again only when a layer or its label
values changed, and formats each family's values in one go (see
:mod:`.series`); a family whose values did not change keeps its text.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import accumulate, chain, product
from operator import attrgetter

import numpy as np
import numpy.typing as npt
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from layertap._results import RESULTS, Family
from layertap.server.drift.alarm import FIXED
from layertap.server.drift.scores import DriftScore
from layertap.server.drift.thresholds import DRIFT_METRICS, DriftThresholds
from layertap.server.export.exposition import RenderedFamily, model_only_family
from layertap.server.export.series import LabelSet, Lines, go_float
from layertap.server.export.snapshots import LayerSnapshot

__all__ = ["DEFAULT_MAX_BUCKETS", "DEFAULT_MAX_LAYERS", "ActivationCollector"]

log = logging.getLogger(__name__)

DEFAULT_MAX_LAYERS = 200
#: Most ``le`` buckets of ``layertap_activation_value`` per layer (+Inf included).
DEFAULT_MAX_BUCKETS = 24

#: The result families (layertap._results) by how a layer's series are read: one
#: value; one series per key of a mapping (e.g. quantiles); one per field (e.g.
#: NaN and Inf counts); histogram buckets.
_RESULT_FAMILIES = [f for r in RESULTS for f in r.families]
_ONE = [f for f in _RESULT_FAMILIES if not f.label]
_BY_KEY = [f for f in _RESULT_FAMILIES if f.label and not f.label_values and f.type != "histogram"]
_PER_FIELD = [f for f in _RESULT_FAMILIES if f.label_values]
_BUCKETS = [f for f in _RESULT_FAMILIES if f.type == "histogram"]
_SUFFIX = {"gauge": "", "counter": "_total", "histogram": "_bucket"}


def _row(f: Family) -> tuple[str, str, str, str, str]:
    return f.name, f.help, f.type, _SUFFIX[f.type], f.label


#: Every per-layer family in exposition order: (name, HELP, type, sample-name suffix, extra label).
#: The layer's own families (not a reducer's) sit before the histograms, whose bucket lines are many.
_FAMILIES: tuple[tuple[str, str, str, str, str], ...] = (
    *map(_row, _ONE + _BY_KEY + _PER_FIELD),
    ("layertap_activation_last_update_timestamp_seconds", "Unix time of the latest summary of the layer.", "gauge",
     "", ""),
    ("layertap_activation_drift", "Drift of the layer against its baseline.", "gauge", "", "metric"),
    ("layertap_activation_drift_threshold", "Drift threshold per metric.", "gauge", "", "metric"),
    ("layertap_activation_channel_drift_fraction",
     "Fraction of the features past the calibrated threshold in the last window (fixed thresholds: of the channels "
     "whose mean moved past the mean-shift threshold).", "gauge", "", ""),
    ("layertap_activation_drift_alarm", "The layer's drift alarm (1 raised): calibrated, or fixed thresholds.",
     "gauge", "", ""),
    ("layertap_activation_drift_ratio", "Drift score over its threshold (calibrated: the last window's max |z|; "
     "fixed: the largest of the four); the alarm is raised above 1.", "gauge", "", ""),
    *map(_row, _BUCKETS),
)
#: Slots of the histogram families, whose values are counts.
_COUNT_SLOTS = frozenset(range(len(_FAMILIES) - len(_BUCKETS), len(_FAMILIES)))
_NO_EXTRA = ("",)
_METRICS = tuple(DRIFT_METRICS)
_drift_values = attrgetter(*DRIFT_METRICS)


#: One family over the exported layers: each layer's extra label values
#: (None: the layer has no series in it), and the values of all its samples in order.
_Column = tuple[tuple[tuple[str, ...] | None, ...], list[float]]
_one_getters = [attrgetter(f.snapshot[0]) for f in _ONE]
_key_getters = [attrgetter(f.snapshot[0]) for f in _BY_KEY]
_bucket_getters = [attrgetter(f.snapshot[0]) for f in _BUCKETS]


def _label_sets(f: Family) -> dict[tuple[bool, ...], tuple[str, ...] | None]:
    """A per-field family's label values for each pattern of present fields (None: no series)."""
    return {present: tuple([lv for lv, p in zip(f.label_values, present) if p]) or None
            for present in product((True, False), repeat=len(f.label_values))}


#: Per per-field family: its fields' getter, its label values, and those of each pattern of present fields.
_per_field_readers = [(attrgetter(*f.snapshot), f.label_values, _label_sets(f)) for f in _PER_FIELD]
_last_update = attrgetter("last_update")
_drift = attrgetter("drift")


def _present(values: list[float | None]) -> _Column:
    """A one-series-per-layer family from each layer's value (None: no series)."""
    if None not in values:
        return (_NO_EXTRA,) * len(values), values  # type: ignore[return-value]
    return tuple([None if v is None else _NO_EXTRA for v in values]), [v for v in values if v is not None]


def _per_metric(scores: list[DriftScore | DriftThresholds | None]) -> _Column:
    """A family with one series per drift metric, from each layer's scores or thresholds."""
    present = [x for x in scores if x is not None]
    return (tuple([None if x is None else _METRICS for x in scores]),
            list(chain.from_iterable(map(_drift_values, present))))


def _per_field(snaps: list[LayerSnapshot], get: Callable[[LayerSnapshot], tuple[float | None, ...]],
               every: tuple[str, ...], label_sets: dict[tuple[bool, ...], tuple[str, ...] | None]) -> _Column:
    """A family with one series per snapshot field (e.g. ``kind="nan"``, ``kind="inf"``)."""
    extras: list[tuple[str, ...] | None] = []
    values: list[float] = []
    for row in map(get, snaps):
        if None not in row:
            extras.append(every)
            values += row  # type: ignore[arg-type]  # no None in it
            continue
        labels = label_sets[tuple([v is not None for v in row])]
        extras.append(labels)
        if labels is not None:
            values += [v for v in row if v is not None]
    return tuple(extras), values


def _channel(s: LayerSnapshot, drift: DriftScore | None) -> float | None:
    cf = s.channel_drift_fraction
    if cf is None and drift is not None:
        cf = drift.channel_drift_fraction
    return None if cf is None or math.isnan(cf) else cf


def _alarm(drift: DriftScore | None) -> float | None:
    return None if drift is None or drift.alarm is None else float(drift.alarm.alarm)


def _ratio(drift: DriftScore | None) -> float | None:
    if drift is None or drift.alarm is None:
        return None
    if drift.alarm.calibration == FIXED:
        t = drift.thresholds.as_dict()
        r = max((v / t[m] for m, v in drift.as_dict().items() if not math.isnan(v)), default=math.nan)
    else:
        r = drift.alarm.ratio
    return None if math.isnan(r) else r


def _cumulative(counts: list[Sequence[int] | npt.NDArray[np.int64]], picks: list[list[int]]) -> list[int]:
    """Cumulative bucket counts at each layer's picked bins, then its total (the ``+Inf`` bucket).

    Layers with bins alike (the usual case) take one numpy pass over all of
    them; the result is Python ints, in layer order.
    """
    if not counts:
        return []
    width = len(counts[0])
    if all(len(c) == width and len(p) == width - 1 for c, p in zip(counts, picks)):
        return np.cumsum(np.array(counts, dtype=np.int64), axis=1).ravel().tolist()  # type: ignore[no-any-return]
    if all(len(c) == width for c in counts) and all(p is picks[0] for p in picks):
        picked = np.cumsum(np.array(counts, dtype=np.int64), axis=1)[:, [*picks[0], width - 1]]
        return picked.ravel().tolist()  # type: ignore[no-any-return]
    values: list[int] = []
    for c, idx in zip(counts, picks):
        cum = list(accumulate(np.asarray(c, dtype=np.int64).tolist()))
        # le=e_i holds the bins below e_i, cum[i]. (The reducer's bins are
        # [e_i, e_{i+1}), so a value exactly on an edge lands one bucket up;
        # immaterial for sampled float activations.) +Inf: the total.
        values += cum if len(idx) + 1 == len(cum) else [*[cum[i] for i in idx], cum[-1]]
    return values


def _samples(slot: int, labels: tuple[LabelSet, ...], column: _Column) -> Callable[[], list[Sample]]:
    """Builds one family's ``Sample`` objects on demand (for ``generate_latest``, tests and tools)."""
    name, _, _, suffix, key = _FAMILIES[slot]

    def samples() -> list[Sample]:
        out = []
        values = iter(column[1])
        for layer, extras in zip(labels, column[0]):
            if extras is not None:
                base = layer.labels
                for e in extras:
                    out.append(Sample(name + suffix, {**base, key: e} if key else dict(base), next(values)))
        return out
    return samples


class ActivationCollector(Collector):
    """Yields the ``layertap_activation_*`` families from a snapshot at scrape time.

    At most ``max_layers`` distinct (tap, layer, point, phase) are exported. Layers
    are admitted first come, first served and keep their slot while they
    exist, so the exported set does not flap between scrapes; the rest are
    counted in ``layertap_export_layers_dropped`` and logged once per change.

    ``layertap_activation_quantile`` is a gauge whose probability label is
    ``q``: ``promtool check metrics`` refuses a ``quantile`` label on a gauge,
    and OpenMetrics refuses a summary's negative quantile values, which
    activations have. ``layertap_activation_value`` is a classic histogram
    without ``_sum``/``_count``, because a signed ``_sum`` would be no counter; its
    ``+Inf`` bucket is the count.
    """

    def __init__(
        self,
        snapshot_fn: Callable[[], Iterable[LayerSnapshot]],
        model_name: str,
        max_layers: int = DEFAULT_MAX_LAYERS,
        max_buckets: int = DEFAULT_MAX_BUCKETS,
    ) -> None:
        """Create the collector (register it with ``registry.register(c)``).

        Args:
            snapshot_fn: Returns the current snapshots, e.g. ``store.snapshot``.
            model_name: Value of the ``model`` label.
            max_layers: Cap on exported (tap, layer, point, phase): each phase
                of a layer is one series set.
            max_buckets: Cap on ``le`` buckets per layer in ``layertap_activation_value``.
        """
        if max_buckets < 2:
            raise ValueError("max_buckets must be >= 2")
        self._snapshot_fn = snapshot_fn
        self.model = model_name
        self.max_layers = int(max_layers)
        self.max_buckets = int(max_buckets)
        self._lock = threading.Lock()
        # Held while layers are read and lines rendered: two concurrent
        # scrapes must not interleave on the shared caches.
        self._render_lock = threading.Lock()
        self._admitted: dict[tuple[str, str, str, str], LabelSet] = {}
        self._last_dropped = 0
        self._le_cache: dict[tuple[float, ...], tuple[list[int], tuple[str, ...]]] = {}
        self._idx_cache: dict[int, list[int]] = {}
        self._q_cache: dict[tuple[float, ...], tuple[tuple[str, ...], tuple[float, ...] | None]] = {}
        # The layers and shapes the family lines were laid out for.
        self._layout: tuple[tuple[LabelSet, ...], tuple[object, ...]] = ((), ())
        self._lines = [Lines(()) for _ in _FAMILIES]

    def describe(self) -> list[Metric]:
        # Names only: lets the registry catch clashes without a scrape.
        d: list[Metric] = [RenderedFamily(name, doc, typ) for name, doc, typ, _, _ in _FAMILIES]
        d.append(GaugeMetricFamily("layertap_export_layers_dropped", "", labels=["model"]))
        return d

    def _admit(self, snaps: Iterable[LayerSnapshot]) -> tuple[list[LayerSnapshot], tuple[LabelSet, ...], int]:
        by_key = {s.key: s for s in snaps}
        with self._lock:
            for k in [k for k in self._admitted if k not in by_key]:
                del self._admitted[k]
            for k in by_key:
                if k not in self._admitted and len(self._admitted) < self.max_layers:
                    self._admitted[k] = LabelSet(self.model, k[1], k[2], k[0], k[3])
            kept = [by_key[k] for k in self._admitted]
            labels = tuple(self._admitted.values())
            dropped = len(by_key) - len(kept)
            if dropped != self._last_dropped:
                if dropped:
                    log.warning(
                        "metrics: %d tapped layers over the export cap of %d are not exported "
                        "(see layertap_export_layers_dropped); narrow the tap selectors or raise the cap",
                        dropped, self.max_layers,
                    )
                else:
                    log.info("metrics: all tapped layers are exported again")
                self._last_dropped = dropped
        return kept, labels, dropped

    def buckets(self, edges: tuple[float, ...]) -> tuple[list[int], tuple[str, ...]]:
        """Which edges become ``le`` buckets (a spread-out subset) and the ``le`` labels with ``+Inf``, cached.

        Cumulative counts at a subset of the edges are still exact, so capping
        the buckets loses resolution, never correctness. Edges of one length
        share one index list (the subset depends on the length only).
        """
        with self._lock:
            hit = self._le_cache.get(edges)
        if hit is None:
            n = len(edges)
            with self._lock:
                idx = self._idx_cache.get(n)
            if idx is None:
                keep = self.max_buckets - 1  # +Inf takes one
                idx = list(range(n)) if n <= keep else sorted(set(np.linspace(0, n - 1, keep).round().astype(int).tolist()))
            hit = (idx, (*[go_float(edges[i]) for i in idx], "+Inf"))
            with self._lock:
                if len(self._le_cache) > 4 * self.max_layers:
                    self._le_cache.clear()
                self._le_cache[edges] = hit
                self._idx_cache.setdefault(n, idx)
        return hit

    def quantile_labels(self, probs: tuple[float, ...]) -> tuple[tuple[str, ...], tuple[float, ...] | None]:
        """``quantile`` label values of probabilities in sorted order, and that order (None: already sorted), cached."""
        with self._lock:
            hit = self._q_cache.get(probs)
            if hit is None:
                if len(self._q_cache) > 4 * self.max_layers:
                    self._q_cache.clear()
                order = tuple(sorted(probs))
                hit = self._q_cache[probs] = (tuple([go_float(p) for p in order]), None if order == probs else order)
        return hit

    def _by_key(self, snaps: list[LayerSnapshot], get: Callable[[LayerSnapshot], dict[float, float] | None]) -> _Column:
        """A family with one series per probability of a layer's mapping (``q="0.5"``...)."""
        extras: list[tuple[str, ...] | None] = []
        values: list[float] = []
        for q in map(get, snaps):
            if not q:
                extras.append(None)
                continue
            labels, order = self.quantile_labels(tuple(q))
            extras.append(labels)
            values += q.values() if order is None else [q[p] for p in order]
        return tuple(extras), values

    def _histograms(self, snaps: list[LayerSnapshot], get: Callable[[LayerSnapshot], tuple[Sequence[float], Sequence[int]] | None]) -> _Column:
        extras: list[tuple[str, ...] | None] = []
        counts: list[Sequence[int] | npt.NDArray[np.int64]] = []
        picks: list[list[int]] = []
        for h in map(get, snaps):
            if h is None:
                extras.append(None)
                continue
            edges, c = h
            idx, les = self.buckets(tuple(edges))
            extras.append(les)
            counts.append(c)
            picks.append(idx)
        return tuple(extras), _cumulative(counts, picks)  # type: ignore[return-value]

    def _read(self, snaps: list[LayerSnapshot]) -> list[_Column]:
        """Every family's column, in :data:`_FAMILIES` order, read afresh from the snapshots.

        Read column by column with C-level getters: cheaper than a per-layer
        cache of rows when, under traffic, every layer changes between scrapes.
        """
        drifts = list(map(_drift, snaps))
        cols = [_present(list(map(get, snaps))) for get in _one_getters]
        cols += [self._by_key(snaps, get) for get in _key_getters]
        cols += [_per_field(snaps, get, every, label_sets) for get, every, label_sets in _per_field_readers]
        cols += (
            _present(list(map(_last_update, snaps))),
            _per_metric(drifts),  # type: ignore[arg-type]
            _per_metric([s.thresholds or (d.thresholds if d is not None else None) for s, d in zip(snaps, drifts)]),
            _present([_channel(s, d) for s, d in zip(snaps, drifts)]),
            _present(list(map(_alarm, drifts))),
            _present(list(map(_ratio, drifts))),
        )
        cols += [self._histograms(snaps, get) for get in _bucket_getters]
        return cols

    def _lay_out(self, labels: tuple[LabelSet, ...], columns: list[_Column]) -> None:
        """New sample-line prefixes for every family: a layer came or went, or changed its label values."""
        for slot, ((name, _, _, suffix, key), (extras, _)) in enumerate(zip(_FAMILIES, columns)):
            self._lines[slot] = Lines([layer.prefix(name + suffix, key, e)
                                       for layer, ex in zip(labels, extras) if ex is not None for e in ex])

    def collect(self) -> Iterator[Metric]:
        snaps, labels, dropped = self._admit(self._snapshot_fn())
        families: list[Metric] = []
        with self._render_lock:
            columns = self._read(snaps)
            layout = (labels, tuple([extras for extras, _ in columns]))
            if layout != self._layout:  # identical objects compare at C speed
                self._lay_out(labels, columns)
                self._layout = layout
            for slot, ((name, doc, typ, _, _), column, lines) in enumerate(zip(_FAMILIES, columns, self._lines)):
                # The bucket counts are Python ints by construction (from an int64 array).
                text = lines.fill_counts(column[1]) if slot in _COUNT_SLOTS else lines.fill(column[1])  # type: ignore[arg-type]
                families.append(RenderedFamily(name, doc, typ, text, _samples(slot, labels, column)))
        families.append(model_only_family(
            "layertap_export_layers_dropped", "Tapped layers not exported because of the layer cap.", self.model, dropped
        ))
        return iter(families)
