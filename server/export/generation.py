"""Generation self-metrics: time to first token, inter-token latency, tokens, running and cancelled generations.

Named as vLLM names its own (time to first token, inter-token latency), under
``layertap_generate_``. The Generate step loop calls these once per step,
never per token: a batched decode step gives each running sequence one token,
all the same ``seconds`` after their previous one, so :meth:`GenerationMetrics.inter_token`
takes the step's time and how many tokens it produced. prometheus-client's
``Histogram`` records one observation per call, so both latency histograms are
:class:`StepHistogram`, a collector that adds ``count`` observations of one
value with one bucket search and one lock, read at scrape time. Its
exposition is the one ``Histogram`` writes (buckets, ``_count``, ``_sum``),
without ``_created``.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from layertap.server.export.series import go_float

__all__ = ["INTER_TOKEN_BUCKETS", "TIME_TO_FIRST_TOKEN_BUCKETS", "GenerationMetrics", "StepHistogram"]

#: A prompt's prefill on a small CPU model takes milliseconds, on a long prompt and a big model seconds.
TIME_TO_FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
#: One decode step: about a millisecond for a small model, up to seconds for a large batch on a CPU.
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


class StepHistogram(Collector):
    """A histogram labelled ``model`` that records ``count`` equal observations in one call.

    Thread-safe; register it with ``registry.register(h)``.
    """

    def __init__(self, name: str, documentation: str, model: str, buckets: Sequence[float]) -> None:
        bounds = [float(b) for b in buckets]
        if not bounds or bounds != sorted(set(bounds)) or bounds[-1] == float("inf"):
            raise ValueError("buckets must be finite and strictly increasing (+Inf is added)")
        self.name, self.documentation, self.model = name, documentation, model
        self._bounds = bounds
        self._les = [*map(go_float, bounds), "+Inf"]
        self._lock = threading.Lock()
        #: Observations per bucket, not cumulative: the last is above every bound.
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """Record ``count`` observations of ``value`` (seconds: not negative; NaN is dropped)."""
        if count <= 0 or not value >= 0.0:
            return
        i = bisect_left(self._bounds, value)  # le is inclusive: the first bound >= value
        with self._lock:
            self._counts[i] += count
            self._sum += value * count

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=["model"])

    def describe(self) -> list[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for le, n in zip(self._les, counts):
            running += n
            cumulative.append((le, float(running)))
        family = self._family()
        family.add_metric([self.model], cumulative, total)
        yield family


class GenerationMetrics:
    """The Generate RPC's self-metrics on the server's registry, all labelled ``model``.

    The step loop calls :meth:`started` when a generation is admitted,
    :meth:`first_token` once its prefill's token is out, then per decode step
    :meth:`inter_token` and :meth:`tokens`, and :meth:`finished` once it ends
    (``cancelled`` when the client went away or cancelled it).
    """

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        """Create and register the families.

        Args:
            registry: Where to register (never the global one implicitly).
            model_name: Value of the ``model`` label.
        """
        m = ("model",)
        self.time_to_first_token_seconds = StepHistogram(
            "layertap_generate_time_to_first_token_seconds",
            "Seconds from a Generate request's arrival to its first new token (its prefill's).",
            model_name, TIME_TO_FIRST_TOKEN_BUCKETS)
        self.inter_token_seconds = StepHistogram(
            "layertap_generate_inter_token_seconds",
            "Seconds between two tokens of one sequence: one observation per token of each decode step.",
            model_name, INTER_TOKEN_BUCKETS)
        registry.register(self.time_to_first_token_seconds)
        registry.register(self.inter_token_seconds)
        self._tokens = Counter("layertap_generate_tokens", "New tokens generated, every sequence together.", m,
                               registry=registry).labels(model_name)
        self._active = Gauge("layertap_generate_active", "Generations running now.", m,
                             registry=registry).labels(model_name)
        self._cancelled = Counter("layertap_generate_cancelled",
                                  "Generations that ended before their stop condition: cancelled, or their client left.",
                                  m, registry=registry).labels(model_name)

    def first_token(self, seconds: float) -> None:
        """A request's first token is out, ``seconds`` after the request arrived."""
        self.time_to_first_token_seconds.observe(seconds)

    def inter_token(self, seconds: float, count: int) -> None:
        """One decode step produced ``count`` tokens, each ``seconds`` after its sequence's previous one."""
        self.inter_token_seconds.observe(seconds, count)

    def tokens(self, n: int) -> None:
        """``n`` new tokens (a step's, or a prefill's first tokens)."""
        if n > 0:
            self._tokens.inc(n)

    def started(self) -> None:
        """A generation was admitted and runs."""
        self._active.inc()

    def finished(self, cancelled: bool) -> None:
        """A generation ended; ``cancelled`` when it did not reach its stop condition."""
        self._active.dec()
        if cancelled:
            self._cancelled.inc()
