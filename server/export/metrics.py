"""Prometheus metrics: the server's own health and per-layer activation series.

Nothing here touches the global registry: every metric and collector is
registered on a ``CollectorRegistry`` the caller injects.

* :class:`ServerMetrics` owns the health metrics, updated as events happen
  (requests, hook time, captures, stream drops).
* :class:`ActivationCollector` is a custom collector. It reads the latest
  :class:`LayerSnapshot` list at scrape time, so nothing is updated per pass
  and the scrape sees one consistent snapshot.
* :class:`SnapshotStore` is where the tap pipeline leaves its latest
  summaries (``update_from_summary``) and drift scores (``set_drift``).

Every series carries ``model``; activation series add ``layer, point, tap``.
No label ever holds a channel index or another unbounded value.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import numpy as np
import numpy.typing as npt
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, ThreadingWSGIServer
from prometheus_client.metrics_core import (
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from layertap.server.drift.scores import DRIFT_METRICS, DriftScore, DriftThresholds

__all__ = [
    "DEFAULT_MAX_LAYERS",
    "HOOK_BUCKETS",
    "INFERENCE_BUCKETS",
    "ActivationCollector",
    "CudaMemoryCollector",
    "LayerSnapshot",
    "ServerMetrics",
    "SnapshotStore",
    "make_metrics_app",
    "point_name",
    "render_latest",
    "start_metrics_server",
    "stop_metrics_server",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_LAYERS = 200
#: Most ``le`` buckets of ``layertap_activation_value`` per layer (+Inf included).
DEFAULT_MAX_BUCKETS = 24
#: Hooks plus reducers take tens of µs to a few ms per pass.
HOOK_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3)
INFERENCE_BUCKETS = (1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 500e-3, 1.0, 2.5, 5.0, 10.0)

_ACT_LABELS = ("model", "layer", "point", "tap")


def point_name(point: int) -> str:
    """``layertap.v1.Point`` value → label value (``POINT_OUTPUT`` → ``"output"``).

    ``POINT_UNSPECIFIED`` reads as ``"output"``, the API's default point.
    """
    from layertap.v1 import telemetry_pb2  # the server owns the stubs; keep import local to the boundary

    if point == 0:
        return "output"
    try:
        return str(telemetry_pb2.Point.Name(point)).removeprefix("POINT_").lower()
    except ValueError:
        return f"point_{int(point)}"


# --------------------------------------------------------------------- health


class ServerMetrics:
    """The server's health metrics, all labelled ``model``.

    Use the methods from the code paths that see each event; gauges such as
    ``subscribers`` and ``taps`` can also be bound to a callback with
    ``metrics.taps.set_function(fn)`` so they are read at scrape time.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        *,
        version: str | None = None,
        torch_version: str | None = None,
        cuda: bool | None = None,
    ) -> None:
        """Create and register the metrics.

        Args:
            registry: Where to register (never the global one implicitly).
            model_name: Value of the ``model`` label.
            version: layertap version for ``layertap_build_info`` (default: installed).
            torch_version: torch version (default: ``torch.__version__`` if importable).
            cuda: Export CUDA memory; None detects ``torch.cuda.is_available()``.
        """
        self.model = model_name
        m = ("model",)
        r = registry
        self._requests = Counter(
            "layertap_inference_requests", "Infer requests by gRPC status code.", m + ("status",), registry=r
        )
        self.inference_duration = Histogram(
            "layertap_inference_duration_seconds", "Infer request latency, hooks included.", m,
            buckets=INFERENCE_BUCKETS, registry=r,
        ).labels(model_name)
        self.hook_duration = Histogram(
            "layertap_hook_duration_seconds", "Hook plus reducer time per forward pass, all taps together.", m,
            buckets=HOOK_BUCKETS, registry=r,
        ).labels(model_name)
        self.reducer_errors = Counter(
            "layertap_reducer_errors", "Reducer failures (the tap is disabled after repeated errors).", m, registry=r
        ).labels(model_name)
        self._captures = Counter("layertap_captures", "Capture calls by final gRPC status code.", m + ("code",), registry=r)
        self.capture_bytes = Counter(
            "layertap_capture_bytes", "Tensor bytes sent by Capture.", m, registry=r
        ).labels(model_name)
        self.stream_messages = Counter(
            "layertap_stream_messages", "Subscribe messages sent.", m, registry=r
        ).labels(model_name)
        self.stream_dropped = Counter(
            "layertap_stream_dropped", "Subscribe messages dropped by full subscriber queues.", m, registry=r
        ).labels(model_name)
        self.subscribers = Gauge("layertap_subscribers", "Open Subscribe streams.", m, registry=r).labels(model_name)
        self.taps = Gauge("layertap_taps", "Registered taps, durable and stream.", m, registry=r).labels(model_name)
        self.baseline_load_errors = Counter(
            "layertap_baseline_load_errors", "Baseline files refused at start-up.", m, registry=r
        ).labels(model_name)
        self.build_info = Info("layertap_build", "layertap and torch versions.", m, registry=r).labels(model_name)
        self.build_info.info({"version": version or _layertap_version(), "torch_version": torch_version or _torch_version()})
        # Export the usual outcomes from the start so rate() and the dashboard
        # see a zero instead of a missing series before the first event.
        self._requests.labels(model_name, "OK")
        self._captures.labels(model_name, "OK")
        if cuda is None:
            cuda = _cuda_available()
        self.cuda_collector: CudaMemoryCollector | None = None
        if cuda:
            self.cuda_collector = CudaMemoryCollector(model_name)
            r.register(self.cuda_collector)

    def record_inference(self, status: str, seconds: float | None = None) -> None:
        """Count one Infer call by status code name (``"OK"``, ``"INVALID_ARGUMENT"``...)."""
        self._requests.labels(self.model, status).inc()
        if seconds is not None:
            self.inference_duration.observe(seconds)

    def observe_hooks(self, seconds: float) -> None:
        """Hook plus reducer time of one forward pass."""
        self.hook_duration.observe(seconds)

    def record_capture(self, code: str, nbytes: int = 0) -> None:
        """Count one finished Capture call and the tensor bytes it sent."""
        self._captures.labels(self.model, code).inc()
        if nbytes:
            self.capture_bytes.inc(nbytes)


def _layertap_version() -> str:
    try:
        from importlib.metadata import version

        return version("layertap")
    except Exception:  # not installed as a distribution
        return "unknown"


def _torch_version() -> str:
    try:
        import torch

        return str(torch.__version__)
    except ImportError:
        return "none"


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


class CudaMemoryCollector(Collector):
    """``layertap_cuda_memory_{allocated,reserved}_bytes`` per device, read at scrape time."""

    def __init__(self, model_name: str) -> None:
        self.model = model_name

    def describe(self) -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily("layertap_cuda_memory_allocated_bytes", "CUDA memory held by tensors.", labels=["model", "device"]),
            GaugeMetricFamily("layertap_cuda_memory_reserved_bytes", "CUDA memory reserved by the caching allocator.", labels=["model", "device"]),
        ]

    def collect(self) -> Iterator[Metric]:
        import torch

        alloc, reserved = self.describe()
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                # Both read allocator counters on the host: no device sync.
                alloc.add_metric([self.model, str(i)], float(torch.cuda.memory_allocated(i)))
                reserved.add_metric([self.model, str(i)], float(torch.cuda.memory_reserved(i)))
        yield alloc
        yield reserved


# ----------------------------------------------------------------- snapshots


@dataclass(frozen=True, eq=False)
class LayerSnapshot:
    """The latest telemetry of one (tap, layer, point); None means "not tapped", and the series is omitted.

    Attributes:
        histogram: ``(inner_edges, counts)`` with counts cumulative since the
            edges were set (``len(edges) + 1`` bins, open ends), or None.
        nan_total / inf_total: Cumulative non-finite element counts.
        last_update: Unix time of the latest summary for this layer.
        drift: The current drift scores; their thresholds are exported unless
            ``thresholds`` overrides them.
    """

    tap: str
    layer: str
    point: str
    mean: float | None = None
    std: float | None = None
    min: float | None = None
    max: float | None = None
    abs_max: float | None = None
    zero_fraction: float | None = None
    quantiles: Mapping[float, float] | None = None
    nan_total: int | None = None
    inf_total: int | None = None
    last_update: float | None = None
    histogram: tuple[Sequence[float], Sequence[int] | npt.NDArray[np.int64]] | None = None
    drift: DriftScore | None = None
    thresholds: DriftThresholds | None = None
    channel_drift_fraction: float | None = None

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.tap, self.layer, self.point)


@dataclass
class _LayerState:
    values: dict[str, float] = field(default_factory=dict)
    quantiles: dict[float, float] | None = None
    nan_total: int | None = None
    inf_total: int | None = None
    last_update: float | None = None
    hist_edges: tuple[float, ...] | None = None
    hist_counts: npt.NDArray[np.int64] | None = None
    drift: DriftScore | None = None
    thresholds: DriftThresholds | None = None
    channel_fraction: float | None = None


_MAX_TOMBSTONES = 4096
#: The only ``quantile`` label values exported: a bounded set, whatever
#: probabilities a tap computes (a drift baseline collects 99 of them).
EXPORTED_QUANTILES: frozenset[float] = frozenset({0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99})


class SnapshotStore:
    """Thread-safe latest-value store between the tap pipeline and the scrape.

    Writers (the collector thread) call :meth:`update_from_summary` and
    :meth:`set_drift`; the scrape calls :meth:`snapshot`. Gauges keep the
    latest value; non-finite counts and histogram counts accumulate, because
    they are exported as counters.
    """

    _SCALARS = {
        "moments": (("mean", "mean"), ("std", "std")),
        "minmax": (("min", "min"), ("max", "max")),
        "abs_max": (("abs_max", "value"),),
        "zero_fraction": (("zero_fraction", "fraction"),),
    }

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        self._layers: dict[tuple[str, str, str], _LayerState] = {}
        self._clock = clock
        # Removed taps (oldest first, bounded): a summary still in flight must
        # not resurrect their series.
        self._gone: dict[str, None] = {}

    def update_from_summary(self, tap_id: str, summary: Any) -> None:
        """Fold one ``layertap.v1.Summary`` into the store.

        Only ``output_index`` 0 of a module's first call in the pass feeds
        the gauges (labels have neither); non-finite counts of every output
        and call add up, so a NaN anywhere in the layer still raises the alert.
        """
        key = (tap_id or summary.tap, summary.layer, point_name(summary.point))
        ts = summary.wall_time.seconds + summary.wall_time.nanos * 1e-9 if summary.HasField("wall_time") else self._clock()
        primary = summary.output_index == 0 and getattr(summary, "call_index", 0) == 0
        with self._lock:
            if key[0] in self._gone:
                return
            st = self._layers.get(key)
            if st is None:
                st = self._layers[key] = _LayerState()
            st.last_update = ts if st.last_update is None else max(st.last_update, ts)
            if primary and not getattr(summary, "unsampled", False):
                # A sampled summary carries everything the tap computes now; a
                # result it no longer carries (reducers changed, e.g. when a
                # baseline froze) must not linger as a stale series.
                kinds = {res.WhichOneof("value") for res in summary.results}
                for kind, fields in self._SCALARS.items():
                    if kind not in kinds:
                        for name, _attr in fields:
                            st.values.pop(name, None)
                if "quantiles" not in kinds:
                    st.quantiles = None
                if "histogram" not in kinds:
                    st.hist_edges = st.hist_counts = None
            for res in summary.results:
                kind = res.WhichOneof("value")
                if kind == "nonfinite":
                    nf = res.nonfinite
                    st.nan_total = (st.nan_total or 0) + nf.nan_count
                    st.inf_total = (st.inf_total or 0) + nf.inf_count
                elif not primary:
                    continue
                elif kind in self._SCALARS:
                    msg = getattr(res, kind)
                    for name, attr in self._SCALARS[kind]:
                        st.values[name] = float(getattr(msg, attr))
                elif kind == "quantiles":
                    q = res.quantiles
                    st.quantiles = {float(p): float(v) for p, v in zip(q.probabilities, q.values)
                                    if round(float(p), 6) in EXPORTED_QUANTILES} or None
                elif kind == "histogram":
                    h = res.histogram
                    edges = tuple(h.edges)
                    counts = np.asarray(h.counts, dtype=np.int64)
                    if counts.shape[0] != len(edges) + 1:
                        continue  # malformed; never let one summary break the scrape
                    if st.hist_edges != edges or st.hist_counts is None:
                        # New edges (e.g. a baseline froze): a fresh counter.
                        st.hist_edges, st.hist_counts = edges, counts
                    else:
                        st.hist_counts = st.hist_counts + counts  # new array: snapshots stay immutable

    def set_drift(
        self,
        tap: str,
        layer: str,
        point: str,
        score: DriftScore | None,
        thresholds: DriftThresholds | None = None,
        channel_fraction: float | None = None,
    ) -> None:
        """Set a layer's drift scores (None while its baseline is collecting).

        Args:
            tap: Tap id (the baseline's tap).
            layer: Module name.
            point: Point label value (``"output"``...).
            score: Current scores, or None to export thresholds only.
            thresholds: Thresholds to export; default ``score.thresholds``.
            channel_fraction: Overrides ``score.channel_drift_fraction``.
        """
        with self._lock:
            if tap in self._gone:
                return
            st = self._layers.setdefault((tap, layer, point), _LayerState())
            st.drift = score
            st.thresholds = thresholds
            st.channel_fraction = channel_fraction

    def remove_tap(self, tap_id: str) -> None:
        """Forget every layer of a deleted or expired tap (its series vanish)."""
        with self._lock:
            self._gone[tap_id] = None
            while len(self._gone) > _MAX_TOMBSTONES:
                del self._gone[next(iter(self._gone))]
            for k in [k for k in self._layers if k[0] == tap_id]:
                del self._layers[k]

    def add_tap(self, tap_id: str) -> None:
        """A tap (possibly reusing a removed tap's name) may export again."""
        with self._lock:
            self._gone.pop(tap_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._layers)

    def snapshot(self) -> list[LayerSnapshot]:
        """An immutable copy of every layer's latest telemetry."""
        out = []
        with self._lock:
            for (tap, layer, point), st in self._layers.items():
                v = st.values
                out.append(
                    LayerSnapshot(
                        tap, layer, point,
                        v.get("mean"), v.get("std"), v.get("min"), v.get("max"), v.get("abs_max"), v.get("zero_fraction"),
                        st.quantiles, st.nan_total, st.inf_total, st.last_update,
                        None if st.hist_edges is None or st.hist_counts is None else (st.hist_edges, st.hist_counts),
                        st.drift, st.thresholds, st.channel_fraction,
                    )
                )
        return out


# ------------------------------------------------------------------ collector


_GAUGES = (
    ("mean", "layertap_activation_mean", "Mean of the activation."),
    ("std", "layertap_activation_std", "Standard deviation of the activation."),
    ("min", "layertap_activation_min", "Smallest activation value."),
    ("max", "layertap_activation_max", "Largest activation value."),
    ("abs_max", "layertap_activation_abs_max", "Largest absolute activation value."),
    ("zero_fraction", "layertap_activation_zero_fraction", "Fraction of activation elements equal to zero."),
)


def _go(v: float) -> str:
    """Go's float formatting for ``le``/``quantile`` labels, as prometheus-client writes them."""
    return str(floatToGoString(v))  # type: ignore[no-untyped-call]


def _escape(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _fmt(v: float) -> str:
    """A sample value as the text format wants it (same output as ``floatToGoString``)."""
    f = float(v)
    if -math.inf < f < 1e6:  # the common case; NaN fails the comparison
        return repr(f)
    return _go(f)  # Go's exponent form from 1e6 up, and the Inf/NaN spellings


class _LabelSet:
    """The ``model, layer, point, tap`` labels of one layer, escaped once and reused."""

    __slots__ = ("labels", "text", "_with", "_prefix")

    def __init__(self, model: str, layer: str, point: str, tap: str) -> None:
        self.labels = {"model": model, "layer": layer, "point": point, "tap": tap}
        self._with: dict[str, tuple[str, str]] = {}
        self._prefix: dict[tuple[str, str, str], str] = {}
        self.text = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(self.labels.items()))

    def prefix(self, name: str, key: str, value: str) -> str:
        """``name{labels} `` of one sample line, cached: the same lines recur every scrape."""
        t = (name, key, value)
        p = self._prefix.get(t)
        if p is None:
            p = self._prefix[t] = f"{name}{{{self.text_with(key, value) if key else self.text}}} "
        return p

    def text_with(self, key: str, value: str) -> str:
        """Label text with one more label, in sorted position (as ``generate_latest`` writes it)."""
        parts = self._with.get(key)
        if parts is None:
            names = sorted(self.labels)
            i = sum(1 for n in names if n < key)
            esc = [f'{n}="{_escape(self.labels[n])}"' for n in names]
            before, after = ",".join(esc[:i]), ",".join(esc[i:])
            parts = self._with[key] = (before + "," if before else "", "," + after if after else "")
        return f'{parts[0]}{key}="{value}"{parts[1]}'


class _RenderedFamily(Metric):
    """A metric family that :func:`render_latest` writes straight from its rows.

    ``generate_latest`` and the parser-based tools still see ordinary
    :class:`Sample` objects: ``samples`` builds them on demand. The fast path
    skips the per-sample label validation and escaping that make
    ``generate_latest`` cost ~7 µs per series.
    """

    def __init__(self, name: str, documentation: str, typ: str) -> None:
        super().__init__(name, documentation, typ)
        # (sample name, labels, extra label name or "", extra label value, value)
        self.rows: list[tuple[str, _LabelSet, str, str, float]] = []

    @property
    def samples(self) -> list[Sample]:
        return [
            Sample(n, {**ls.labels, k: v} if k else dict(ls.labels), val) for n, ls, k, v, val in self.rows
        ]

    @samples.setter
    def samples(self, value: list[Sample]) -> None:
        if value:
            raise AttributeError("_RenderedFamily takes rows, not samples")

    def render(self, out: list[str]) -> None:
        """Append the family in the Prometheus text format 0.0.4."""
        mname = self.name + "_total" if self.type == "counter" else self.name
        out.append(f"# HELP {mname} {self.documentation}\n# TYPE {mname} {self.type}\n")
        append = out.append
        for n, ls, k, v, val in self.rows:
            append(f"{ls.prefix(n, k, v)}{_fmt(val)}\n")


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
        self._admitted: dict[tuple[str, str, str], _LabelSet] = {}
        self._last_dropped = 0
        self._le_cache: dict[tuple[float, ...], tuple[list[int], list[str]]] = {}

    @staticmethod
    def _families() -> dict[str, _RenderedFamily]:
        f = {key: _RenderedFamily(name, doc, "gauge") for key, name, doc in _GAUGES}
        f["quantile"] = _RenderedFamily(
            "layertap_activation_quantile", "Activation quantiles of the latest sampled pass.", "summary"
        )
        f["nonfinite"] = _RenderedFamily("layertap_activation_nonfinite", "NaN and Inf activation elements seen.", "counter")
        f["last_update"] = _RenderedFamily(
            "layertap_activation_last_update_timestamp_seconds", "Unix time of the latest summary of the layer.", "gauge"
        )
        f["drift"] = _RenderedFamily("layertap_activation_drift", "Drift of the layer against its baseline.", "gauge")
        f["threshold"] = _RenderedFamily("layertap_activation_drift_threshold", "Drift threshold per metric.", "gauge")
        f["channel"] = _RenderedFamily(
            "layertap_activation_channel_drift_fraction", "Fraction of channels whose mean drifted.", "gauge"
        )
        f["value"] = _RenderedFamily(
            "layertap_activation_value", "Sampled activation values (bins of the tap's histogram reducer).", "histogram"
        )
        return f

    def describe(self) -> list[Metric]:
        # Names only: lets the registry catch clashes without a scrape.
        d: list[Metric] = list(self._families().values())
        d.append(GaugeMetricFamily("layertap_export_layers_dropped", "", labels=["model"]))
        return d

    def _admit(self, snaps: Iterable[LayerSnapshot]) -> tuple[list[tuple[LayerSnapshot, _LabelSet]], int]:
        by_key = {s.key: s for s in snaps}
        with self._lock:
            for k in [k for k in self._admitted if k not in by_key]:
                del self._admitted[k]
            for k in by_key:
                if k not in self._admitted and len(self._admitted) < self.max_layers:
                    self._admitted[k] = _LabelSet(self.model, k[1], k[2], k[0])
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
            hit = (idx, [_go(edges[i]) for i in idx])
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
                    q_add((q_n, ls, "quantile", _go(p), v))
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
        yield _ModelOnlyFamily(
            "layertap_export_layers_dropped", "Tapped layers not exported because of the layer cap.", self.model, dropped
        )


class _ModelOnlyFamily(_RenderedFamily):
    """A one-sample gauge labelled ``model`` only."""

    def __init__(self, name: str, documentation: str, model: str, value: float) -> None:
        super().__init__(name, documentation, "gauge")
        self._model = model
        self._value = value

    @property
    def samples(self) -> list[Sample]:
        return [Sample(self.name, {"model": self._model}, self._value)]

    @samples.setter
    def samples(self, value: list[Sample]) -> None:
        if value:
            raise AttributeError("read-only")

    def render(self, out: list[str]) -> None:
        out.append(
            f"# HELP {self.name} {self.documentation}\n# TYPE {self.name} {self.type}\n"
            f'{self.name}{{model="{_escape(self._model)}"}} {_fmt(self._value)}\n'
        )


# ---------------------------------------------------------------- exposition


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def render_latest(registry: Collector) -> bytes:
    """Same text as ``generate_latest(registry)``, with a fast path for activation families.

    Families from :class:`ActivationCollector` are written straight from
    their pre-escaped rows; everything else goes through prometheus-client's
    own writer. This is what :func:`start_metrics_server` serves.
    """
    out: list[str] = []
    pending: list[Metric] = []
    for metric in registry.collect():
        if isinstance(metric, _RenderedFamily):
            if pending:
                out.append(generate_latest(_Families(pending)).decode("utf-8"))
                pending = []
            metric.render(out)
        else:
            pending.append(metric)
    if pending:
        out.append(generate_latest(_Families(pending)).decode("utf-8"))
    return "".join(out).encode("utf-8")


def make_metrics_app(registry: Collector) -> Callable[..., list[bytes]]:
    """A WSGI app serving :func:`render_latest` (text format 0.0.4) on any GET path."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
            return [b""]
        if environ.get("PATH_INFO") == "/favicon.ico":
            start_response("404 Not Found", [])
            return [b""]
        body = render_latest(registry)
        start_response("200 OK", [("Content-Type", CONTENT_TYPE_PLAIN_0_0_4), ("Content-Length", str(len(body)))])
        return [body]

    return app


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        """Scrapes every few seconds would flood the log."""


def start_metrics_server(registry: Collector, host: str = "127.0.0.1", port: int = 9466) -> tuple[Any, int]:
    """Serve ``/metrics`` for ``registry`` on a daemon thread.

    Args:
        registry: The injected registry.
        host: Bind address (the gRPC host); IPv6 literals work.
        port: TCP port; 0 picks a free one.

    Returns:
        ``(server, bound_port)``; stop with :func:`stop_metrics_server`.
    """

    class _Server(ThreadingWSGIServer):
        pass  # a subclass, so setting address_family stays local

    _Server.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server = make_server(host, port, make_metrics_app(registry), _Server, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="layertap-metrics", daemon=True)
    thread.start()
    return server, int(server.server_address[1])


def stop_metrics_server(server: Any) -> None:
    """Stop serving and close the socket."""
    server.shutdown()
    server.server_close()
