"""Stream admission as metrics: open streams and refusals per pool, read at scrape time.

A refusal means a client was turned away (``--max-streams``); a pool that
stays full is the signal to raise the limit or find who holds the streams.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["StreamsCollector"]


class StreamsCollector(Collector):
    """``layertap_streams_open`` and ``layertap_streams_refused_total``, labelled ``model`` and ``pool``.

    Args:
        model: Value of the ``model`` label.
        pools: ``pool name -> () -> (open, refused)``, e.g. ``workers`` and ``callbacks``.
    """

    def __init__(self, model: str, pools: Mapping[str, Callable[[], tuple[int, int]]]) -> None:
        self.model = model
        self._pools = dict(pools)

    def describe(self) -> list[Metric]:
        return list(self._families())

    def collect(self) -> Iterator[Metric]:
        open_, refused = self._families()
        for pool, read in self._pools.items():
            n_open, n_refused = read()
            open_.add_metric([self.model, pool], float(n_open))
            refused.add_metric([self.model, pool], float(n_refused))
        yield open_
        yield refused

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, CounterMetricFamily]:
        labels = ["model", "pool"]
        return (GaugeMetricFamily("layertap_streams_open", "Long streams admitted and not yet ended, by pool.",
                                  labels=labels),
                CounterMetricFamily("layertap_streams_refused", "Long streams refused because their pool was full "
                                    "(--max-streams); rising means clients are turned away.", labels=labels))
