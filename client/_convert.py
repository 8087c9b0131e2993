"""Protobuf messages <-> the client's dataclasses, and the request builders.

Everything that reads or builds a ``layertap.v1`` message lives here or in
:mod:`layertap._codec` (tensor bytes) and :mod:`layertap._capture` (capture
streams); the rest of the client sees numpy arrays, torch tensors and the
dataclasses of :mod:`layertap._types`. Enum names (points, reducers, tap kinds,
baseline states) are derived from the proto enums, not kept by hand.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar

from ._codec import TensorValue, decode_tensor, dtype_name, encode_tensor
from ._errors import InvalidArgument
from ._results import RESULTS, ReducerResult
from ._types import (
    BaselineInfo,
    DriftThresholds,
    LayerDrift,
    LayerInfo,
    ModelMetadata,
    ReducerSpec,
    ServerStats,
    Summary,
    TapEvent,
    TapInfo,
    TapSpec,
    TensorSpec,
    Triggers,
)
from .v1 import inference_pb2, telemetry_pb2

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_Point: TypeAlias = "telemetry_pb2.Point.ValueType"
_Kind: TypeAlias = "telemetry_pb2.ReducerKind.ValueType"
_Phase: TypeAlias = "telemetry_pb2.Phase.ValueType"
_V = TypeVar("_V", bound=int, covariant=True)
_D = TypeVar("_D", bound="DataclassInstance")


class _ProtoEnum(Protocol[_V]):
    def items(self) -> Iterable[tuple[str, _V]]: ...


def _enum_names(enum: _ProtoEnum[_V], prefix: str) -> dict[str, _V]:
    """``{"grad_output": POINT_GRAD_OUTPUT, ...}``: lower-case names without the
    enum's prefix, in proto order, UNSPECIFIED (0) left out."""
    return {name.removeprefix(prefix).lower(): code for name, code in enum.items() if code}


_POINTS = _enum_names(telemetry_pb2.Point, "POINT_")
_POINT_NAMES = {code: name for name, code in _POINTS.items()}
_REDUCERS = _enum_names(telemetry_pb2.ReducerKind, "REDUCER_KIND_")
_REDUCER_NAMES = {code: name for name, code in _REDUCERS.items()}
#: The generation phases; a plain forward's PHASE_UNSPECIFIED is "".
_PHASES = {"": telemetry_pb2.PHASE_UNSPECIFIED, **_enum_names(telemetry_pb2.Phase, "PHASE_")}
_PHASE_NAMES = {code: name for name, code in _PHASES.items()}
_DERIVES = {"": telemetry_pb2.DERIVE_UNSPECIFIED, **_enum_names(telemetry_pb2.Derive, "DERIVE_")}  # "": the tensor
_DERIVE_NAMES = {code: name for name, code in _DERIVES.items()}
_TAP_KINDS = {code: name for name, code in _enum_names(telemetry_pb2.TapKind, "TAP_KIND_").items()}
_TAP_SERVING = {code: name for name, code in _enum_names(telemetry_pb2.TapServing, "TAP_SERVING_").items()}
_BASELINE_STATES = {code: name for name, code in _enum_names(telemetry_pb2.BaselineState, "BASELINE_STATE_").items()}
_CALIBRATIONS = {code: name for name, code in _enum_names(telemetry_pb2.DriftCalibration, "DRIFT_CALIBRATION_").items()}
#: Parameters each reducer accepts: the fields of its params message in ReducerSpec.
REDUCER_PARAMS: dict[str, frozenset[str]] = {fd.name: frozenset(fd.message_type.fields_by_name)
                                              for fd in telemetry_pb2.ReducerSpec.DESCRIPTOR.fields
                                              if fd.message_type is not None}
#: Every reducer name the server knows, in proto order.
REDUCER_NAMES: tuple[str, ...] = tuple(_REDUCERS)
#: Every point name, in proto order.
POINT_NAMES: tuple[str, ...] = tuple(_POINTS)
_THRESHOLDS = tuple(f.name for f in dataclasses.fields(DriftThresholds))


# --------------------------------------------------------------------------- enums


def point_code(point: str) -> _Point:
    """Returns the wire Point for ``"output"``, ``"input"``, ...

    Raises:
        InvalidArgument: Unknown point name.
    """
    try:
        return _POINTS[point.strip().lower()]
    except KeyError:
        raise InvalidArgument(
            f"unknown point {point!r}; expected one of: {', '.join(_POINTS)}"
        ) from None


def point_name(code: _Point) -> str:
    """Returns the name of a wire Point (``"output"`` when unspecified)."""
    return _POINT_NAMES.get(code, "output")


def phase_code(phase: str) -> _Phase:
    """Returns the wire Phase for ``"prefill"``, ``"decode"`` or ``""`` (a plain forward).

    Raises:
        InvalidArgument: Unknown phase name.
    """
    try:
        return _PHASES[phase.strip().lower()]
    except KeyError:
        raise InvalidArgument(
            f"unknown phase {phase!r}; expected one of: {', '.join(repr(p) for p in _PHASES)}"
        ) from None


def phase_name(code: _Phase) -> str:
    """Returns the name of a wire Phase: ``""`` for a plain forward (and a phase newer than this client)."""
    return _PHASE_NAMES.get(code, "")


def derive_code(derive: str) -> telemetry_pb2.Derive.ValueType:
    """The wire Derive of ``"entropy"``, ``"top1_prob"`` or ``""`` (the tensor); InvalidArgument for another name."""
    if (code := _DERIVES.get(derive.strip().lower())) is None:
        raise InvalidArgument(f"unknown derive {derive!r}; expected one of: {', '.join(map(repr, _DERIVES))}")
    return code


# --------------------------------------------------------------------------- inference


def infer_request(inputs: Sequence[Any]) -> inference_pb2.InferRequest:
    """Builds an InferRequest from positional inputs."""
    return inference_pb2.InferRequest(inputs=[encode_tensor(x) for x in inputs])


def infer_outputs(resp: inference_pb2.InferResponse, *, as_torch: bool) -> list[TensorValue]:
    """Decodes an InferResponse's outputs, in order."""
    return [decode_tensor(t, as_torch=as_torch) for t in resp.outputs]


@functools.cache
def _field_plan(cls: Any, descriptor: Any) -> tuple[tuple[str, bool], ...]:
    """``cls``'s field names, each with whether the message's field is repeated; once per type.

    Why: looking the fields up per message cost ~3 us a message, and a stream
    converts five messages per summary, for every pass the server runs.
    """
    repeated = {fd.name for fd in descriptor.fields if fd.is_repeated}
    return tuple((f.name, f.name in repeated) for f in dataclasses.fields(cls))


def _from_fields(cls: type[_D], msg: Any, **overrides: Any) -> _D:
    """Builds the dataclass ``cls`` from the same-named fields of ``msg``.

    Repeated fields become lists; ``overrides`` supply the fields that need a
    conversion (enums, nested messages, timestamps).
    """
    for name, repeated in _field_plan(cls, msg.DESCRIPTOR):
        if name not in overrides:
            overrides[name] = list(getattr(msg, name)) if repeated else getattr(msg, name)
    return cls(**overrides)


def metadata_from_proto(m: inference_pb2.GetModelMetadataResponse) -> ModelMetadata:
    """Converts GetModelMetadataResponse."""
    inputs = [TensorSpec(s.name, dtype_name(s.dtype), tuple(s.shape), s.optional) for s in m.inputs]
    return _from_fields(ModelMetadata, m, dtype=dtype_name(m.dtype), inputs=inputs,
                        rank=m.rank if m.has_rank else None, world_size=m.world_size if m.has_rank else None)


# --------------------------------------------------------------------------- layers, stats


def layers_from_proto(resp: telemetry_pb2.ListLayersResponse) -> list[LayerInfo]:
    """Converts ListLayersResponse."""
    return [
        _from_fields(
            LayerInfo,
            layer,
            input_shapes=[tuple(s.dims) for s in layer.input_shapes],
            output_shapes=[tuple(s.dims) for s in layer.output_shapes],
        )
        for layer in resp.layers
    ]


def stats_from_proto(s: telemetry_pb2.GetServerStatsResponse) -> ServerStats:
    """Converts GetServerStatsResponse."""
    return _from_fields(ServerStats, s)


# --------------------------------------------------------------------------- taps


def _reducer_params(name: str, params: Mapping[str, Any]) -> telemetry_pb2.ReducerSpec:
    spec = telemetry_pb2.ReducerSpec(kind=_REDUCERS[name])
    allowed = REDUCER_PARAMS.get(name, frozenset())
    unknown = set(params) - allowed
    if unknown:
        valid = ", ".join(sorted(allowed)) if allowed else "none"
        raise InvalidArgument(
            f"reducer {name!r} has no parameter(s) {', '.join(sorted(unknown))}; valid: {valid}"
        )
    if not params:
        return spec
    target: Any = getattr(spec, name)
    try:
        for key, value in params.items():
            if target.DESCRIPTOR.fields_by_name[key].is_repeated:
                getattr(target, key).extend(float(v) for v in value)
            else:
                setattr(target, key, value)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"reducer {name!r}: bad parameter: {exc}") from None
    return spec


def reducer_to_proto(reducer: ReducerSpec) -> telemetry_pb2.ReducerSpec:
    """Builds a ReducerSpec from ``"name"`` or ``{"name": {params}}``.

    Raises:
        InvalidArgument: Unknown reducer or parameter (the message lists the valid ones).
    """
    if isinstance(reducer, str):
        name, params = reducer, {}
    elif isinstance(reducer, Mapping) and len(reducer) == 1:
        ((name, raw),) = reducer.items()
        params = dict(raw or {})
    else:
        raise InvalidArgument(
            f"a reducer is a name or a one-key mapping name -> params, got {reducer!r}"
        )
    key = str(name).strip().lower().replace("-", "_")
    if key not in _REDUCERS:
        raise InvalidArgument(
            f"unknown reducer {name!r}; valid reducers: {', '.join(REDUCER_NAMES)}"
        )
    return _reducer_params(key, params)


def reducer_from_proto(spec: telemetry_pb2.ReducerSpec) -> ReducerSpec:
    """Converts a ReducerSpec back to the accepted input form."""
    name = _REDUCER_NAMES.get(spec.kind, "unspecified")
    if name not in REDUCER_PARAMS:
        return name
    params: dict[str, Any] = {}
    for fd, value in getattr(spec, name).ListFields():
        params[fd.name] = list(value) if fd.is_repeated else value
    return {name: params} if params else name


def tap_spec_to_proto(spec: TapSpec) -> telemetry_pb2.TapSpec:
    """Builds a wire TapSpec, validating sampling client-side.

    Raises:
        InvalidArgument: Empty selector, no or unknown reducers, bad point or sampling.
    """
    if not spec.selector:
        raise InvalidArgument("a tap needs a non-empty layer selector")
    if not spec.reducers:
        raise InvalidArgument(f"a tap needs at least one reducer; valid: {', '.join(REDUCER_NAMES)}")
    if spec.every is not None and spec.every < 1:
        raise InvalidArgument(f"every must be >= 1, got {spec.every}")
    if spec.probability is not None and not 0.0 < spec.probability <= 1.0:
        raise InvalidArgument(f"probability must be in (0, 1], got {spec.probability}")
    if spec.max_per_second is not None and not spec.max_per_second > 0.0:
        raise InvalidArgument(f"max_per_second must be > 0, got {spec.max_per_second}")
    msg = telemetry_pb2.TapSpec(
        name=spec.name,
        selector=spec.selector,
        point=point_code(spec.point),
        reducers=[reducer_to_proto(r) for r in spec.reducers],
        sampling=telemetry_pb2.Sampling(
            every_n=spec.every or 0,
            probability=spec.probability or 0.0,
            max_per_second=spec.max_per_second or 0.0,
        ),
        # A lone str is one phase name, not its letters.
        phases=[phase_code(p) for p in ((spec.phases,) if isinstance(spec.phases, str) else spec.phases)],
        keep_padding=spec.keep_padding,
        derive=derive_code(spec.derive),
    )
    if spec.triggers is not None:
        t = spec.triggers
        msg.triggers.CopyFrom(telemetry_pb2.Triggers(
            nonfinite=t.nonfinite, abs_max_above=t.abs_max_above or 0.0, mean_sigma=t.mean_sigma or 0.0,
            min_interval_seconds=t.min_interval or 0.0))
    return msg


def tap_spec_from_proto(spec: telemetry_pb2.TapSpec) -> TapSpec:
    """Converts a wire TapSpec (zero sampling fields become None)."""
    s = spec.sampling
    return TapSpec(
        selector=spec.selector,
        reducers=tuple(reducer_from_proto(r) for r in spec.reducers),
        point=point_name(spec.point),
        every=s.every_n or None,
        probability=s.probability or None,
        max_per_second=s.max_per_second or None,
        name=spec.name,
        triggers=Triggers(
            nonfinite=spec.triggers.nonfinite, abs_max_above=spec.triggers.abs_max_above or None,
            mean_sigma=spec.triggers.mean_sigma or None, min_interval=spec.triggers.min_interval_seconds or None,
        ) if spec.HasField("triggers") else None,
        phases=tuple(phase_name(p) for p in spec.phases),
        keep_padding=spec.keep_padding,
        derive=_DERIVE_NAMES.get(spec.derive, ""),  # "" too for a value newer than this client
    )


def _utc(msg: Any, name: str) -> _dt.datetime | None:
    if not msg.HasField(name):
        return None
    stamp: Any = getattr(msg, name)
    when: _dt.datetime = stamp.ToDatetime(tzinfo=_dt.timezone.utc)
    return when


def tap_info_from_proto(t: telemetry_pb2.TapInfo) -> TapInfo:
    """Converts a wire TapInfo."""
    return _from_fields(
        TapInfo,
        t,
        spec=tap_spec_from_proto(t.spec),
        kind=_TAP_KINDS.get(t.kind, "unspecified"),
        serving=_TAP_SERVING.get(t.serving, ""),
        expires_at=_utc(t, "expires_at"),
        created_at=_utc(t, "created_at"),
    )


def create_tap_request(
    spec: TapSpec, *, ttl: float | None, forever: bool
) -> telemetry_pb2.CreateTapRequest:
    """Builds a CreateTapRequest; ``ttl`` is seconds (None: the server's 10 minutes).

    Raises:
        InvalidArgument: Non-positive ttl, or ttl together with forever.
    """
    req = telemetry_pb2.CreateTapRequest(spec=tap_spec_to_proto(spec), forever=forever)
    if ttl is not None:
        if forever:
            raise InvalidArgument("pass either ttl or forever=True, not both")
        if not ttl > 0:
            raise InvalidArgument(f"ttl must be > 0 seconds, got {ttl}")
        req.ttl.FromNanoseconds(int(round(ttl * 1e9)))
    return req


def subscribe_request(
    *, tap_ids: Iterable[str] = (), stream_taps: Iterable[TapSpec] = (), queue_size: int | None = None
) -> telemetry_pb2.SubscribeRequest:
    """Builds a SubscribeRequest."""
    if queue_size is not None and queue_size < 1:
        raise InvalidArgument(f"queue_size must be >= 1, got {queue_size}")
    return telemetry_pb2.SubscribeRequest(
        tap_ids=list(tap_ids),
        stream_taps=[tap_spec_to_proto(s) for s in stream_taps],
        queue_size=queue_size or 0,
    )


#: ReducerResult oneof field -> result dataclass; each dataclass has the fields of its message.
_RESULT_TYPES: dict[str, type[ReducerResult]] = {r.field: r.type for r in RESULTS}


@functools.cache
def _result_converter(kind: str) -> Callable[[Any], ReducerResult] | None:
    """Builds one kind's result dataclass from its message; None for a kind this client does not know.

    Fields without repeated values are read in one ``attrgetter`` call and
    passed by position (the dataclass and the message share field names).
    """
    found = _RESULT_TYPES.get(kind)
    if found is None:
        return None
    cls: Callable[..., ReducerResult] = found
    descriptor = getattr(telemetry_pb2.ReducerResult(), kind).DESCRIPTOR
    plan = _field_plan(cls, descriptor)
    if any(repeated for _, repeated in plan):
        return lambda msg: _from_fields(found, msg)
    if len(plan) == 1:
        name = plan[0][0]
        return lambda msg: cls(getattr(msg, name))
    get = operator.attrgetter(*(name for name, _ in plan))
    return lambda msg: cls(*get(msg))


def summary_from_proto(s: telemetry_pb2.Summary) -> Summary:
    """Converts a wire Summary.

    Written out field by field: a stream converts every summary of every pass
    it follows, and this costs a third of the generic :func:`_from_fields`
    path (a test compares the two on every field).
    """
    results: dict[str, ReducerResult] = {}
    for r in s.results:
        kind: str | None = r.WhichOneof("value")
        convert = _result_converter(kind) if kind is not None else None
        if kind is not None and convert is not None:  # None: a reducer newer than this client, skipped
            results[kind] = convert(getattr(r, kind))
    wall = s.wall_time
    return Summary(
        tap=s.tap, layer=s.layer, point=point_name(s.point), output_index=s.output_index,
        pass_index=s.pass_index, step=s.step if s.has_step else None,
        wall_time=wall.seconds + wall.nanos / 1e9, unsampled=s.unsampled, results=results,
        call_index=s.call_index, rank=s.rank if s.has_rank else None, output_key=s.output_key,
        phase=_PHASE_NAMES.get(s.phase, ""), position=s.position if s.has_position else None,
        request_ids=tuple(s.request_ids),
    )


@dataclass(frozen=True)
class SubscribeBatch:
    """One decoded SubscribeResponse."""

    summaries: list[Summary]
    events: list[TapEvent]
    dropped: int
    stream_tap_ids: list[str]


def subscribe_batch_from_proto(m: telemetry_pb2.SubscribeResponse) -> SubscribeBatch:
    """Converts a SubscribeResponse."""
    return SubscribeBatch(
        summaries=[summary_from_proto(s) for s in m.summaries],
        events=[_from_fields(TapEvent, e) for e in m.events],
        dropped=m.dropped,
        stream_tap_ids=list(m.stream_tap_ids),
    )


# --------------------------------------------------------------------------- drift


def set_baseline_request(
    selector: str,
    *,
    passes: int,
    window: int,
    point: str,
    thresholds: DriftThresholds | Mapping[str, float] | None,
    name: str = "",
    derive: str = "",
) -> telemetry_pb2.SetBaselineRequest:
    """Builds a SetBaselineRequest (thresholds left out take the server defaults).

    Raises:
        InvalidArgument: Empty selector, passes or window < 1, unknown threshold or derive name.
    """
    if not selector:
        raise InvalidArgument("set_baseline needs a non-empty layer selector")
    if passes < 1 or window < 1:
        raise InvalidArgument(f"passes and window must be >= 1, got {passes} and {window}")
    req = telemetry_pb2.SetBaselineRequest(
        selector=selector, passes=passes, window=window, point=point_code(point), name=name, derive=derive_code(derive)
    )
    if thresholds is not None:
        values = (
            dataclasses.asdict(thresholds)
            if isinstance(thresholds, DriftThresholds)
            else dict(thresholds)
        )
        unknown = set(values) - set(_THRESHOLDS)
        if unknown:
            raise InvalidArgument(
                f"unknown drift threshold(s) {', '.join(sorted(unknown))}; "
                f"valid: {', '.join(_THRESHOLDS)}"
            )
        req.thresholds.CopyFrom(telemetry_pb2.DriftThresholds(**{k: float(v) for k, v in values.items()}))
    return req


def baseline_from_proto(r: telemetry_pb2.SetBaselineResponse) -> BaselineInfo:
    """Converts SetBaselineResponse."""
    return _from_fields(BaselineInfo, r)


def drift_from_proto(r: telemetry_pb2.GetDriftResponse) -> list[LayerDrift]:
    """Converts GetDriftResponse (channel_drift_fraction -1 becomes None)."""
    return [
        _from_fields(
            LayerDrift,
            d,
            point=point_name(d.point),
            state=_BASELINE_STATES.get(d.state, "unspecified"),
            thresholds=_from_fields(DriftThresholds, d.thresholds),
            channel_drift_fraction=None if d.channel_drift_fraction < 0 else d.channel_drift_fraction,
            phase=phase_name(d.phase),
            derive=_DERIVE_NAMES.get(d.derive, ""),
            calibration=_CALIBRATIONS.get(d.calibration, ""),
        )
        for d in r.layers
    ]
