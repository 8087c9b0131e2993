"""A Prometheus registry that adds constant labels (``rank``) to every series.

Each rank's agent exports the same series names; the label tells them apart
where a scrape config has not relabelled them. Added at collect time, so
every collector (health, per-layer, pipeline) gets it without knowing.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric


class LabelledRegistry(CollectorRegistry):
    """A registry whose samples all carry ``labels`` as well as their own."""

    def __init__(self, labels: Mapping[str, str]) -> None:
        super().__init__(auto_describe=True)
        self._labels = dict(labels)

    def collect(self) -> Iterator[Metric]:
        for metric in super().collect():
            out = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            out.samples = [s._replace(labels={**s.labels, **self._labels}) for s in metric.samples]
            yield out
