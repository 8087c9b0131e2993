"""Per-layer activation series, built from the latest snapshots at scrape time.

Reading snapshots at scrape time means nothing is updated per pass and each
scrape sees one consistent copy. Every series carries ``model, layer, point,
tap``; no label ever holds a channel index or another unbounded value.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator

import numpy as np
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from layertap.server.drift.thresholds import DRIFT_METRICS
from layertap.server.export.exposition import LabelSet, ModelOnlyFamily, RenderedFamily, go_float
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
)


class ActivationCollector(Collector):
    """Yields the ``layertap_activation_*`` families from a snapshot at scrape time.

    At most ``max_layers`` distinct (tap, layer, point) are exported. Layers
    are admitted first come, first served and keep their slot while they
    exist, so the exported set does not flap between scrapes; the rest are
    counted in ``layertap_export_layers_dropped`` and logged once per change.

    ``layertap_activation_quantile`` is typed ``summary`` (quantile samples
    only): ``promtool check metrics`` refuses a ``quantile`` label on any other
    type, and a signed ``_sum`` would be no counter. ``layertap_activation_value``
    is a classic histogram without ``_sum``/``_count`` for the same reason; its
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
        self._admitted: dict[tuple[str, str, str], LabelSet] = {}
        self._last_dropped = 0
        self._le_cache: dict[tuple[float, ...], tuple[list[int], list[str]]] = {}

    @staticmethod
    def _families() -> dict[str, RenderedFamily]:
        f = {key: RenderedFamily(name, doc, "gauge") for key, name, doc in _GAUGES}
        f["quantile"] = RenderedFamily(
            "layertap_activation_quantile", "Activation quantiles of the latest sampled pass.", "summary"
        )
        f["nonfinite"] = RenderedFamily("layertap_activation_nonfinite", "NaN and Inf activation elements seen.", "counter")
        f["last_update"] = RenderedFamily(
            "layertap_activation_last_update_timestamp_seconds", "Unix time of the latest summary of the layer.", "gauge"
        )
        f["drift"] = RenderedFamily("layertap_activation_drift", "Drift of the layer against its baseline.", "gauge")
        f["threshold"] = RenderedFamily("layertap_activation_drift_threshold", "Drift threshold per metric.", "gauge")
        f["channel"] = RenderedFamily(
            "layertap_activation_channel_drift_fraction", "Fraction of channels whose mean drifted.", "gauge"
        )
        f["value"] = RenderedFamily(
            "layertap_activation_value", "Sampled activation values (bins of the tap's histogram reducer).", "histogram"
        )
        return f

    def describe(self) -> list[Metric]:
        # Names only: lets the registry catch clashes without a scrape.
        d: list[Metric] = list(self._families().values())
        d.append(GaugeMetricFamily("layertap_export_layers_dropped", "", labels=["model"]))
        return d

    def _admit(self, snaps: Iterable[LayerSnapshot]) -> tuple[list[tuple[LayerSnapshot, LabelSet]], int]:
        by_key = {s.key: s for s in snaps}
        with self._lock:
            for k in [k for k in self._admitted if k not in by_key]:
                del self._admitted[k]
            for k in by_key:
                if k not in self._admitted and len(self._admitted) < self.max_layers:
                    self._admitted[k] = LabelSet(self.model, k[1], k[2], k[0])
            kept = [(by_key[k], ls) for k, ls in self._admitted.items()]
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

    def _buckets(self, edges: tuple[float, ...]) -> tuple[list[int], list[str]]:
        """Which edges become ``le`` buckets (a spread-out subset) and their labels, cached.

        Cumulative counts at a subset of the edges are still exact, so capping
        the buckets loses resolution, never correctness.
        """
        with self._lock:
            hit = self._le_cache.get(edges)
        if hit is None:
            n = len(edges)
            keep = self.max_buckets - 1  # +Inf takes one
            idx = list(range(n)) if n <= keep else sorted(set(np.linspace(0, n - 1, keep).round().astype(int).tolist()))
            hit = (idx, [go_float(edges[i]) for i in idx])
            with self._lock:
                if len(self._le_cache) > 4 * self.max_layers:
                    self._le_cache.clear()
                self._le_cache[edges] = hit
        return hit

    def collect(self) -> Iterator[Metric]:
        snaps, dropped = self._admit(self._snapshot_fn())
        f = self._families()
        # Bound appends and sample names hoisted: this loop runs ~45 times per
        # layer per scrape.
        gauges = [(attr, f[attr].rows.append, f[attr].name) for attr, _, _ in _GAUGES]
        q_add, q_n = f["quantile"].rows.append, f["quantile"].name
        nf_add, nf_n = f["nonfinite"].rows.append, f["nonfinite"].name + "_total"
        lu_add, lu_n = f["last_update"].rows.append, f["last_update"].name
        d_add, d_n = f["drift"].rows.append, f["drift"].name
        t_add, t_n = f["threshold"].rows.append, f["threshold"].name
        c_add, c_n = f["channel"].rows.append, f["channel"].name
        h_add, h_n = f["value"].rows.append, f["value"].name + "_bucket"
        for s, ls in snaps:
            for attr, add, n in gauges:
                v = getattr(s, attr)
                if v is not None:
                    add((n, ls, "", "", v))
            if s.quantiles:
                for p, v in sorted(s.quantiles.items()):
                    q_add((q_n, ls, "quantile", go_float(p), v))
            if s.nan_total is not None:
                nf_add((nf_n, ls, "kind", "nan", s.nan_total))
            if s.inf_total is not None:
                nf_add((nf_n, ls, "kind", "inf", s.inf_total))
            if s.last_update is not None:
                lu_add((lu_n, ls, "", "", s.last_update))
            if s.drift is not None:
                for m in DRIFT_METRICS:
                    d_add((d_n, ls, "metric", m, getattr(s.drift, m)))
            thr = s.thresholds or (s.drift.thresholds if s.drift is not None else None)
            if thr is not None:
                for m in DRIFT_METRICS:
                    t_add((t_n, ls, "metric", m, getattr(thr, m)))
            cf = s.channel_drift_fraction
            if cf is None and s.drift is not None:
                cf = s.drift.channel_drift_fraction
            if cf is not None and not math.isnan(cf):
                c_add((c_n, ls, "", "", cf))
            if s.histogram is not None:
                edges, counts = s.histogram
                idx, les = self._buckets(tuple(edges))
                cum = np.cumsum(np.asarray(counts, dtype=np.int64)).tolist()
                # le=e_i holds the bins below e_i, cum[i]. (The reducer's bins
                # are [e_i, e_{i+1}), so a value exactly on an edge lands one
                # bucket up; immaterial for sampled float activations.)
                for i, le in zip(idx, les):
                    h_add((h_n, ls, "le", le, cum[i]))
                h_add((h_n, ls, "le", "+Inf", cum[-1]))
        yield from f.values()
        yield ModelOnlyFamily(
            "layertap_export_layers_dropped", "Tapped layers not exported because of the layer cap.", self.model, dropped
        )
