"""Self-metrics of a compiled model (``serve --compile-model``), read from its counters at scrape time.

What to watch: ``layertap_passes_total{path="eager"}`` rising while no tap
changes means a live tap or capture keeps passes off the graph (its
``TapServing`` says which); ``layertap_request_thread_compiles_total`` must
stay 0; ``layertap_compiles_total{result="failed"}`` counts graphs that did
not build (the previous one kept serving; the server log says why).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["CompiledModelCollector"]


class CompiledModelCollector(Collector):
    """Exports :meth:`~layertap.server.compile.serving.CompiledServing.counters`.

    Args:
        model: Value of the ``model`` label.
        counters: Returns the current counters by name.
    """

    def __init__(self, model: str, counters: Callable[[], Mapping[str, float]]) -> None:
        self.model = model
        self._counters = counters

    def describe(self) -> list[Metric]:
        return list(self._families(None))

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self._counters())

    def _families(self, c: Mapping[str, float] | None) -> Iterator[Metric]:
        compiles = CounterMetricFamily("layertap_compiles", "Model graphs compiled in the background, by result "
                                       "(ok, failed: the previous graph kept serving).", labels=["model", "result"])
        seconds = CounterMetricFamily("layertap_compile_seconds", "Seconds spent compiling model graphs "
                                      "(background thread, off the request path).", labels=["model"])
        request = CounterMetricFamily("layertap_request_thread_compiles", "Model compiles on any thread but the "
                                      "background compiler's; anything but 0 is a bug.", labels=["model"])
        passes = CounterMetricFamily("layertap_passes", "Infer passes by what ran them: compiled (a graph) or "
                                     "eager (while a graph compiles, or a tap or capture needs hooks).",
                                     labels=["model", "path"])
        variants = GaugeMetricFamily("layertap_compiled_variants", "Compiled model variants (tap sets) live.",
                                     labels=["model"])
        if c is not None:
            compiles.add_metric([self.model, "ok"], float(c["compiles"]))
            compiles.add_metric([self.model, "failed"], float(c["compile_failures"]))
            seconds.add_metric([self.model], float(c["compile_seconds"]))
            request.add_metric([self.model], float(c["request_thread_compiles"]))
            passes.add_metric([self.model, "compiled"], float(c["compiled_passes"]))
            passes.add_metric([self.model, "eager"], float(c["eager_passes"]))
            variants.add_metric([self.model], float(c["variants"]))
        yield from (compiles, seconds, request, passes, variants)
