"""The ``/metrics`` text writer: prometheus-client's bytes, without its per-series cost.

``generate_latest`` validates and escapes every label of every sample, ~7 µs
a series; with hundreds of tapped layers that dominates a scrape. Families
built as :class:`RenderedFamily` carry pre-escaped label text and are written
straight from their rows; every other family still goes through
prometheus-client, so the output is byte-for-byte what ``generate_latest``
writes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

__all__ = ["LabelSet", "ModelOnlyFamily", "RenderedFamily", "go_float", "render_latest"]


def go_float(v: float) -> str:
    """Go's float formatting for ``le``/``quantile`` labels, as prometheus-client writes them."""
    return str(floatToGoString(v))  # type: ignore[no-untyped-call]


def _escape(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _fmt(v: float) -> str:
    """A sample value as the text format wants it (same output as ``floatToGoString``)."""
    f = float(v)
    if -math.inf < f < 1e6:  # the common case; NaN fails the comparison
        return repr(f)
    return go_float(f)  # Go's exponent form from 1e6 up, and the Inf/NaN spellings


class LabelSet:
    """The ``model, layer, point, tap`` labels of one layer, escaped once and reused."""

    __slots__ = ("labels", "text", "_with", "_prefix")

    def __init__(self, model: str, layer: str, point: str, tap: str) -> None:
        self.labels = {"model": model, "layer": layer, "point": point, "tap": tap}
        self._with: dict[str, tuple[str, str]] = {}
        self._prefix: dict[tuple[str, str, str], str] = {}
        self.text = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(self.labels.items()))

    def prefix(self, name: str, key: str, value: str) -> str:
        """``name{labels} `` of one sample line, cached: the same lines recur every scrape."""
        t = (name, key, value)
        p = self._prefix.get(t)
        if p is None:
            p = self._prefix[t] = f"{name}{{{self.text_with(key, value) if key else self.text}}} "
        return p

    def text_with(self, key: str, value: str) -> str:
        """Label text with one more label, in sorted position (as ``generate_latest`` writes it)."""
        parts = self._with.get(key)
        if parts is None:
            names = sorted(self.labels)
            i = sum(1 for n in names if n < key)
            esc = [f'{n}="{_escape(self.labels[n])}"' for n in names]
            before, after = ",".join(esc[:i]), ",".join(esc[i:])
            parts = self._with[key] = (before + "," if before else "", "," + after if after else "")
        return f'{parts[0]}{key}="{value}"{parts[1]}'


class RenderedFamily(Metric):
    """A metric family that :func:`render_latest` writes straight from its rows.

    ``generate_latest`` and the parser-based tools still see ordinary
    :class:`Sample` objects: ``samples`` builds them on demand.
    """

    def __init__(self, name: str, documentation: str, typ: str) -> None:
        super().__init__(name, documentation, typ)
        # (sample name, labels, extra label name or "", extra label value, value)
        self.rows: list[tuple[str, LabelSet, str, str, float]] = []

    @property
    def samples(self) -> list[Sample]:
        return [
            Sample(n, {**ls.labels, k: v} if k else dict(ls.labels), val) for n, ls, k, v, val in self.rows
        ]

    @samples.setter
    def samples(self, value: list[Sample]) -> None:
        if value:
            raise AttributeError("RenderedFamily takes rows, not samples")

    def render(self, out: list[str]) -> None:
        """Append the family in the Prometheus text format 0.0.4."""
        mname = self.name + "_total" if self.type == "counter" else self.name
        out.append(f"# HELP {mname} {self.documentation}\n# TYPE {mname} {self.type}\n")
        append = out.append
        for n, ls, k, v, val in self.rows:
            append(f"{ls.prefix(n, k, v)}{_fmt(val)}\n")


class ModelOnlyFamily(RenderedFamily):
    """A one-sample gauge labelled ``model`` only."""

    def __init__(self, name: str, documentation: str, model: str, value: float) -> None:
        super().__init__(name, documentation, "gauge")
        self._model = model
        self._value = value

    @property
    def samples(self) -> list[Sample]:
        return [Sample(self.name, {"model": self._model}, self._value)]

    @samples.setter
    def samples(self, value: list[Sample]) -> None:
        if value:
            raise AttributeError("read-only")

    def render(self, out: list[str]) -> None:
        out.append(
            f"# HELP {self.name} {self.documentation}\n# TYPE {self.name} {self.type}\n"
            f'{self.name}{{model="{_escape(self._model)}"}} {_fmt(self._value)}\n'
        )


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def render_latest(registry: Collector) -> bytes:
    """Same bytes as ``generate_latest(registry)``; :class:`RenderedFamily` rows are written directly.

    Runs of other families go through prometheus-client's writer in order,
    so the family order of the registry is kept.
    """
    out: list[str] = []
    pending: list[Metric] = []
    for metric in registry.collect():
        if isinstance(metric, RenderedFamily):
            if pending:
                out.append(generate_latest(_Families(pending)).decode("utf-8"))
                pending = []
            metric.render(out)
        else:
            pending.append(metric)
    if pending:
        out.append(generate_latest(_Families(pending)).decode("utf-8"))
    return "".join(out).encode("utf-8")
