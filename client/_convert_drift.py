"""Drift on the wire: the SetBaseline request, and baselines and drift scores back to dataclasses."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ._convert_base import derive_code, derive_name, enum_names, from_fields, phase_name, point_code, point_name
from ._errors import InvalidArgument
from ._types import BaselineInfo, DriftThresholds, LayerDrift
from .v1 import telemetry_pb2

_BASELINE_STATES = {code: name for name, code in enum_names(telemetry_pb2.BaselineState, "BASELINE_STATE_").items()}
_CALIBRATIONS = {code: name for name, code in enum_names(telemetry_pb2.DriftCalibration, "DRIFT_CALIBRATION_").items()}
_THRESHOLDS = tuple(f.name for f in dataclasses.fields(DriftThresholds))


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
    return from_fields(BaselineInfo, r)


def drift_from_proto(r: telemetry_pb2.GetDriftResponse) -> list[LayerDrift]:
    """Converts GetDriftResponse (channel_drift_fraction -1 becomes None)."""
    return [
        from_fields(
            LayerDrift,
            d,
            point=point_name(d.point),
            state=_BASELINE_STATES.get(d.state, "unspecified"),
            thresholds=from_fields(DriftThresholds, d.thresholds),
            channel_drift_fraction=None if d.channel_drift_fraction < 0 else d.channel_drift_fraction,
            phase=phase_name(d.phase),
            derive=derive_name(d.derive),
            calibration=_CALIBRATIONS.get(d.calibration, ""),
        )
        for d in r.layers
    ]
