"""Drift baselines: built incrementally from live passes, frozen, merged, persisted.

Why two phases. A baseline histogram has its inner edges at the reference's
own quantiles, which are unknown until the reference is complete. So:

1. **Collect** (:class:`BaselineBuilder`). Per pass the tap engine feeds a
   bounded float64 sample of the tensor (the sample its ``quantiles`` or
   ``histogram`` reducer already draws), the pass's moments and its min/max.
   The builder keeps

   - moments merged with Chan's parallel formula in float64 (exact to rounding),
   - the observed min and max,
   - a *weighted* reservoir of at most ``reservoir_size`` values (A-Res,
     Efraimidis & Spirakis 2006). Each sampled element weighs
     ``population / sample_size``, so a pass with a bigger batch counts more, as
     it would in the real distribution. A-Res gives every element a key
     ``u^(1/w)`` once and keeps the largest keys, so two reservoirs merge
     exactly by keeping the largest keys of their union: merging builders from
     replicas is the same as one builder having seen all passes.

   Memory is bounded by the reservoir, whatever N is.
2. **Freeze** (:meth:`BaselineBuilder.freeze`). Edges = reservoir quantiles at
   ``linspace(0.05, 0.95, bins - 1)``, deduplicated so they strictly increase
   (a ReLU's many zeros collapse several quantiles into one edge). The
   baseline counts are the reservoir binned on those edges with the reducer's
   convention (bins are ``[e_i, e_{i+1})``, open ends). From then on the tap's
   histogram reducer runs on :attr:`Baseline.edges` and its per-pass counts
   feed a :class:`~layertap.server.drift.scores.SlidingWindow`.

Persistence is one JSON file per (tap, layer, point), never pickle, written
atomically (temporary file in the same directory, fsync, ``os.replace``, fsync
of the directory).
"""

from __future__ import annotations

import builtins  # `feed` shadows min/max with the reducer's field names
import hashlib
import json
import math
import os
import re
import tempfile
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from layertap.server.drift.scores import DRIFT_METRICS, DriftThresholds

__all__ = [
    "BASELINE_SCHEMA",
    "BASELINE_VERSION",
    "DEFAULT_QUANTILES",
    "Baseline",
    "BaselineBuilder",
    "BaselineFormatError",
    "baseline_filename",
    "baseline_from_dict",
    "baseline_to_dict",
    "chan_merge",
    "load_baselines",
    "save_baseline",
]

FloatArray = npt.NDArray[np.float64]

BASELINE_SCHEMA = "layertap.baseline"
BASELINE_VERSION = 1
#: Quantiles stored with every baseline (the quantiles reducer's defaults).
DEFAULT_QUANTILES: tuple[float, ...] = (0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99)


_M = TypeVar("_M", float, "npt.NDArray[np.float64]")


def chan_merge(n_a: float, mean_a: _M, m2_a: _M, n_b: float, mean_b: _M, m2_b: _M) -> tuple[float, _M, _M]:
    """Merge two (count, mean, M2) triples with Chan et al.'s parallel formula.

    ``M2 = Σ (x - mean)^2``. Works element-wise on numpy arrays too.
    """
    n = n_a + n_b
    if n == 0:
        return 0.0, mean_a * 0.0, m2_a * 0.0
    delta = mean_b - mean_a
    mean = mean_a + delta * (n_b / n)
    m2 = m2_a + m2_b + delta * delta * (n_a * n_b / n)
    return n, mean, m2


def _bin(values: FloatArray, edges: FloatArray) -> npt.NDArray[np.int64]:
    """Counts on ``edges`` with the reducer's convention: ``[e_i, e_{i+1})``, open ends."""
    idx = np.searchsorted(edges, values, side="right")
    return np.bincount(idx, minlength=edges.shape[0] + 1).astype(np.int64)


@dataclass(frozen=True, eq=False)
class Baseline:
    """A frozen reference for one (tap, layer, point).

    Attributes:
        tap: Id of the durable tap that holds it (a label on the drift series).
        layer: Module name.
        point: Hook point in lower case (``"output"``, ``"input"``, ...).
        edges: Inner edges, strictly increasing (n).
        counts: int64 counts, n + 1, open end bins first and last.
        count: Elements the moments cover.
        mean: Mean over the reference.
        m2: Σ (x - mean)^2 over the reference (kept so merges are exact).
        min: Smallest value seen.
        max: Largest value seen.
        passes: Live passes in the reference.
        quantiles: ``{probability: value}`` of the reference.
        channel_mean: Per-channel means, or None when channels were not tapped.
        channel_std: Per-channel population stds, same length.
        window: Sliding-window length (passes) drift uses against it.
        thresholds: Drift thresholds for this layer.
        created_at: Unix time the baseline was frozen.
    """

    tap: str
    layer: str
    point: str
    edges: FloatArray
    counts: npt.NDArray[np.int64]
    count: int
    mean: float
    m2: float
    min: float
    max: float
    passes: int
    quantiles: dict[float, float] = field(default_factory=dict)
    channel_mean: FloatArray | None = None
    channel_std: FloatArray | None = None
    window: int = 50
    thresholds: DriftThresholds = field(default_factory=DriftThresholds)
    created_at: float = 0.0

    @property
    def key(self) -> tuple[str, str, str]:
        """``(tap, layer, point)``, the identity of a baseline."""
        return (self.tap, self.layer, self.point)

    @property
    def std(self) -> float:
        """Population std (ddof=0)."""
        return math.sqrt(max(self.m2, 0.0) / self.count) if self.count > 0 else math.nan

    @property
    def proportions(self) -> FloatArray:
        """Counts normalised to sum to 1."""
        total = int(self.counts.sum())
        return self.counts / total if total > 0 else np.zeros(self.counts.shape, dtype=np.float64)

    def merge(self, other: Baseline) -> Baseline:
        """Merge a baseline of the same layer built elsewhere on the same edges.

        Counts add and moments merge exactly (Chan). Quantiles cannot merge
        exactly from their values alone; they become the count-weighted mean
        of both sides, a fair approximation when both references come from
        the same distribution (the replica case). Window, thresholds and tap
        are kept from ``self``.

        Raises:
            ValueError: On a different layer/point or different edges.
        """
        if (self.layer, self.point) != (other.layer, other.point):
            raise ValueError(f"cannot merge baselines of {self.layer}/{self.point} and {other.layer}/{other.point}")
        if self.edges.shape != other.edges.shape or not np.array_equal(self.edges, other.edges):
            raise ValueError(f"cannot merge baselines of {self.layer} with different edges; rebuild one on the other's edges")
        n, mean, m2 = chan_merge(self.count, self.mean, self.m2, other.count, other.mean, other.m2)
        quantiles = {}
        for p in sorted(set(self.quantiles) & set(other.quantiles)):
            quantiles[p] = (self.quantiles[p] * self.count + other.quantiles[p] * other.count) / n if n else self.quantiles[p]
        cmean, cstd = self.channel_mean, self.channel_std
        if (
            cmean is not None and cstd is not None and other.channel_mean is not None
            and other.channel_std is not None and cmean.shape == other.channel_mean.shape
        ):
            c = cmean.shape[0]
            na, nb = self.count / c, other.count / c
            _, cm, cm2 = chan_merge(na, cmean, cstd**2 * na, nb, other.channel_mean, other.channel_std**2 * nb)
            cmean, cstd = np.asarray(cm, dtype=np.float64), np.sqrt(np.asarray(cm2, dtype=np.float64) / (na + nb))
        else:
            cmean = cstd = None
        return replace(
            self,
            counts=self.counts + other.counts,
            count=int(n),
            mean=float(mean),
            m2=float(m2),
            min=min(self.min, other.min),
            max=max(self.max, other.max),
            passes=self.passes + other.passes,
            quantiles=quantiles,
            channel_mean=cmean,
            channel_std=cstd,
        )


class BaselineBuilder:
    """Collects a baseline for one (tap, layer, point), one live pass at a time.

    See the module docstring for why it keeps a weighted reservoir. Not
    thread-safe: the tap engine's collector thread owns it.
    """

    def __init__(
        self,
        tap: str,
        layer: str,
        point: str = "output",
        *,
        passes: int = 100,
        reservoir_size: int = 20_000,
        seed: int | None = None,
    ) -> None:
        """Start collecting.

        Args:
            tap: Tap id.
            layer: Module name.
            point: Hook point, lower case.
            passes: Passes wanted; :attr:`done` turns true after that many.
            reservoir_size: Values kept for the quantile edges.
            seed: Seed of the reservoir's random keys (None: fresh entropy).
        """
        if reservoir_size < 1:
            raise ValueError("reservoir_size must be >= 1")
        self.tap, self.layer, self.point = tap, layer, point
        self.target_passes = int(passes)
        self.reservoir_size = int(reservoir_size)
        self._rng = np.random.default_rng(seed)
        self._values = np.empty(0, dtype=np.float64)
        self._keys = np.empty(0, dtype=np.float64)  # log of the A-Res key
        self.passes = 0
        self.skipped_passes = 0
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0
        self.min = math.inf
        self.max = -math.inf
        self._c_n = 0.0
        self._c_mean: FloatArray | None = None
        self._c_m2: FloatArray | None = None

    @property
    def done(self) -> bool:
        """True once the requested number of passes has been fed."""
        return self.passes >= self.target_passes

    def feed(
        self,
        sample: npt.ArrayLike,
        count: int,
        mean: float,
        std: float,
        min: float,  # noqa: A002 - mirrors the reducer field names
        max: float,  # noqa: A002
        *,
        population: int | None = None,
        channel_mean: npt.ArrayLike | None = None,
        channel_std: npt.ArrayLike | None = None,
    ) -> None:
        """Add one live pass.

        Args:
            sample: Up to S values of the tensor drawn uniformly (any float
                dtype; non-finite values are dropped).
            count: Elements the moments cover (the tensor's numel).
            mean: Mean of the pass.
            std: Population std of the pass (ddof=0).
            min: Smallest value of the pass.
            max: Largest value of the pass.
            population: Elements the sample was drawn from (default ``count``).
            channel_mean: Per-channel means, if tapped.
            channel_std: Per-channel population stds, if tapped.
        """
        if count <= 0 or not (math.isfinite(mean) and math.isfinite(std)):
            # A pass with NaN/Inf must not poison the reference; the nonfinite
            # alert covers it.
            self.skipped_passes += 1
            return
        self.passes += 1
        n, m, m2 = chan_merge(self.count, self.mean, self.m2, int(count), float(mean), float(std) ** 2 * count)
        self.count, self.mean, self.m2 = int(n), float(m), float(m2)
        if math.isfinite(min):
            self.min = builtins.min(self.min, float(min))
        if math.isfinite(max):
            self.max = builtins.max(self.max, float(max))
        s = np.asarray(sample, dtype=np.float64).ravel()
        s = s[np.isfinite(s)]
        if s.size:
            w = float(population if population is not None else count) / s.size
            keys = np.log(self._rng.random(s.size)) / w
            self._keep(np.concatenate((self._values, s)), np.concatenate((self._keys, keys)))
        if channel_mean is not None and channel_std is not None:
            cm = np.asarray(channel_mean, dtype=np.float64)
            cs = np.asarray(channel_std, dtype=np.float64)
            if cm.shape == cs.shape and cm.ndim == 1 and cm.size and (self._c_mean is None or self._c_mean.shape == cm.shape):
                nb = count / cm.size
                if self._c_mean is None or self._c_m2 is None:
                    self._c_n, self._c_mean, self._c_m2 = nb, cm.copy(), cs**2 * nb
                else:
                    c_n, c_m, c_m2 = chan_merge(self._c_n, self._c_mean, self._c_m2, nb, cm, cs**2 * nb)
                    self._c_n, self._c_mean, self._c_m2 = float(c_n), c_m, c_m2

    def _keep(self, values: FloatArray, keys: FloatArray) -> None:
        if values.size > self.reservoir_size:
            top = np.argpartition(keys, values.size - self.reservoir_size)[values.size - self.reservoir_size :]
            values, keys = values[top], keys[top]
        self._values, self._keys = values, keys

    def merge(self, other: BaselineBuilder) -> None:
        """Fold ``other`` (same layer and point, e.g. another replica) into this one."""
        if (self.layer, self.point) != (other.layer, other.point):
            raise ValueError(f"cannot merge builders of {self.layer}/{self.point} and {other.layer}/{other.point}")
        n, m, m2 = chan_merge(self.count, self.mean, self.m2, other.count, other.mean, other.m2)
        self.count, self.mean, self.m2 = int(n), float(m), float(m2)
        self.passes += other.passes
        self.skipped_passes += other.skipped_passes
        self.min = builtins.min(self.min, other.min)
        self.max = builtins.max(self.max, other.max)
        self._keep(np.concatenate((self._values, other._values)), np.concatenate((self._keys, other._keys)))
        if other._c_mean is not None and other._c_m2 is not None:
            if self._c_mean is None or self._c_m2 is None:
                self._c_n, self._c_mean, self._c_m2 = other._c_n, other._c_mean.copy(), other._c_m2.copy()
            elif self._c_mean.shape == other._c_mean.shape:
                n, cm, cm2 = chan_merge(self._c_n, self._c_mean, self._c_m2, other._c_n, other._c_mean, other._c_m2)
                self._c_n, self._c_mean, self._c_m2 = float(n), np.asarray(cm), np.asarray(cm2)

    @property
    def reservoir(self) -> FloatArray:
        """The values currently kept (a copy, unordered)."""
        return self._values.copy()

    def freeze(
        self,
        *,
        bins: int = 20,
        edge_range: tuple[float, float] = (0.05, 0.95),
        probabilities: tuple[float, ...] = DEFAULT_QUANTILES,
        window: int = 50,
        thresholds: DriftThresholds | None = None,
    ) -> Baseline:
        """Freeze the reference: place edges at its quantiles and bin the reservoir.

        Args:
            bins: Bins including the two open end bins (``bins - 1`` inner edges).
            edge_range: Probabilities of the first and last inner edge.
            probabilities: Quantiles to store.
            window: Sliding window drift will use.
            thresholds: Drift thresholds (defaults when None).

        Raises:
            ValueError: When no usable pass or value was fed.
        """
        if self.count <= 0 or self._values.size == 0:
            raise ValueError(f"baseline for {self.layer} has no data yet ({self.passes} passes fed)")
        if bins < 2:
            raise ValueError("bins must be >= 2")
        v = self._values
        edges = np.unique(np.quantile(v, np.linspace(edge_range[0], edge_range[1], bins - 1)))
        q = np.quantile(v, np.asarray(probabilities, dtype=np.float64)) if probabilities else np.empty(0)
        c_std = None
        if self._c_mean is not None and self._c_m2 is not None and self._c_n > 0:
            c_std = np.sqrt(np.maximum(self._c_m2, 0.0) / self._c_n)
        return Baseline(
            tap=self.tap,
            layer=self.layer,
            point=self.point,
            edges=edges.astype(np.float64),
            counts=_bin(v, edges),
            count=self.count,
            mean=self.mean,
            m2=self.m2,
            min=self.min if math.isfinite(self.min) else float(v.min()),
            max=self.max if math.isfinite(self.max) else float(v.max()),
            passes=self.passes,
            quantiles={float(p): float(x) for p, x in zip(probabilities, q)},
            channel_mean=None if self._c_mean is None else self._c_mean.copy(),
            channel_std=c_std,
            window=int(window),
            thresholds=thresholds or DriftThresholds(),
            created_at=time.time(),
        )


# ---------------------------------------------------------------- persistence


class BaselineFormatError(ValueError):
    """A baseline document that must be refused."""


def baseline_to_dict(b: Baseline) -> dict[str, Any]:
    """The JSON document for ``b`` (schema ``layertap.baseline`` v1)."""
    return {
        "schema": BASELINE_SCHEMA,
        "version": BASELINE_VERSION,
        "tap": b.tap,
        "layer": b.layer,
        "point": b.point,
        "edges": [float(x) for x in b.edges],
        "counts": [int(x) for x in b.counts],
        "count": int(b.count),
        "mean": float(b.mean),
        "m2": float(b.m2),
        "min": float(b.min),
        "max": float(b.max),
        "passes": int(b.passes),
        "quantiles": [[float(p), float(v)] for p, v in sorted(b.quantiles.items())],
        "channel_mean": None if b.channel_mean is None else [float(x) for x in b.channel_mean],
        "channel_std": None if b.channel_std is None else [float(x) for x in b.channel_std],
        "window": int(b.window),
        "thresholds": b.thresholds.as_dict(),
        "created_at": float(b.created_at),
    }


def _num(d: Mapping[str, Any], key: str, kind: type = float) -> Any:
    v = d.get(key)
    if kind is int:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise BaselineFormatError(f"field {key!r} must be a non-negative integer, got {v!r}")
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise BaselineFormatError(f"field {key!r} must be a finite number, got {v!r}")
    return float(v)


def _floats(d: Mapping[str, Any], key: str) -> FloatArray:
    v = d.get(key)
    if not isinstance(v, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        raise BaselineFormatError(f"field {key!r} must be a list of numbers")
    a = np.asarray(v, dtype=np.float64)
    if not np.all(np.isfinite(a)):
        raise BaselineFormatError(f"field {key!r} holds non-finite values")
    return a


def baseline_from_dict(d: Any, known_layers: Collection[str] | Mapping[str, int | None] | None = None) -> Baseline:
    """Validate a JSON document and build the :class:`Baseline`.

    Args:
        d: The parsed JSON.
        known_layers: Layer names the model has; a mapping may also give the
            expected channel count per layer (None: unchecked).

    Raises:
        BaselineFormatError: With a one-line reason.
    """
    if not isinstance(d, dict):
        raise BaselineFormatError("top level is not a JSON object")
    if d.get("schema") != BASELINE_SCHEMA:
        raise BaselineFormatError(f"schema is {d.get('schema')!r}, expected {BASELINE_SCHEMA!r}")
    if d.get("version") != BASELINE_VERSION:
        raise BaselineFormatError(f"schema version {d.get('version')!r} is not supported (expected {BASELINE_VERSION})")
    for key in ("tap", "layer", "point"):
        if not isinstance(d.get(key), str) or not d[key]:
            raise BaselineFormatError(f"field {key!r} must be a non-empty string")
    layer = d["layer"]
    if known_layers is not None and layer not in known_layers:
        raise BaselineFormatError(f"unknown layer {layer!r}: the served model has no such module")
    edges = _floats(d, "edges")
    if edges.size == 0:
        raise BaselineFormatError("edges is empty")
    if edges.size > 1 and not np.all(np.diff(edges) > 0):
        raise BaselineFormatError("edges are not strictly increasing")
    raw_counts = d.get("counts")
    if not isinstance(raw_counts, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in raw_counts):
        raise BaselineFormatError("field 'counts' must be a list of non-negative integers")
    if len(raw_counts) != edges.size + 1:
        raise BaselineFormatError(f"counts has {len(raw_counts)} entries, expected {edges.size + 1} for {edges.size} edges")
    counts = np.asarray(raw_counts, dtype=np.int64)
    if counts.sum() <= 0:
        raise BaselineFormatError("counts are all zero")
    count = _num(d, "count", int)
    passes = _num(d, "passes", int)
    window = _num(d, "window", int)
    if count <= 0 or window <= 0:
        raise BaselineFormatError("count and window must be positive")
    mean, m2, lo, hi = (_num(d, k) for k in ("mean", "m2", "min", "max"))
    if m2 < 0 or lo > hi:
        raise BaselineFormatError("m2 is negative or min > max")
    qs = d.get("quantiles")
    if not isinstance(qs, list) or not all(
        isinstance(x, list) and len(x) == 2 and all(isinstance(y, (int, float)) and not isinstance(y, bool) and math.isfinite(y) for y in x)
        for x in qs
    ):
        raise BaselineFormatError("field 'quantiles' must be a list of [probability, value] pairs")
    quantiles = {float(p): float(v) for p, v in qs}
    if any(not 0.0 <= p <= 1.0 for p in quantiles):
        raise BaselineFormatError("a quantile probability is outside [0, 1]")
    cmean = cstd = None
    if d.get("channel_mean") is not None or d.get("channel_std") is not None:
        cmean, cstd = _floats(d, "channel_mean"), _floats(d, "channel_std")
        if cmean.shape != cstd.shape or cmean.size == 0:
            raise BaselineFormatError(f"channel_mean has {cmean.size} entries but channel_std {cstd.size}")
        if isinstance(known_layers, Mapping):
            want = known_layers.get(layer)
            if want is not None and want != cmean.size:
                raise BaselineFormatError(f"layer {layer!r} has {want} channels but the baseline {cmean.size}")
    th = d.get("thresholds")
    if not isinstance(th, dict):
        raise BaselineFormatError("field 'thresholds' must be an object")
    try:
        thresholds = DriftThresholds(**{m: _num(th, m) for m in DRIFT_METRICS})
    except ValueError as exc:
        raise BaselineFormatError(f"thresholds: {exc}") from None
    created = d.get("created_at", 0.0)
    return Baseline(
        tap=d["tap"], layer=layer, point=d["point"], edges=edges, counts=counts, count=count,
        mean=mean, m2=m2, min=lo, max=hi, passes=passes, quantiles=quantiles,
        channel_mean=cmean, channel_std=cstd, window=window, thresholds=thresholds,
        created_at=float(created) if isinstance(created, (int, float)) else 0.0,
    )


def baseline_filename(b: Baseline) -> str:
    """A stable, filesystem-safe file name for ``b``'s (tap, layer, point)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{b.layer}.{b.point}")[:120]
    digest = hashlib.sha256("\0".join(b.key).encode()).hexdigest()[:12]
    return f"baseline-{safe}-{digest}.json"


def save_baseline(path_dir: str | os.PathLike[str], baseline: Baseline) -> Path:
    """Write ``baseline`` atomically as JSON into ``path_dir`` (created if needed).

    A crash leaves either the old file or the new one, never a torn file: the
    document goes to a temporary file in the same directory, is fsynced, and
    replaces the target with ``os.replace``; the directory is fsynced so the
    rename itself survives power loss.

    Returns:
        The path written.

    Raises:
        ValueError: When the baseline holds non-finite numbers.
        OSError: When the directory is not writable.
    """
    d = Path(path_dir)
    d.mkdir(parents=True, exist_ok=True)
    target = d / baseline_filename(baseline)
    text = json.dumps(baseline_to_dict(baseline), allow_nan=False, indent=1)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=d)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:
        dfd = os.open(d, os.O_RDONLY)
    except OSError:  # e.g. platforms without directory fds
        return target
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return target


def _reject_constant(name: str) -> Any:
    raise BaselineFormatError(f"non-finite number {name} in JSON")


def load_baselines(
    path_dir: str | os.PathLike[str],
    known_layers: Collection[str] | Mapping[str, int | None] | None = None,
) -> tuple[list[Baseline], list[str]]:
    """Load every ``*.json`` baseline in ``path_dir``; never raises for a bad file.

    Args:
        path_dir: The ``--baseline-dir``; a missing directory loads nothing.
        known_layers: Module names of the served model (a mapping may add the
            expected channel count per layer); None accepts any layer.

    Returns:
        ``(baselines, errors)``: one one-line message per refused file, for the
        server to log and count in ``layertap_baseline_load_errors_total``.
    """
    d = Path(path_dir)
    if not d.is_dir():
        return [], []
    out: list[Baseline] = []
    errors: list[str] = []
    seen: set[tuple[str, str, str]] = set()
    for p in sorted(d.glob("*.json")):
        if p.name.startswith(".tmp-"):
            continue  # a write interrupted before os.replace
        try:
            doc = json.loads(p.read_text(encoding="utf-8"), parse_constant=_reject_constant)
            b = baseline_from_dict(doc, known_layers)
            if b.key in seen:
                raise BaselineFormatError(f"duplicate baseline for tap {b.tap!r} layer {b.layer!r} point {b.point!r}")
            seen.add(b.key)
            out.append(b)
        except json.JSONDecodeError as exc:
            errors.append(f"baseline file {p} refused: corrupt JSON ({exc.msg} at line {exc.lineno} column {exc.colno})")
        except (BaselineFormatError, UnicodeDecodeError, OSError, ValueError, TypeError, RecursionError) as exc:
            errors.append(f"baseline file {p} refused: {exc}")
    return out, errors
