"""The ``/metrics`` writers: prometheus-client's bytes, in both of its formats, without its per-series cost.

``generate_latest`` validates and escapes every label of every sample, ~7 µs
a series; with hundreds of tapped layers that dominates a scrape. Families
built as :class:`RenderedFamily` carry their sample lines already written
(see :mod:`.series`) and only get a header here; every other family still goes
through prometheus-client's own writer, so the output is byte-for-byte what
``generate_latest`` (text format 0.0.4) or
``prometheus_client.openmetrics.exposition.generate_latest`` (OpenMetrics)
writes for the same registry.

:func:`negotiate` picks the format from a scrape's ``Accept`` header with
prometheus-client's own ``choose_encoder``, so both agree on every header.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator

from prometheus_client import generate_latest
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import exposition as om
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from layertap.server.export.series import escape_label, fmt_value

__all__ = ["Encoder", "RenderedFamily", "model_only_family", "negotiate", "render", "render_latest",
           "render_openmetrics"]

#: Renders a registry to the bytes of one format.
Encoder = Callable[[Collector], bytes]

#: Escapings under which a name of the legacy character set is written unchanged
#: (all our names are); "dots" and "values" rewrite names, so they keep the slow writer.
_NAMES_UNCHANGED = frozenset({om.UNDERSCORES, om.ALLOWUTF8})
_EOF = "# EOF\n"
#: (format, escaping, version, family name) -> the signature and text of its last writing.
_written: dict[tuple[bool, str, str, str], tuple[tuple[object, ...], str]] = {}
_MAX_WRITTEN = 512


class RenderedFamily(Metric):
    """A metric family whose sample lines are rendered already (see :mod:`.series`).

    ``generate_latest``, ``get_sample_value`` and the parsers still see
    ordinary :class:`Sample` objects: ``samples`` builds them on demand from
    ``samples_fn``. Only types whose header both formats write alike (but for
    the counter's ``_total``) are allowed.
    """

    _TYPES = frozenset({"gauge", "counter", "summary", "histogram"})

    def __init__(self, name: str, documentation: str, typ: str, text: str = "",
                 samples_fn: Callable[[], list[Sample]] | None = None) -> None:
        if typ not in self._TYPES:
            raise ValueError(f"RenderedFamily type must be one of {sorted(self._TYPES)}, not {typ!r}")
        super().__init__(name, documentation, typ)
        self.text = text
        self._samples_fn = samples_fn

    @property
    def samples(self) -> list[Sample]:
        return self._samples_fn() if self._samples_fn is not None else []

    @samples.setter
    def samples(self, value: list[Sample]) -> None:
        if value:
            raise AttributeError("RenderedFamily takes its lines rendered, not samples")

    def header(self, openmetrics: bool) -> str:
        """``# HELP``/``# TYPE`` lines as the format's prometheus-client writer puts them."""
        if openmetrics:
            return f"# HELP {self.name} {escape_label(self.documentation)}\n# TYPE {self.name} {self.type}\n"
        mname = self.name + "_total" if self.type == "counter" else self.name
        doc = self.documentation.replace("\\", r"\\").replace("\n", r"\n")
        return f"# HELP {mname} {doc}\n# TYPE {mname} {self.type}\n"


def model_only_family(name: str, documentation: str, model: str, value: float) -> RenderedFamily:
    """A one-sample gauge labelled ``model`` only."""
    text = f'{name}{{model="{escape_label(model)}"}} {fmt_value(float(value))}\n'
    return RenderedFamily(name, documentation, "gauge", text, lambda: [Sample(name, {"model": model}, value)])


def _signature(metric: Metric) -> tuple[object, ...] | None:
    """What prometheus-client's writers read of a family, frozen; None when it is not worth keeping.

    Values carry their sign (``0.0 == -0.0`` but they print apart); samples
    with timestamps, exemplars, native histograms or values that are not
    plain numbers are not cached at all.
    """
    rows: list[object] = [metric.name, metric.documentation, metric.type, metric.unit]
    for x in metric.samples:
        if x.timestamp is not None or x.exemplar is not None or x.native_histogram is not None:
            return None
        if type(x.value) not in (float, int):
            return None  # the writer's float() decides how a str or numpy value prints
        rows.append((x.name, tuple(x.labels.items()), x.value, math.copysign(1.0, x.value)))
    return tuple(rows)


def _frozen(metric: Metric) -> Metric:
    """A plain ``Metric`` with what the writers read of ``metric``, its samples read once into a list.

    Attribute by attribute: a family may keep them in ``__slots__`` or properties.
    """
    frozen = Metric.__new__(Metric)
    frozen.name, frozen.documentation = metric.name, metric.documentation
    frozen.type, frozen.unit = metric.type, metric.unit
    frozen.samples = list(metric.samples)
    return frozen


def _write_cached(families: list[Metric], write: Callable[[list[Metric]], str], fmt: tuple[bool, str, str]) -> str:
    """``write(families)``, reusing the text of each family that is the same as at the last scrape.

    The health families (prometheus-client's own metrics) mostly hold still
    between scrapes, and its writer costs ~5 µs a series.
    """
    out: list[str] = []
    for metric in families:
        # One read of the samples serves both the signature and the text, so a
        # family changed meanwhile (another thread, a lazy property) can never
        # store a signature next to text written from other values.
        metric = _frozen(metric)
        key = (*fmt, metric.name)
        sig = _signature(metric)
        hit = _written.get(key)
        if sig is not None and hit is not None and hit[0] == sig:
            out.append(hit[1])
            continue
        text = write([metric])
        if sig is not None:
            if len(_written) >= _MAX_WRITTEN:
                _written.clear()
            _written[key] = (sig, text)
        out.append(text)
    return "".join(out)


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def render(registry: Collector, openmetrics: bool = False, escaping: str = om.UNDERSCORES,
           version: str = "1.0.0") -> bytes:
    """The registry in the text format 0.0.4, or in OpenMetrics (``openmetrics=True``).

    Same bytes as ``generate_latest(registry, escaping)`` or
    ``openmetrics.exposition.generate_latest(registry, escaping, version)``.
    Families other than :class:`RenderedFamily` go through that writer in
    order, so the registry's family order is kept; one that is the same as
    at the last scrape keeps its text.

    Raises:
        ValueError: ``escaping`` rewrites legacy names (``dots``, ``values``); use
            prometheus-client's writer for it, as :func:`negotiate` does.
    """
    if escaping not in _NAMES_UNCHANGED:
        raise ValueError(f"escaping {escaping!r} rewrites metric names; render() writes them unchanged")
    if openmetrics:
        def slow(fams: list[Metric]) -> str:
            return om.generate_latest(_Families(fams), escaping=escaping, version=version).decode("utf-8")[:-len(_EOF)]
    else:
        def slow(fams: list[Metric]) -> str:
            return generate_latest(_Families(fams), escaping=escaping).decode("utf-8")

    fmt = (openmetrics, escaping, version)
    out: list[str] = []
    pending: list[Metric] = []
    for metric in registry.collect():
        if isinstance(metric, RenderedFamily):
            if pending:
                out.append(_write_cached(pending, slow, fmt))
                pending = []
            out += (metric.header(openmetrics), metric.text)
        else:
            pending.append(metric)
    if pending:
        out.append(_write_cached(pending, slow, fmt))
    if openmetrics:
        out.append(_EOF)
    return "".join(out).encode("utf-8")


def render_latest(registry: Collector) -> bytes:
    """Same bytes as ``generate_latest(registry)``: the text format 0.0.4."""
    return render(registry)


def render_openmetrics(registry: Collector) -> bytes:
    """Same bytes as ``prometheus_client.openmetrics.exposition.generate_latest(registry)``."""
    return render(registry, openmetrics=True)


def negotiate(accept: str | None) -> tuple[Encoder, str]:
    """The writer and ``Content-Type`` for a scrape's ``Accept`` header.

    ``prometheus_client.exposition.choose_encoder`` decides (OpenMetrics when
    asked for version 1.0.0 or later, the text format otherwise); its writer is
    swapped for :func:`render` with the same format, escaping and version.
    An escaping :func:`render` cannot write keeps prometheus-client's writer.
    """
    encoder, content_type = choose_encoder(accept or "")
    if encoder is generate_latest:
        return render_latest, content_type
    if isinstance(encoder, functools.partial) and encoder.keywords.get("escaping") in _NAMES_UNCHANGED:
        kw = encoder.keywords
        if encoder.func is om.generate_latest:
            return functools.partial(render, openmetrics=True, escaping=kw["escaping"],
                                     version=kw.get("version", "1.0.0")), content_type
        if encoder.func is generate_latest:
            return functools.partial(render, escaping=kw["escaping"]), content_type
    return encoder, content_type
