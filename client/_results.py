"""The reducer results: one dataclass and one :data:`RESULTS` row per ``ReducerResult`` kind.

This is the one place that enumerates the kinds outside the proto. The client
converts results with it (:mod:`layertap._convert`); the server's snapshot
store and Prometheus collector (``layertap.server.export``) fold and export
them with it. A row says, for one ``ReducerResult`` oneof field: the client
dataclass, the ``LayerSnapshot`` fields the result feeds and how, and the
metric families that export those fields. ``tests/test_result_table.py``
checks that the rows are exactly the proto's oneof fields, in proto order.

Each dataclass has the fields of its message, same names and order: the
conversion reads them by name. Plain data only: the thin client imports this
module, so it must not import torch or the server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeAlias, Union

__all__ = [
    "AbsMax",
    "Histogram",
    "Latency",
    "Logits",
    "MinMax",
    "Moments",
    "Nonfinite",
    "Norm",
    "PerChannel",
    "Quantiles",
    "ReducerResult",
    "ZeroFraction",
]


@dataclass(frozen=True)
class Moments:
    """Element count, mean and (population) standard deviation."""

    count: int
    mean: float
    std: float


@dataclass(frozen=True)
class MinMax:
    """Smallest and largest element."""

    min: float
    max: float


@dataclass(frozen=True)
class AbsMax:
    """Largest absolute value."""

    value: float


@dataclass(frozen=True)
class ZeroFraction:
    """The fraction of elements equal to zero (``-0.0`` included), and ``count``, the
    number of elements it is taken over (the tensor's size, not the zeros: those are
    ``round(fraction * count)``)."""

    fraction: float
    count: int


@dataclass(frozen=True)
class Nonfinite:
    """NaN and ±Inf counts."""

    nan_count: int
    inf_count: int


@dataclass(frozen=True)
class Norm:
    """L2 norm of the whole tensor."""

    l2: float


@dataclass(frozen=True)
class Histogram:
    """Counts over inner ``edges``; ``counts`` has ``len(edges) + 1`` entries,
    the first and last being the open bins ``(-inf, e0)`` and ``[e_last, +inf)``."""

    edges: list[float]
    counts: list[int]
    sample_size: int
    population: int


@dataclass(frozen=True)
class Quantiles:
    """Estimated quantiles; ``rank_error`` bounds each value's rank error
    as a fraction of ``population``."""

    probabilities: list[float]
    values: list[float]
    sample_size: int
    population: int
    rank_error: float


@dataclass(frozen=True)
class PerChannel:
    """Per-channel stats along ``dim``; ``channels`` may exceed ``len(mean)`` when capped."""

    dim: int
    mean: list[float]
    std: list[float]
    abs_max: list[float]
    channels: int


@dataclass(frozen=True)
class Latency:
    """Wall time of the tapped module's forward in one pass (device time on GPU)."""

    seconds: float


@dataclass(frozen=True)
class Logits:
    """How confident a head's logits are: per row (a token, a sample), the softmax
    entropy in nats, the top-1 probability and the top-1 minus top-2 margin, as
    the mean over ``rows`` and the least confident row's value (NaN without rows)."""

    rows: int
    classes: int
    entropy_mean: float
    entropy_max: float
    top1_mean: float
    top1_min: float
    margin_mean: float
    margin_min: float


#: One reducer's result in ``Summary.results``.
ReducerResult: TypeAlias = Union[
    Moments, MinMax, AbsMax, ZeroFraction, Nonfinite, Norm, Histogram, Quantiles, PerChannel, Latency, Logits
]

#: How a result updates its ``LayerSnapshot`` fields (the server's snapshot store implements each):
#:
#: * ``latest``: the message fields of the layer's primary summary (output 0,
#:   first call), as gauges;
#: * ``total``: added up over every summary of the layer, sampled or not, as
#:   counters, and never cleared;
#: * ``pass_l2``: the L2 norm over every tensor of the module's first call in
#:   a sampled pass (sqrt of the sum of squared norms);
#: * ``exported_quantiles``: the primary summary's probability -> value,
#:   restricted to the exported probabilities;
#: * ``cumulative_histogram``: ``(edges, counts)``, counts added up for as
#:   long as the edges stay the same.
#:
#: A result a sampled primary summary no longer carries clears its fields,
#: except ``total``'s.
Fold: TypeAlias = Literal["latest", "total", "pass_l2", "exported_quantiles", "cumulative_histogram"]


@dataclass(frozen=True)
class Family:
    """One per-layer metric family, labelled ``model, layer, point, tap``.

    Attributes:
        name: The family name; counters get ``_total`` samples, histograms ``_bucket``.
        help: Its HELP text.
        snapshot: The ``LayerSnapshot`` field(s) it reads.
        type: ``"gauge"``, ``"counter"`` or ``"histogram"``.
        label: The extra label, if any: with ``label_values``, one series per
            snapshot field; without, one per key of the field's mapping
            (histograms: ``le``, one per bucket).
        label_values: The ``label`` value of each snapshot field.
    """

    name: str
    help: str
    snapshot: tuple[str, ...]
    type: Literal["gauge", "counter", "histogram"] = "gauge"
    label: str = ""
    label_values: tuple[str, ...] = ()


@dataclass(frozen=True)
class Result:
    """One ``ReducerResult`` kind and where it goes.

    Attributes:
        field: The ``ReducerResult`` oneof field, which is also the reducer's
            name (``ReducerKind`` without its prefix) and its key in
            ``Summary.results``.
        type: The client dataclass.
        snapshot: ``LayerSnapshot`` field -> the message field it takes
            (empty: the result is not exported).
        fold: How a summary updates those snapshot fields.
        families: The metric families that export them.
        default: Whether a tap that names no reducers runs it.
    """

    field: str
    type: type[ReducerResult]
    snapshot: tuple[tuple[str, str], ...] = ()
    fold: Fold = "latest"
    families: tuple[Family, ...] = ()
    default: bool = False


def _gauge(snapshot: str, name: str, doc: str) -> Family:
    return Family(name, doc, (snapshot,))


#: Every result kind, in proto order.
RESULTS: tuple[Result, ...] = (
    Result("moments", Moments, (("mean", "mean"), ("std", "std")), default=True, families=(
        _gauge("mean", "layertap_activation_mean", "Mean of the activation."),
        _gauge("std", "layertap_activation_std", "Standard deviation of the activation."),
    )),
    Result("minmax", MinMax, (("min", "min"), ("max", "max")), default=True, families=(
        _gauge("min", "layertap_activation_min", "Smallest activation value."),
        _gauge("max", "layertap_activation_max", "Largest activation value."),
    )),
    Result("abs_max", AbsMax, (("abs_max", "value"),), families=(
        _gauge("abs_max", "layertap_activation_abs_max", "Largest absolute activation value."),
    )),
    Result("zero_fraction", ZeroFraction, (("zero_fraction", "fraction"),), families=(
        _gauge("zero_fraction", "layertap_activation_zero_fraction", "Fraction of activation elements equal to zero."),
    )),
    Result("nonfinite", Nonfinite, (("nan_total", "nan_count"), ("inf_total", "inf_count")), "total",
           default=True, families=(
        Family("layertap_activation_nonfinite", "NaN and Inf activation elements seen.", ("nan_total", "inf_total"),
               "counter", "kind", ("nan", "inf")),
    )),
    Result("norm", Norm, (("l2", "l2"),), "pass_l2", families=(
        _gauge("l2", "layertap_activation_l2", "L2 norm of the finite elements of every tensor of the module's first call "
                                      "(param_grad: all its parameters)."),
    )),
    Result("histogram", Histogram, (("histogram", ""),), "cumulative_histogram", families=(
        Family("layertap_activation_value", "Sampled activation values (bins of the tap's histogram reducer).",
               ("histogram",), "histogram", "le"),
    )),
    Result("quantiles", Quantiles, (("quantiles", ""),), "exported_quantiles", families=(
        Family("layertap_activation_quantile", "Activation quantiles of the latest sampled pass.", ("quantiles",),
               label="q"),
    )),
    Result("per_channel", PerChannel),  # feeds the drift monitor, not a series of its own
    Result("latency", Latency, (("latency", "seconds"),), families=(
        _gauge("latency", "layertap_layer_latency_seconds", "Seconds the module's forward took in the latest sampled pass."),
    )),
    Result("logits", Logits, (("logits_entropy_mean", "entropy_mean"), ("logits_entropy_max", "entropy_max"),
                              ("logits_top1_mean", "top1_mean"), ("logits_top1_min", "top1_min"),
                              ("logits_margin_mean", "margin_mean"), ("logits_margin_min", "margin_min")), families=(
        Family("layertap_logits_entropy_nats", "Softmax entropy of the logits' rows (tokens, samples) in the latest "
               "sampled pass: their mean, and the largest.", ("logits_entropy_mean", "logits_entropy_max"),
               label="stat", label_values=("mean", "max")),
        Family("layertap_logits_top1_probability", "Top-1 softmax probability of the logits' rows in the latest "
               "sampled pass: their mean, and the smallest.", ("logits_top1_mean", "logits_top1_min"),
               label="stat", label_values=("mean", "min")),
        Family("layertap_logits_margin", "Top-1 minus top-2 softmax probability of the logits' rows in the latest "
               "sampled pass: their mean, and the smallest.", ("logits_margin_mean", "logits_margin_min"),
               label="stat", label_values=("mean", "min")),
    )),
)
#: The rows by oneof field.
RESULTS_BY_FIELD: dict[str, Result] = {r.field: r for r in RESULTS}
