"""Taps on the wire: reducer and tap specs both ways, TapInfo, and the CreateTap and Subscribe requests.

Reducer parameters are checked here, against the proto's params messages,
so a typo fails before any call.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ._convert_base import derive_code, derive_name, enum_names, from_fields, phase_code, phase_name, point_code, point_name, utc
from ._errors import InvalidArgument
from ._types import ReducerSpec, TapInfo, TapSpec, Triggers
from .v1 import telemetry_pb2

_REDUCERS = enum_names(telemetry_pb2.ReducerKind, "REDUCER_KIND_")
_REDUCER_NAMES = {code: name for name, code in _REDUCERS.items()}
_TAP_KINDS = {code: name for name, code in enum_names(telemetry_pb2.TapKind, "TAP_KIND_").items()}
_TAP_SERVING = {code: name for name, code in enum_names(telemetry_pb2.TapServing, "TAP_SERVING_").items()}
#: Parameters each reducer accepts: the fields of its params message in ReducerSpec.
REDUCER_PARAMS: dict[str, frozenset[str]] = {fd.name: frozenset(fd.message_type.fields_by_name)
                                              for fd in telemetry_pb2.ReducerSpec.DESCRIPTOR.fields
                                              if fd.message_type is not None}
#: Every reducer name the server knows, in proto order.
REDUCER_NAMES: tuple[str, ...] = tuple(_REDUCERS)


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
        derive=derive_name(spec.derive),
    )


def tap_info_from_proto(t: telemetry_pb2.TapInfo) -> TapInfo:
    """Converts a wire TapInfo."""
    return from_fields(
        TapInfo,
        t,
        spec=tap_spec_from_proto(t.spec),
        kind=_TAP_KINDS.get(t.kind, "unspecified"),
        serving=_TAP_SERVING.get(t.serving, ""),
        expires_at=utc(t, "expires_at"),
        created_at=utc(t, "created_at"),
        throttle=max(1, t.throttle),
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
