"""Drift thresholds and the table of metric names.

A leaf module: baselines carry thresholds and scores compare against them, so
both import from here and never from each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["DRIFT_METRICS", "DriftThresholds"]


@dataclass(frozen=True)
class DriftThresholds:
    """Per-tap thresholds; a score strictly above its threshold counts as drift.

    The field order is the metric order everywhere (:data:`DRIFT_METRICS`).
    """

    psi: float = 0.2
    js: float = 0.1
    wasserstein: float = 0.1
    mean_shift: float = 1.0

    def __post_init__(self) -> None:
        for name in DRIFT_METRICS:
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"drift threshold {name} must be a positive finite number, got {v!r}")

    @classmethod
    def from_fields(cls, psi: float = 0.0, js: float = 0.0, wasserstein: float = 0.0, mean_shift: float = 0.0) -> DriftThresholds:
        """Build from proto-style fields where 0 (or anything non-positive) means "default"."""
        given = {"psi": psi, "js": js, "wasserstein": wasserstein, "mean_shift": mean_shift}
        default = cls().as_dict()
        return cls(**{m: float(v) if math.isfinite(v) and v > 0 else default[m] for m, v in given.items()})

    @classmethod
    def from_message(cls, msg: Any) -> DriftThresholds:
        """From a ``layertap.v1.DriftThresholds`` (duck-typed; zero fields take defaults)."""
        return cls.from_fields(**{m: getattr(msg, m) for m in DRIFT_METRICS})

    def as_dict(self) -> dict[str, float]:
        """``{metric: threshold}`` in ``DRIFT_METRICS`` order."""
        return {m: float(getattr(self, m)) for m in DRIFT_METRICS}


#: Order of the four scores everywhere (labels, dicts, LayerDrift fields);
#: the metric label values of ``layertap_activation_drift``.
DRIFT_METRICS: tuple[str, ...] = tuple(f.name for f in fields(DriftThresholds))
