"""Reducer specs: names, parameter defaults and bounds, validated once host-side."""

from __future__ import annotations

#: Quantile probabilities used when a spec gives none; baselines and the
#: exported ``quantile`` label values use the same set.
DEFAULT_PROBABILITIES: tuple[float, ...] = (0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99)
