"""Reducer specs: names, parameter defaults and bounds, validated once host-side.

Everything here is plain host data (no torch), so tap files and the gRPC layer
can check a spec without touching a device. The reducer names and the kinds
that take parameters come from the proto, so a reducer added to the API needs
no second table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final, Literal, NamedTuple, get_args

import numpy as np

from layertap.v1 import telemetry_pb2 as pb

__all__ = [
    "DEFAULT_HISTOGRAM_BINS",
    "DEFAULT_HISTOGRAM_RANGE",
    "DEFAULT_MAX_CHANNELS",
    "DEFAULT_PROBABILITIES",
    "DEFAULT_SAMPLE_SIZE",
    "KIND_NAMES",
    "MAX_BINS",
    "MAX_CHANNELS",
    "MAX_PROBABILITIES",
    "MAX_SAMPLE_SIZE",
    "PARAM_FIELDS",
    "PARAM_OF_KIND",
    "QUANTILE_DELTA",
    "REDUCER_NAMES",
    "HistogramSettings",
    "ParamField",
    "PerChannelSettings",
    "QuantileSettings",
    "SpecError",
    "TOKEN_MODEL_SOURCES",
    "check_histogram",
    "check_kind",
    "check_per_channel",
    "check_quantiles",
    "default_feature_axis",
    "parse_reducer_names",
    "reducer_name",
]

#: Histograms and quantiles share one sample (and one sort) at equal sizes.
#: 16384 gives a quantile rank error of ~0.013 and sorts in ~1 ms on one CPU core.
DEFAULT_SAMPLE_SIZE = 16384
MAX_SAMPLE_SIZE = 1 << 20
MAX_BINS = 1024
DEFAULT_HISTOGRAM_BINS = 64
#: Used when a histogram spec gives neither edges nor a range.
DEFAULT_HISTOGRAM_RANGE = (-8.0, 8.0)
#: Quantile probabilities used when a spec gives none; baselines and the
#: exported ``quantile`` label values use the same set.
DEFAULT_PROBABILITIES: tuple[float, ...] = (0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99)
MAX_PROBABILITIES = 128
MAX_CHANNELS = 4096
DEFAULT_MAX_CHANNELS = MAX_CHANNELS
#: Failure probability of the DKW rank-error bound reported by quantiles.
QUANTILE_DELTA = 0.01
#: Model sources (``LoadedModel.source``) whose 3-d activations are
#: ``(batch, tokens, hidden)``: their feature axis is the last one.
TOKEN_MODEL_SOURCES = frozenset({"hf"})

#: ``ReducerKind`` value -> short name (``REDUCER_KIND_ABS_MAX`` -> ``"abs_max"``),
#: in the enum's order (the order error messages list them in).
KIND_NAMES: dict[int, str] = {
    value: name.removeprefix("REDUCER_KIND_").lower() for name, value in pb.ReducerKind.items() if value
}
REDUCER_NAMES: dict[str, int] = {name: kind for kind, name in KIND_NAMES.items()}

#: ``ReducerSpec`` fields holding parameters; each is named after its kind.
ParamField = Literal["histogram", "quantiles", "per_channel"]
PARAM_FIELDS: tuple[ParamField, ...] = get_args(ParamField)
PARAM_OF_KIND: Final[Mapping[int, ParamField]] = MappingProxyType({REDUCER_NAMES[f]: f for f in PARAM_FIELDS})


class SpecError(ValueError):
    """A reducer spec is invalid, or cannot apply to a tensor.

    Attributes:
        field: Path of the offending field, e.g. ``"reducers[1].histogram.bins"``,
            so the gRPC layer can say exactly what to fix.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def reducer_name(kind: int) -> str:
    """Returns the short name (``"moments"``...) of a ``ReducerKind`` value."""
    try:
        return KIND_NAMES[kind]
    except KeyError:
        raise ValueError(f"unknown reducer kind {kind}") from None


def parse_reducer_names(names: str, field_prefix: str = "reducers") -> list[pb.ReducerSpec]:
    """Turns ``"moments,nonfinite"`` into specs with default parameters.

    Args:
        names: Comma-separated reducer names; whitespace and case are ignored.
        field_prefix: Field path used in errors.

    Returns:
        One ``ReducerSpec`` per name, in order (duplicates are left for
        ``build_reducers`` to reject).

    Raises:
        SpecError: For an unknown name; the message lists the valid ones.
    """
    specs: list[pb.ReducerSpec] = []
    for i, raw in enumerate(n.strip().lower() for n in names.split(",")):
        if not raw:
            continue
        kind = REDUCER_NAMES.get(raw)
        if kind is None:
            raise SpecError(
                f"{field_prefix}[{i}]",
                f"unknown reducer {raw!r}; valid: {', '.join(REDUCER_NAMES)}",
            )
        specs.append(pb.ReducerSpec(kind=kind))  # type: ignore[arg-type]
    return specs


def check_kind(spec: pb.ReducerSpec, field: str) -> int:
    """Returns ``spec.kind`` once it is a known kind carrying no other kind's parameters.

    Raises:
        SpecError: On an unknown kind, or parameters given for a kind that
            takes none (or another kind's).
    """
    kind = spec.kind
    if kind not in KIND_NAMES:
        raise SpecError(
            f"{field}.kind",
            f"reducer kind {pb.ReducerKind.Name(kind) if kind in pb.ReducerKind.values() else kind} "
            f"is not valid; use one of: {', '.join(REDUCER_NAMES)}",
        )
    own = PARAM_OF_KIND.get(kind)
    for other in PARAM_FIELDS:
        if other != own and spec.HasField(other):
            raise SpecError(f"{field}.{other}", f"{other} parameters do not apply to a {KIND_NAMES[kind]} reducer")
    return kind


class HistogramSettings(NamedTuple):
    """Validated histogram parameters; ``bins``/``lo``/``hi`` are 0 when given as edges."""

    edges: list[float]
    sample_size: int
    bins: int = 0
    lo: float = 0.0
    hi: float = 0.0


class QuantileSettings(NamedTuple):
    """Validated quantile parameters, defaults filled in."""

    probabilities: list[float]
    sample_size: int


class PerChannelSettings(NamedTuple):
    """Validated per-channel parameters; ``dim`` is None for the default feature axis."""

    dim: int | None
    max_channels: int


def default_feature_axis(ndim: int, *, tokens: bool) -> int:
    """The per-channel axis of an ``ndim`` tensor when a spec names none.

    A token model's 3-d tensors are ``(batch, tokens, hidden)``: its features
    are the last axis, where dim 1 would be the token position. Every other
    tensor keeps dim 1, the channels of an ``NCHW`` map or the features of a
    ``(batch, features)`` row, as before there were token models.

    Args:
        ndim: The tensor's number of dimensions.
        tokens: Whether the model is a token model (:data:`TOKEN_MODEL_SOURCES`).
    """
    return ndim - 1 if tokens and ndim == 3 else 1


def _check_sample_size(field: str, size: int) -> int:
    if size == 0:
        return DEFAULT_SAMPLE_SIZE
    if size > MAX_SAMPLE_SIZE:
        raise SpecError(field, f"sample_size {size} exceeds the cap {MAX_SAMPLE_SIZE}")
    return size


def check_histogram(field: str, params: pb.HistogramParams) -> HistogramSettings:
    """Validates histogram parameters and freezes the edges (explicit, or from a range)."""
    f = f"{field}.histogram"
    size = _check_sample_size(f"{f}.sample_size", params.sample_size)
    if params.edges:
        edges = list(params.edges)
        if len(edges) > MAX_BINS + 1:
            raise SpecError(f"{f}.edges", f"{len(edges)} edges exceed the cap of {MAX_BINS + 1}")
        for i, e in enumerate(edges):
            if not math.isfinite(e):
                raise SpecError(f"{f}.edges[{i}]", f"edge {e} is not finite (the end bins are already open)")
            if i and e <= edges[i - 1]:
                raise SpecError(f"{f}.edges[{i}]", f"edges must be strictly increasing ({edges[i - 1]} then {e})")
        return HistogramSettings(edges, size)
    bins = params.bins or DEFAULT_HISTOGRAM_BINS
    lo, hi = params.min, params.max
    if lo == 0.0 and hi == 0.0:
        lo, hi = DEFAULT_HISTOGRAM_RANGE
    if bins > MAX_BINS:
        raise SpecError(f"{f}.bins", f"bins must be in 1..{MAX_BINS}, got {bins}")
    if not math.isfinite(lo):
        raise SpecError(f"{f}.min", f"min must be finite, got {lo}")
    if not math.isfinite(hi) or hi <= lo:
        raise SpecError(f"{f}.max", f"max must be finite and greater than min ({lo}), got {hi}")
    edges = np.linspace(lo, hi, bins + 1).tolist()
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise SpecError(f"{f}.bins", f"range [{lo}, {hi}) is too narrow for {bins} distinct bins")
    return HistogramSettings(edges, size, bins=bins, lo=lo, hi=hi)


def check_quantiles(field: str, params: pb.QuantileParams) -> QuantileSettings:
    """Validates quantile parameters (probabilities in [0, 1], within the caps)."""
    f = f"{field}.quantiles"
    size = _check_sample_size(f"{f}.sample_size", params.sample_size)
    probs = list(params.probabilities) or list(DEFAULT_PROBABILITIES)
    if len(probs) > MAX_PROBABILITIES:
        raise SpecError(f"{f}.probabilities", f"{len(probs)} probabilities exceed the cap of {MAX_PROBABILITIES}")
    for i, p in enumerate(probs):
        if not 0.0 <= p <= 1.0:  # also rejects NaN
            raise SpecError(f"{f}.probabilities[{i}]", f"probability must be in [0, 1], got {p}")
    return QuantileSettings(probs, size)


def check_per_channel(field: str, params: pb.PerChannelParams) -> PerChannelSettings:
    """Validates per-channel parameters; ``dim`` is checked per tensor, against its shape."""
    f = f"{field}.per_channel"
    cap = params.max_channels or DEFAULT_MAX_CHANNELS
    if cap > MAX_CHANNELS:
        raise SpecError(f"{f}.max_channels", f"max_channels must be at most {MAX_CHANNELS}, got {cap}")
    # dim is an `optional` field: unset means the model's feature axis, resolved per tensor.
    return PerChannelSettings(params.dim if params.HasField("dim") else None, cap)
