"""The ``layertap.baseline`` JSON document: written from, and validated into, a Baseline.

Baseline files come from disk and from other replicas, so every field is
checked and a refusal carries a one-line reason for the operator.

Versions. v1 has no phase: its baseline was frozen from plain forward
passes. v2 adds ``"phase"`` (``"forward"``, ``"prefill"`` or ``"decode"``,
:mod:`.phases`). v3 adds the alarm's null statistics (``"null"``) and
``"fixed"``, and always names the phase. v4 is v3 and ``"derive"``: the name
(``"entropy"``, ``"top1_prob"``, ``reducers.derive.DERIVE_NAMES``) of the
quantity the baseline's tap reads in place of the tensor. All four load. A
document is written at the lowest version that holds it: a forward baseline
without null statistics stays v1, byte for byte what v1 servers wrote, so a
server rolled back, or an older replica of a fleet (frozen documents travel
between replicas), still loads it; prefill and decode baselines without them
are v2, a baseline with them v3, and only a derived baseline, which a server
before v4 would load as the tensor's own and score on the wrong quantity, is
v4. A document that names a field of a later version is refused for the same
reason: a v1 document with a phase (an older server would read it as a
forward baseline), a v3 one with a derive. A v4 document without a known
derive, or with per-feature statistics (a derived tensor has no features),
is refused.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from layertap.server.drift.baseline import Baseline
from layertap.server.drift.null import MAX_PASSES, MIN_WINDOWS, NullModel
from layertap.server.drift.phases import FORWARD, PHASE_BY_NAME
from layertap.server.drift.thresholds import DRIFT_METRICS, DriftThresholds
from layertap.server.host.hooks import POINT_BY_NAME
from layertap.server.reducers.derive import DERIVE_NAMES
from layertap.server.reducers.spec import MAX_BINS, MAX_CHANNELS

__all__ = [
    "BASELINE_SCHEMA",
    "BASELINE_VERSION",
    "BASELINE_VERSIONS",
    "BaselineFormatError",
    "KnownLayers",
    "baseline_from_dict",
    "baseline_to_dict",
]

FloatArray = npt.NDArray[np.float64]
#: Layer names the served model has; a mapping may add each layer's expected
#: channel count (None: unchecked).
KnownLayers: TypeAlias = Collection[str] | Mapping[str, int | None]

BASELINE_SCHEMA = "layertap.baseline"
#: The newest version (the one with ``derive``).
BASELINE_VERSION = 4
#: Versions this build reads.
BASELINE_VERSIONS = (1, 2, 3, 4)
#: The wire value of each derive by the name a v4 document gives it.
_DERIVE_BY_NAME = {name: value for value, name in DERIVE_NAMES.items()}
#: The null statistics a derived baseline without them is written with (v4 holds a null, as v3 does).
_NO_NULL = "saved without null statistics: set the baseline again to calibrate its alarm"


class BaselineFormatError(ValueError):
    """A baseline document that must be refused."""


def baseline_to_dict(b: Baseline) -> dict[str, Any]:
    """The JSON document for ``b``: v4 for a derived baseline; else v3 with its null statistics, and
    without them v1 for a forward baseline, v2 for another phase.

    Raises:
        ValueError: ``b.derive`` is not a derive this build knows.
    """
    if b.derive and b.derive not in DERIVE_NAMES:
        raise ValueError(f"baseline {b.tap}/{b.layer}: unknown derive {b.derive}")
    null = b.null if b.null is not None or not b.derive else NullModel.uncalibrated(_NO_NULL, b.window)
    doc: dict[str, Any] = {
        "schema": BASELINE_SCHEMA,
        "version": 4 if b.derive else 3 if null is not None else 1 if b.phase == FORWARD else 2,
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
    if b.phase != FORWARD or null is not None:
        doc["phase"] = b.phase
    if null is not None:
        doc["null"] = null.as_dict()
        doc["fixed"] = bool(b.fixed)
    if b.derive:
        doc["derive"] = DERIVE_NAMES[b.derive]
    return doc


def _null_from_dict(d: Any) -> NullModel:
    """The null block of a v3 document; every integer bounded, so arming its alarm cannot overflow.

    A block that is well-formed but cannot be tested (every std zero, no window) loads uncalibrated,
    with the reason.
    """
    if not isinstance(d, dict):
        raise BaselineFormatError("field 'null' must be an object")
    why = d.get("reason", "")
    if not isinstance(why, str):
        raise BaselineFormatError("field 'null.reason' must be a string")
    mean, std = _floats(d, "mean"), _floats(d, "std")
    if mean.shape != std.shape or np.any(std < 0):
        raise BaselineFormatError(f"null: mean has {mean.size} entries, std {std.size}, or a std is negative")
    passes, window, windows, features = (_num(d, k, int) for k in ("passes", "window", "windows", "features"))
    for key, value, most in (("passes", passes, MAX_PASSES), ("window", window, MAX_PASSES),
                             ("windows", windows, MAX_PASSES), ("features", features, MAX_CHANNELS)):
        if value > most:
            raise BaselineFormatError(f"field 'null.{key}' is {str(value)[:20]}, at most {most}")
    if mean.size > 2 * MAX_CHANNELS + 2:
        raise BaselineFormatError(f"null: {mean.size} components, at most {2 * MAX_CHANNELS + 2}")
    dispersion = _num(d, "dispersion")
    unit = _num(d, "unit") if "unit" in d else 1.0
    if not why and (mean.size != 2 * features + 2 or passes < 2 or window < 1 or windows > passes
                    or not 0 <= dispersion <= 1e6 or not unit > 0):
        raise BaselineFormatError(f"null: {mean.size} components for {features} features, {passes} passes, "
                                  f"window {window}, {windows} windows, dispersion {dispersion}, unit {unit}: "
                                  "not a calibrated null")
    if not why and "unit" not in d:  # the first v3 files: unweighted passes, spreads as stds
        why = ("null statistics saved by an earlier layertap (unweighted passes, per-pass stds): "
               "set the baseline again to calibrate")
    if not why and windows < MIN_WINDOWS:
        why = f"the file's null statistics hold {windows} window(s), calibration needs {MIN_WINDOWS}"
    if not why and not np.any(std > 0):
        why = "every feature is constant in the baseline"
    return NullModel(mean, std, passes, max(window, 1), windows, dispersion, features, why[:500],
                     unit=unit if unit > 0 else 1.0)


def _derive_from_dict(d: Mapping[str, Any], version: int) -> int:
    """The ``pb.Derive`` value a document names: v4 must name a known one, earlier versions none (0)."""
    if version < 4:
        if "derive" in d:
            raise BaselineFormatError("field 'derive' needs schema version 4 "
                                      "(an older reader takes it for the tensor's own baseline)")
        return 0
    named = d.get("derive")
    if not isinstance(named, str) or named not in _DERIVE_BY_NAME:
        raise BaselineFormatError(f"derive {named!r:.40} is not one of {', '.join(_DERIVE_BY_NAME)} "
                                  "(schema version 4 names the derived quantity)")
    return _DERIVE_BY_NAME[named]


def _check_null_features(null: NullModel, layer: str, channels: int | None) -> NullModel:
    """``null`` uncalibrated (with the reason) when its features are not the layer's tested features.

    A live pass has ``2 F + 2`` components, ``F`` the layer's channels capped at ``MAX_CHANNELS``; a null
    of another count would leave every pass out while saying ``calibrated``.
    """
    if channels is None or not null.calibrated:
        return null
    want = min(channels, MAX_CHANNELS)
    if null.features in (0, want):
        return null  # 0: a baseline of a derived tensor, or one read without per-feature statistics
    return dataclasses.replace(null, reason=(f"the null statistics cover {null.features} features, layer {layer!r} "
                                             f"has {want} tested: set the baseline again to calibrate"))


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


def baseline_from_dict(d: Any, known_layers: KnownLayers | None = None) -> Baseline:
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
    version = d.get("version")
    if isinstance(version, bool) or version not in BASELINE_VERSIONS:
        raise BaselineFormatError(f"schema version {version!r} is not supported "
                                  f"(expected one of {', '.join(map(str, BASELINE_VERSIONS))})")
    null: NullModel | None = None
    fixed = False
    derive = _derive_from_dict(d, version)
    if version >= 3:
        null = _null_from_dict(d.get("null"))
        fixed = d.get("fixed", False)
        if not isinstance(fixed, bool):
            raise BaselineFormatError("field 'fixed' must be true or false")
    elif "null" in d:
        raise BaselineFormatError("field 'null' needs schema version 3")
    if version == 1:
        if "phase" in d:
            raise BaselineFormatError("field 'phase' needs schema version 2 (a v1 reader takes it for a forward baseline)")
        phase = FORWARD
    else:
        named = d.get("phase")
        if not isinstance(named, str) or named not in PHASE_BY_NAME:
            raise BaselineFormatError(f"phase {named!r:.40} is not one of {', '.join(PHASE_BY_NAME)}")
        phase = named
    for key in ("tap", "layer", "point"):
        if not isinstance(d.get(key), str) or not d[key]:
            raise BaselineFormatError(f"field {key!r} must be a non-empty string")
    if d["point"] not in POINT_BY_NAME:
        raise BaselineFormatError(f"point {d['point'][:40]!r} is not one of {', '.join(POINT_BY_NAME)}")
    layer = d["layer"]
    if known_layers is not None and layer not in known_layers:
        raise BaselineFormatError(f"unknown layer {layer!r}: the served model has no such module")
    edges = _floats(d, "edges")
    if edges.size == 0:
        raise BaselineFormatError("edges is empty")
    if edges.size > MAX_BINS + 1:  # the histogram the baseline's tap will run
        raise BaselineFormatError(f"{edges.size} edges, at most {MAX_BINS + 1}")
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
    if derive and (cmean is not None or (null is not None and null.features > 0)):
        raise BaselineFormatError(f"a baseline of derive {DERIVE_NAMES[derive]!r} has no per-feature statistics "
                                  "(channel_mean or null features): a derived tensor has no features")
    if null is not None and isinstance(known_layers, Mapping):
        null = _check_null_features(null, layer, known_layers.get(layer))
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
        created_at=float(created) if isinstance(created, (int, float)) else 0.0, phase=phase, null=null, fixed=fixed,
        derive=derive,
    )
