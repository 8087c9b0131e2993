"""Self-metrics of the telemetry pipeline, read from its own counters at scrape time.

The transfer thread and the baseline builders already count what they drop,
fail or skip; exporting those counts is what makes a stalled or lossy
pipeline visible, instead of layer series that merely stop moving.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol, TypeVar

from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["PipelineCollector", "TransferStatsLike"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class TransferStatsLike(Protocol):
    """Cumulative counts of the device-to-host transfer (``HostTransfer.stats()``)."""

    @property
    def processed(self) -> int: ...

    @property
    def dropped(self) -> int: ...

    @property
    def errors(self) -> int: ...

    @property
    def pinned_allocations(self) -> int: ...


#: (stats attribute, exposed name, HELP): the HELP says what to conclude.
_TRANSFER_COUNTERS: tuple[tuple[str, str, str], ...] = (
    (
        "processed",
        "layertap_transfer_passes_total",
        "Passes whose tapped values reached the reducers on the host; flat while inference runs means telemetry stalled.",
    ),
    (
        "dropped",
        "layertap_transfer_dropped_passes_total",
        "Passes dropped because the transfer queue was full; rising means the host cannot keep up, so sample less or tap fewer layers.",
    ),
    (
        "errors",
        "layertap_transfer_errors_total",
        "Passes whose host-side reducers failed; any increase means summaries were lost, see the server log.",
    ),
    (
        "pinned_allocations",
        "layertap_pinned_buffers_allocated_total",
        "Pinned host buffers allocated for transfers; should level off after warm-up, steady growth means buffers are not reused.",
    ),
)
#: (counters() key, exposed name, HELP) of the compiled statistics kernel.
_COMPILE_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("compiles", "layertap_reducer_compiles_total",
     "Statistics kernels compiled in the background (one per dtype, layout and mode); should stop rising after warm-up."),
    ("compile_failures", "layertap_reducer_compile_failures_total",
     "Statistics kernels that failed to compile; those tensors use the eager path (slower, same results), see the log."),
    ("compiled_calls", "layertap_reducer_compiled_calls_total",
     "Tapped tensors summarised by a compiled kernel."),
    ("eager_calls", "layertap_reducer_eager_calls_total",
     "Tapped tensors that fell back to the eager path (kernel not ready, failed, or a guard miss); rising after warm-up costs overhead."),
    ("bad_packages", "layertap_reducer_bad_packages_total",
     "Cached compiled-kernel packages that did not load and were rebuilt (a damaged or foreign cache volume)."),
)
_BASELINE_SKIPPED = (
    "layertap_baseline_skipped_passes_total",
    "Passes the baseline builders left out (non-finite or empty); rising means baselines collect slower or from partial data.",
)


class PipelineCollector(Collector):
    """Yields the transfer and baseline counters, each labelled ``model``.

    A source given as None emits nothing, so a server without a transfer
    thread or drift monitor exports no misleading zeros. A source that raises
    is skipped for that scrape (and logged once until it recovers): the rest
    of ``/metrics`` must survive a broken stats call.
    """

    def __init__(
        self,
        model: str,
        transfer: Callable[[], TransferStatsLike] | None = None,
        baseline_skipped: Callable[[], int] | None = None,
        compiled: Callable[[], Mapping[str, int]] | None = None,
    ) -> None:
        """Create the collector (register it with ``registry.register(c)``).

        Args:
            model: Value of the ``model`` label.
            transfer: Returns the transfer's current counts, e.g. ``host_transfer.stats``.
            baseline_skipped: Returns the passes skipped by the baseline builders so far.
            compiled: Returns the compiled kernel's counters, e.g. ``CompiledStats.counters`` (``app.process_compilation().stats``).
        """
        self.model = model
        self._transfer = transfer
        self._baseline_skipped = baseline_skipped
        self._compiled = compiled
        self._failing: set[str] = set()

    def describe(self) -> list[Metric]:
        # Names only: lets the registry catch clashes without calling the sources.
        return [self._family(name, doc) for name, doc in self._exported()]

    def collect(self) -> Iterator[Metric]:
        if self._transfer is not None:
            stats = self._read("transfer", self._transfer)
            if stats is not None:
                for attr, name, doc in _TRANSFER_COUNTERS:
                    yield self._family(name, doc, int(getattr(stats, attr)))
        if self._baseline_skipped is not None:
            skipped = self._read("baseline_skipped", self._baseline_skipped)
            if skipped is not None:
                yield self._family(*_BASELINE_SKIPPED, int(skipped))
        if self._compiled is not None:
            counts = self._read("compiled", self._compiled)
            if counts is not None:
                for key, name, doc in _COMPILE_COUNTERS:
                    yield self._family(name, doc, int(counts[key]))

    def _exported(self) -> list[tuple[str, str]]:
        out = [(name, doc) for _, name, doc in _TRANSFER_COUNTERS] if self._transfer is not None else []
        if self._baseline_skipped is not None:
            out.append(_BASELINE_SKIPPED)
        if self._compiled is not None:
            out += [(name, doc) for _, name, doc in _COMPILE_COUNTERS]
        return out

    def _family(self, name: str, doc: str, value: int | None = None) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=["model"])
        if value is not None:
            family.add_metric([self.model], float(value))
        return family

    def _read(self, source: str, fn: Callable[[], _T]) -> _T | None:
        try:
            value = fn()
        except Exception:  # one broken source must not fail the scrape
            if source not in self._failing:
                self._failing.add(source)
                log.warning("metrics: reading the %s pipeline counts failed; its series are omitted", source, exc_info=True)
            return None
        if source in self._failing:
            self._failing.discard(source)
            log.info("metrics: the %s pipeline counts are exported again", source)
        return value
