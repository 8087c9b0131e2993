"""Per-layer activation series, built from the latest snapshots at scrape time.

Reading snapshots at scrape time means nothing is updated per pass and each
scrape sees one consistent copy. Every series carries ``model, layer, point,
tap``; no label ever holds a channel index or another unbounded value.

A scrape reads again only the layers whose snapshot changed, lays out the
sample lines again only when a layer or its label values changed, and formats
each family's values in one go (see :mod:`.series`); a family whose values
did not change keeps its text.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator
from itertools import accumulate, chain
from operator import attrgetter

import numpy as np
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from layertap.server.drift.thresholds import DRIFT_METRICS
from layertap.server.export.exposition import RenderedFamily, model_only_family
from layertap.server.export.series import LabelSet, Lines, go_float
from layertap.server.export.snapshots import LayerSnapshot

__all__ = ["DEFAULT_MAX_BUCKETS", "DEFAULT_MAX_LAYERS", "ActivationCollector"]

log = logging.getLogger(__name__)

DEFAULT_MAX_LAYERS = 200
#: Most ``le`` buckets of ``layertap_activation_value`` per layer (+Inf included).
DEFAULT_MAX_BUCKETS = 24

_GAUGES = (
    ("mean", "layertap_activation_mean", "Mean of the activation."),
    ("std", "layertap_activation_std", "Standard deviation of the activation."),
    ("min", "layertap_activation_min", "Smallest activation value."),
    ("max", "layertap_activation_max", "Largest activation value."),
    ("abs_max", "layertap_activation_abs_max", "Largest absolute activation value."),
    ("zero_fraction", "layertap_activation_zero_fraction", "Fraction of activation elements equal to zero."),
    ("latency", "layertap_layer_latency_seconds", "Seconds the module's forward took in the latest sampled pass."),
)
#: Every per-layer family in exposition order: (name, HELP, type, sample-name suffix, extra label).
_FAMILIES: tuple[tuple[str, str, str, str, str], ...] = (
    *((name, doc, "gauge", "", "") for _, name, doc in _GAUGES),
    ("layertap_activation_quantile", "Activation quantiles of the latest sampled pass.", "gauge", "", "q"),
    ("layertap_activation_nonfinite", "NaN and Inf activation elements seen.", "counter", "_total", "kind"),
    ("layertap_activation_last_update_timestamp_seconds", "Unix time of the latest summary of the layer.", "gauge",
     "", ""),
    ("layertap_activation_drift", "Drift of the layer against its baseline.", "gauge", "", "metric"),
    ("layertap_activation_drift_threshold", "Drift threshold per metric.", "gauge", "", "metric"),
    ("layertap_activation_channel_drift_fraction", "Fraction of channels whose mean drifted.", "gauge", "", ""),
    ("layertap_activation_value", "Sampled activation values (bins of the tap's histogram reducer).", "histogram",
     "_bucket", "le"),
)
_QUANTILE, _NONFINITE, _LAST_UPDATE, _DRIFT, _THRESHOLD, _CHANNEL, _VALUE = range(len(_GAUGES), len(_FAMILIES))
_NO_EXTRA = ("",)
_KINDS = {(True, True): ("nan", "inf"), (True, False): ("nan",), (False, True): ("inf",)}
_METRICS = tuple(DRIFT_METRICS)
_drift_values = attrgetter(*DRIFT_METRICS)
_gauge_values = attrgetter(*(attr for attr, _, _ in _GAUGES))


#: One layer's part of one family: (extra label values, sample values).
_Row = tuple[tuple[str, ...], tuple[float, ...]]


class _LayerSeries:
    """One exported layer: its labels, the snapshot read last, and its row of each family (None: no series)."""

    __slots__ = ("labels", "snap", "rows", "shape")

    def __init__(self, labels: LabelSet) -> None:
        self.labels = labels
        self.snap: LayerSnapshot | None = None
        self.rows: list[_Row | None] = [None] * len(_FAMILIES)
        #: Each family's extra label values (None: absent); kept as the same
        #: object while unchanged, so the collector sees at a glance that its
        #: sample lines are laid out as before.
        self.shape: tuple[tuple[str, ...] | None, ...] = (None,) * len(_FAMILIES)

    def refresh(self, s: LayerSnapshot, collector: ActivationCollector) -> None:
        """Read every row from snapshot ``s``."""
        rows: list[_Row | None] = [None if v is None else (_NO_EXTRA, (v,)) for v in _gauge_values(s)]
        rows += [None] * (len(_FAMILIES) - len(rows))
        if s.quantiles:
            probs = tuple(sorted(s.quantiles))
            rows[_QUANTILE] = (collector.quantile_labels(probs), tuple([s.quantiles[p] for p in probs]))
        kinds = _KINDS.get((s.nan_total is not None, s.inf_total is not None))
        if kinds is not None:
            rows[_NONFINITE] = (kinds, tuple([v for v in (s.nan_total, s.inf_total) if v is not None]))
        if s.last_update is not None:
            rows[_LAST_UPDATE] = (_NO_EXTRA, (s.last_update,))
        if s.drift is not None:
            rows[_DRIFT] = (_METRICS, _drift_values(s.drift))
        thr = s.thresholds or (s.drift.thresholds if s.drift is not None else None)
        if thr is not None:
            rows[_THRESHOLD] = (_METRICS, _drift_values(thr))
        cf = s.channel_drift_fraction
        if cf is None and s.drift is not None:
            cf = s.drift.channel_drift_fraction
        if cf is not None and not math.isnan(cf):
            rows[_CHANNEL] = (_NO_EXTRA, (cf,))
        if s.histogram is not None:
            edges, counts = s.histogram
            idx, les = collector.buckets(tuple(edges))
            cum = list(accumulate(np.asarray(counts, dtype=np.int64).tolist()))
            # le=e_i holds the bins below e_i, cum[i]. (The reducer's bins
            # are [e_i, e_{i+1}), so a value exactly on an edge lands one
            # bucket up; immaterial for sampled float activations.) +Inf: the total.
            rows[_VALUE] = (les, tuple(cum) if len(idx) + 1 == len(cum) else (*[cum[i] for i in idx], cum[-1]))
        shape = tuple([None if r is None else r[0] for r in rows])
        if shape != self.shape:
            self.shape = shape
        self.rows, self.snap = rows, s


def _samples(slot: int, layers: list[_LayerSeries], rows: tuple[_Row | None, ...]) -> Callable[[], list[Sample]]:
    """Builds one family's ``Sample`` objects on demand (for ``generate_latest``, tests and tools)."""
    name, _, _, suffix, key = _FAMILIES[slot]

    def samples() -> list[Sample]:
        out = []
        for layer, row in zip(layers, rows):
            if row is not None:
                base = layer.labels.labels
                for e, v in zip(*row):
                    out.append(Sample(name + suffix, {**base, key: e} if key else dict(base), v))
        return out
    return samples


class ActivationCollector(Collector):
    """Yields the ``layertap_activation_*`` families from a snapshot at scrape time.

    At most ``max_layers`` distinct (tap, layer, point) are exported. Layers
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
            max_layers: Cap on exported (tap, layer, point).
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
        self._admitted: dict[tuple[str, str, str], _LayerSeries] = {}
        self._last_dropped = 0
        self._le_cache: dict[tuple[float, ...], tuple[list[int], tuple[str, ...]]] = {}
        self._q_cache: dict[tuple[float, ...], tuple[str, ...]] = {}
        # The layers and shapes the family lines were laid out for.
        self._layout: tuple[tuple[_LayerSeries, ...], tuple[object, ...]] = ((), ())
        self._lines = [Lines(()) for _ in _FAMILIES]

    def describe(self) -> list[Metric]:
        # Names only: lets the registry catch clashes without a scrape.
        d: list[Metric] = [RenderedFamily(name, doc, typ) for name, doc, typ, _, _ in _FAMILIES]
        d.append(GaugeMetricFamily("layertap_export_layers_dropped", "", labels=["model"]))
        return d

    def _admit(self, snaps: Iterable[LayerSnapshot]) -> tuple[list[tuple[LayerSnapshot, _LayerSeries]], int]:
        by_key = {s.key: s for s in snaps}
        with self._lock:
            for k in [k for k in self._admitted if k not in by_key]:
                del self._admitted[k]
            for k in by_key:
                if k not in self._admitted and len(self._admitted) < self.max_layers:
                    self._admitted[k] = _LayerSeries(LabelSet(self.model, k[1], k[2], k[0]))
            kept = [(by_key[k], layer) for k, layer in self._admitted.items()]
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
        return kept, dropped

    def buckets(self, edges: tuple[float, ...]) -> tuple[list[int], tuple[str, ...]]:
        """Which edges become ``le`` buckets (a spread-out subset) and the ``le`` labels with ``+Inf``, cached.

        Cumulative counts at a subset of the edges are still exact, so capping
        the buckets loses resolution, never correctness.
        """
        with self._lock:
            hit = self._le_cache.get(edges)
        if hit is None:
            n = len(edges)
            keep = self.max_buckets - 1  # +Inf takes one
            idx = list(range(n)) if n <= keep else sorted(set(np.linspace(0, n - 1, keep).round().astype(int).tolist()))
            hit = (idx, (*[go_float(edges[i]) for i in idx], "+Inf"))
            with self._lock:
                if len(self._le_cache) > 4 * self.max_layers:
                    self._le_cache.clear()
                self._le_cache[edges] = hit
        return hit

    def quantile_labels(self, probs: tuple[float, ...]) -> tuple[str, ...]:
        """``quantile`` label values of sorted probabilities, cached (a handful of distinct sets)."""
        with self._lock:
            hit = self._q_cache.get(probs)
            if hit is None:
                if len(self._q_cache) > 4 * self.max_layers:
                    self._q_cache.clear()
                hit = self._q_cache[probs] = tuple([go_float(p) for p in probs])
        return hit

    def _lay_out(self, layers: tuple[_LayerSeries, ...]) -> None:
        """New sample-line prefixes for every family: a layer came or went, or changed its label values."""
        for slot, (name, _, _, suffix, key) in enumerate(_FAMILIES):
            self._lines[slot] = Lines([layer.labels.prefix(name + suffix, key, e)
                                       for layer in layers if (extras := layer.shape[slot]) is not None
                                       for e in extras])

    def collect(self) -> Iterator[Metric]:
        snaps, dropped = self._admit(self._snapshot_fn())
        families: list[Metric] = []
        with self._render_lock:
            for s, layer in snaps:
                if s is not layer.snap:
                    layer.refresh(s, self)
            layers = tuple([layer for _, layer in snaps])
            layout = (layers, tuple([layer.shape for layer in layers]))
            if layout != self._layout:  # identical objects compare at C speed
                self._lay_out(layers)
                self._layout = layout
            columns = list(zip(*[layer.rows for layer in layers])) if layers else [()] * len(_FAMILIES)
            for slot, ((name, doc, typ, _, _), rows, lines) in enumerate(zip(_FAMILIES, columns, self._lines)):
                values = list(chain.from_iterable([r[1] for r in rows if r is not None]))
                families.append(RenderedFamily(name, doc, typ, lines.fill(values), _samples(slot, list(layers), rows)))
        families.append(model_only_family(
            "layertap_export_layers_dropped", "Tapped layers not exported because of the layer cap.", self.model, dropped
        ))
        return iter(families)
