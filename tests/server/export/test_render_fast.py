"""The render fast paths (bulk counts, runs of equal values, column reads, cached health text) against prometheus-client."""

from __future__ import annotations

import math

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from layertap.server.drift.scores import DriftScore
from layertap.server.drift.thresholds import DriftThresholds
from layertap.server.export.activations import ActivationCollector
from layertap.server.export.exposition import render_latest, render_openmetrics
from layertap.server.export.series import Lines, fmt_count
from layertap.server.export.snapshots import LayerSnapshot

pytestmark = pytest.mark.unit

TRICKY = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1e6, 1e21, 5e-324, 1.7e9 + 0.25, 1.7e9 + 0.25, -0.0, -0.0,
          0.0, 2.0**53 + 2, 123456789.0, 3, 999_999, -7, 0.1]
COUNTS = [0, 1, 999_999, 1_000_000, 1_234_500, 10**8, 123_456_789, 2**53 - 1, 2**53, 2**53 + 1, 10**17 + 3,
          10**22, -1, -(10**7)]
WEIRD = ['we"ird', "back\\slash", "new\nline", "ünï—コード"]


def expected(values: list) -> str:
    return "".join(f"m{i} {floatToGoString(v)}\n" for i, v in enumerate(values))


@pytest.mark.parametrize("n", COUNTS)
def test_fmt_count_is_float_to_go_string(n: int) -> None:
    assert fmt_count(n) == floatToGoString(n)


@pytest.mark.parametrize("values", [COUNTS, [0, 5, 999_999], [7] * 5, []])
def test_fill_counts_matches_prometheus_client(values: list[int]) -> None:
    lines = Lines([f"m{i} " for i in range(len(values))])
    assert lines.fill_counts(values) == expected(values)
    assert lines.fill_counts(list(reversed(values))) == expected(list(reversed(values)))


def test_fill_matches_prometheus_client_on_tricky_values_and_runs() -> None:
    """Runs of equal values are written once; 0.0/-0.0 and NaN runs must not borrow a neighbour's text."""
    for values in (TRICKY, list(reversed(TRICKY)), [0.0, -0.0, 0.0, -0.0, 1e7], [-0.0, 0.0, 1e7], [1.7e9] * 4):
        lines = Lines([f"m{i} " for i in range(len(values))])
        assert lines.fill(values) == expected(values)
        flipped = [-v if v == 0 else v for v in values]  # equal lists that print apart
        assert lines.fill(flipped) == expected(flipped)


def snap(i: int, bins: int, layer: str, scale: int = 1, quantiles: dict[float, float] | None = None) -> LayerSnapshot:
    rng = np.random.default_rng(i)
    edges = tuple(np.sort(rng.normal(size=bins - 1)).tolist())
    counts = rng.integers(0, 1000, bins) * scale
    drift = DriftScore(*rng.random(4).tolist(), thresholds=DriftThresholds(), channel_drift_fraction=math.nan)
    return LayerSnapshot("t", layer, "output", mean=float(rng.normal()), std=-0.0 if i % 2 else 0.0,
                         max=math.inf if i == 1 else 1e21, zero_fraction=5e-324, l2=float(i) * 1e6, nan_total=i, inf_total=None,
                         last_update=1.7e9, quantiles=quantiles, histogram=(edges, counts), drift=drift)


@pytest.mark.parametrize("bins", [[6, 6, 6], [6, 9, 6], [40, 40, 40], [40, 30, 40]])
def test_column_reads_match_prometheus_client(bins: list[int]) -> None:
    """Same-width, mixed-width and capped histograms; unsorted quantiles; escaping labels; absent series."""
    snaps = [snap(i, b, WEIRD[i % len(WEIRD)] + str(i), scale=10**6 if i == 2 else 1,
                  quantiles={0.9: 2.0, 0.1: -1.0} if i else None) for i, b in enumerate(bins)]
    snaps.append(LayerSnapshot("t", "bare", "output", mean=1))
    registry = CollectorRegistry()
    registry.register(ActivationCollector(lambda: snaps, 'mo"del', max_buckets=8))
    for _ in range(2):  # laid out, then cached text
        assert render_latest(registry) == generate_latest(registry)
        assert render_openmetrics(registry) == generate_openmetrics(registry)


class Mutating(Collector):
    """Yields the same family object every scrape and edits it in place."""

    def __init__(self) -> None:
        self.family = GaugeMetricFamily("mutating", "Edited in place.", labels=["k"])
        self.family.add_metric(["a"], 1.0)

    def collect(self) -> list[Metric]:
        return [self.family]


def test_cached_health_text_follows_every_change() -> None:
    registry = CollectorRegistry()
    g = Gauge("g", "A gauge.", ["k"], registry=registry)
    mutating = Mutating()
    registry.register(mutating)
    registry.register(ActivationCollector(lambda: [LayerSnapshot("t", "l", "output", mean=0.5)], "m"))

    def check() -> None:
        assert render_latest(registry) == generate_latest(registry)
        assert render_openmetrics(registry) == generate_openmetrics(registry)

    for value in (0.0, -0.0, -0.0, 0.0, math.nan, 1e21, 3):
        g.labels("x").set(value)
        check()
    g.labels('y"\n').set(2)  # a new series in a cached family
    check()
    mutating.family.samples[0] = mutating.family.samples[0]._replace(value=2.0)
    check()
    mutating.family.samples[0].labels["k"] = "b"  # same object, label edited
    check()


class _Families(Collector):
    def __init__(self, *families: Metric) -> None:
        self.families = families

    def collect(self):  # type: ignore[no-untyped-def]
        return list(self.families)


class _LiveGauge(Metric):
    """A family read live: every read of ``samples`` sees a new value (another thread's)."""

    def __init__(self) -> None:
        super().__init__("busy", "Work in flight.", "gauge")
        self.reads = 0

    @property  # type: ignore[override]
    def samples(self):  # type: ignore[no-untyped-def]
        self.reads += 1
        return [Sample("busy", {}, float(self.reads))]

    @samples.setter
    def samples(self, value):  # type: ignore[no-untyped-def]
        pass


def test_cached_family_text_comes_from_the_values_its_signature_saw() -> None:
    # Signature and text from one read of the samples: text written from a
    # later read would be cached under the earlier values, and served again.
    live = _LiveGauge()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(live))
    first = render_latest(registry)
    assert live.reads == 1 and b"busy 1.0\n" in first
    assert b"busy 2.0\n" in render_latest(registry)


def test_values_only_the_writer_understands_render_as_prometheus_client_does() -> None:
    # A str value goes through the writer's float(); the cache must not choke on it.
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(GaugeMetricFamily("s", "A str value.", value="3"),
                                GaugeMetricFamily("b", "A bool value.", value=True)))
    for _ in range(2):
        assert render_latest(registry) == generate_latest(registry)
        assert render_openmetrics(registry) == generate_openmetrics(registry)


class _SlottedFamily:
    """A family the writers accept by its attributes alone: kept in __slots__, no __dict__."""

    __slots__ = ("name", "documentation", "type", "unit", "samples")

    def __init__(self) -> None:
        self.name, self.documentation, self.type, self.unit = "slotted", "In slots.", "gauge", ""
        self.samples = [Sample("slotted", {}, 1.5)]


class _ComputedNameFamily(Metric):
    """A family whose name is a property (an adapter's), not an instance attribute."""

    def __init__(self) -> None:
        self.documentation, self.type, self.unit = "Computed.", "gauge", ""
        self.samples = [Sample("computed", {}, 2.5)]

    name = property(lambda self: "computed")  # type: ignore[assignment]


def test_families_are_read_by_attribute_as_the_writers_read_them() -> None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(_SlottedFamily(), _ComputedNameFamily()))  # type: ignore[arg-type]
    for _ in range(2):  # written, then from the cache
        assert render_latest(registry) == generate_latest(registry)
        assert render_openmetrics(registry) == generate_openmetrics(registry)
