"""Baselines on the wire, between replicas: builder states and frozen documents.

Fleet-wide baselines collect on every replica, merge the builders' states on
one, freeze once and install that one frozen reference everywhere, so every
replica scores drift against the same edges. The states and documents come
from other processes, so every field is checked here and a refusal names it
(``builders[2].keys``, ``frozen[0]``). A frozen reference travels as the
``layertap.baseline`` JSON document of ``--baseline-dir`` files: one schema
(and one validator) for disk and wire.

Phases. A frozen document names its phase itself (schema v2). A builder's
state says it in ``BaselineBuilderState.phase``, and ``LayerBaseline`` and
``LayerDrift`` in their own ``phase``: states merge only within one phase.

Derives. A frozen document of a derived baseline names its derive (schema
v4), so a replica installs it as what it is. A builder's state does not: the
builders of one baseline tap read what the tap reads, and freeze with its derive.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import numpy.typing as npt

from layertap.server.drift.baseline import Baseline
from layertap.server.drift.builder import BaselineBuilder, BuilderState
from layertap.server.drift.phases import PHASE_BY_NAME, PHASE_NAMES
from layertap.server.drift.schema import BaselineFormatError, KnownLayers, baseline_from_dict, baseline_to_dict
from layertap.server.errors import InvalidField
from layertap.server.host.hooks import POINT_BY_NAME, POINT_NAMES
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["builder_state_from_proto", "builder_state_to_proto", "frozen_from_bytes", "frozen_to_bytes",
           "merge_states"]

#: Largest reservoir one exported state may carry (the builder keeps 20,000).
MAX_RESERVOIR = 1_000_000
#: Largest frozen document accepted, in bytes.
MAX_FROZEN_BYTES = 16 << 20
def builder_state_to_proto(s: BuilderState) -> pb.BaselineBuilderState:
    """The wire form of a builder's state (float64 throughout, so merges stay exact)."""
    msg = pb.BaselineBuilderState(
        layer=s.layer, point=POINT_BY_NAME[s.point], target_passes=s.target_passes, passes=s.passes,
        skipped_passes=s.skipped_passes, count=s.count, mean=s.mean, m2=s.m2, min=s.min, max=s.max,
        values=s.values.tolist(), keys=s.keys.tolist(),
    )
    msg.phase = PHASE_BY_NAME[s.phase]  # type: ignore[assignment]
    if s.channel_mean is not None and s.channel_m2 is not None:
        msg.channel_count = s.channel_count
        msg.channel_mean.extend(s.channel_mean.tolist())
        msg.channel_m2.extend(s.channel_m2.tolist())
    return msg


def _array(values: Any, field: str, *, allow_neg_inf: bool = False) -> npt.NDArray[np.float64]:
    a = np.asarray(values, dtype=np.float64)
    bad = (np.isnan(a) | (a == np.inf)) if allow_neg_inf else ~np.isfinite(a)
    if bad.any():
        i = int(np.argmax(bad))
        raise InvalidField(f"{field}[{i}]", f"must be finite, got {a[i]}")
    return a


def builder_state_from_proto(msg: pb.BaselineBuilderState, field: str) -> BuilderState:
    """A checked :class:`BuilderState` from another replica's export.

    Raises:
        InvalidField: Naming the field at fault (under ``field``).
    """
    if not msg.layer:
        raise InvalidField(f"{field}.layer", "must name the layer")
    point = msg.point or pb.POINT_OUTPUT  # as in SetBaseline
    if point not in POINT_NAMES:
        raise InvalidField(f"{field}.point", f"unknown point {msg.point}")
    phase = int(msg.phase)
    if phase not in PHASE_NAMES:
        raise InvalidField(f"{field}.phase", f"unknown phase {phase}")
    for name in ("mean", "m2"):
        if not math.isfinite(getattr(msg, name)):
            raise InvalidField(f"{field}.{name}", f"must be finite, got {getattr(msg, name)}")
    if msg.m2 < 0:
        raise InvalidField(f"{field}.m2", f"must be >= 0, got {msg.m2}")
    if math.isnan(msg.min) or math.isnan(msg.max):
        raise InvalidField(f"{field}.min", "min and max must not be NaN")
    if msg.count > 0 and msg.min > msg.max:
        raise InvalidField(f"{field}.min", f"min {msg.min} > max {msg.max}")
    if len(msg.values) != len(msg.keys):
        raise InvalidField(f"{field}.keys", f"one key per value: {len(msg.keys)} keys, {len(msg.values)} values")
    if len(msg.values) > MAX_RESERVOIR:
        raise InvalidField(f"{field}.values", f"at most {MAX_RESERVOIR} values, got {len(msg.values)}")
    values = _array(msg.values, f"{field}.values")
    keys = _array(msg.keys, f"{field}.keys", allow_neg_inf=True)  # log(u) with u = 0 is -inf
    if (keys > 0).any():
        raise InvalidField(f"{field}.keys", "log A-Res keys are <= 0")
    if values.size and msg.count == 0:
        raise InvalidField(f"{field}.count", "a reservoir with no elements counted")
    c_mean = c_m2 = None
    if msg.channel_mean or msg.channel_m2:
        if len(msg.channel_mean) != len(msg.channel_m2):
            raise InvalidField(f"{field}.channel_m2", "one M2 per channel mean")
        if not (math.isfinite(msg.channel_count) and msg.channel_count > 0):
            raise InvalidField(f"{field}.channel_count", f"must be finite and > 0, got {msg.channel_count}")
        c_mean = _array(msg.channel_mean, f"{field}.channel_mean")
        c_m2 = _array(msg.channel_m2, f"{field}.channel_m2")
        if (c_m2 < 0).any():
            raise InvalidField(f"{field}.channel_m2", "must be >= 0")
    return BuilderState(
        layer=msg.layer, point=POINT_NAMES[point], target_passes=msg.target_passes, passes=msg.passes,
        skipped_passes=msg.skipped_passes, count=msg.count, mean=msg.mean, m2=msg.m2, min=msg.min, max=msg.max,
        values=values, keys=keys, channel_count=msg.channel_count if c_mean is not None else 0.0,
        channel_mean=c_mean, channel_m2=c_m2, phase=PHASE_NAMES[phase],
    )


def merge_states(tap: str, states: list[BuilderState], *, reservoir_size: int = 20_000) -> BaselineBuilder:
    """One builder holding every state (same layer, point and phase), as if it had seen all their passes.

    The merged reservoir keeps the ``reservoir_size`` largest keys of all states.
    """
    merged = BaselineBuilder.from_state(tap, states[0], reservoir_size=reservoir_size)
    for s in states[1:]:
        merged.merge(BaselineBuilder.from_state(tap, s, reservoir_size=reservoir_size))
    return merged


def frozen_to_bytes(b: Baseline) -> bytes:
    """The frozen reference as its ``layertap.baseline`` JSON document."""
    return json.dumps(baseline_to_dict(b), allow_nan=False).encode()


def _reject_constant(name: str) -> Any:
    raise BaselineFormatError(f"non-finite number {name} in JSON")


def frozen_from_bytes(data: bytes, field: str, known_layers: KnownLayers | None) -> Baseline:
    """A checked :class:`Baseline` from another replica's frozen document.

    Raises:
        InvalidField: Naming ``field``, with the validator's one-line reason.
    """
    if len(data) > MAX_FROZEN_BYTES:
        raise InvalidField(field, f"at most {MAX_FROZEN_BYTES} bytes, got {len(data)}")
    try:
        return baseline_from_dict(json.loads(data.decode("utf-8"), parse_constant=_reject_constant), known_layers)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidField(field, f"not a JSON baseline document: {exc}") from None
    except (BaselineFormatError, ValueError, TypeError, RecursionError) as exc:
        raise InvalidField(field, f"refused: {exc}") from None
