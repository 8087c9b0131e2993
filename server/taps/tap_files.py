"""Durable taps from a YAML or JSON file given to ``layertap serve --taps``.

The file holds ``{"taps": [...]}`` (or a bare list). Each entry mirrors
``TapSpec`` with two conveniences: ``point``, ``phases`` and reducer names may
be written in lower case, and a reducer may be a bare name or ``{name: {params}}``::

    taps:
      - name: blocks
        selector: "layer*"
        reducers: [moments, nonfinite, {histogram: {bins: 32, min: -4, max: 4}}]
        sampling: {every_n: 10}
      - name: decode-only
        selector: "model.layers.*"
        reducers: [moments]
        phases: [decode]      # unspecified (plain forwards), prefill, decode
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from google.protobuf import json_format

from layertap.server.errors import InvalidField
from layertap.server.host.hooks import POINT_BY_NAME
from layertap.server.reducers.spec import PARAM_OF_KIND, SpecError, parse_reducer_names
from layertap.v1 import telemetry_pb2 as pb


def reducer_spec(entry: Any, field: str) -> pb.ReducerSpec:
    """``"moments"`` or ``{"histogram": {"bins": 32}}`` -> ReducerSpec."""
    params: dict[str, Any]
    if isinstance(entry, str):
        name, params = entry, {}
    elif isinstance(entry, dict) and len(entry) == 1:
        name, params = next(iter(entry.items()))
        params = params or {}
    else:
        raise InvalidField(field, f"expected a reducer name or {{name: params}}, got {entry!r}")
    try:
        specs = parse_reducer_names(str(name), field)
    except SpecError as exc:
        raise InvalidField(field, exc.message) from None
    if len(specs) != 1:
        raise InvalidField(field, f"expected one reducer name, got {name!r}")
    (spec,) = specs
    if params:
        sub = PARAM_OF_KIND.get(spec.kind)
        if sub is None:
            raise InvalidField(field, f"reducer {name!r} takes no parameters")
        try:
            json_format.ParseDict(params, getattr(spec, sub))
        except json_format.ParseError as exc:
            raise InvalidField(field, f"bad {name} parameters: {exc}") from None
    return spec


def tap_spec_from_dict(entry: dict[str, Any], field: str) -> pb.TapSpec:
    """One config entry -> TapSpec."""
    if not isinstance(entry, dict):
        raise InvalidField(field, f"expected a mapping, got {type(entry).__name__}")
    entry = dict(entry)
    reducers = entry.pop("reducers", [])
    point = entry.pop("point", None)
    phases = entry.pop("phases", [])
    spec = pb.TapSpec()
    try:
        json_format.ParseDict(entry, spec)
    except json_format.ParseError as exc:
        raise InvalidField(field, str(exc)) from None
    if point is not None:
        name = f"POINT_{str(point).upper()}"
        if name not in pb.Point.keys():
            raise InvalidField(f"{field}.point", f"unknown point {point!r}; valid: {', '.join(POINT_BY_NAME)}")
        spec.point = pb.Point.Value(name)
    if not isinstance(phases, list):
        raise InvalidField(f"{field}.phases", "expected a list, e.g. [prefill, decode]")
    for i, phase in enumerate(phases):
        name = str(phase).upper()
        name = name if name.startswith("PHASE_") else f"PHASE_{name}"
        if name not in pb.Phase.keys():
            valid = ", ".join(k.removeprefix("PHASE_").lower() for k in pb.Phase.keys())
            raise InvalidField(f"{field}.phases[{i}]", f"unknown phase {phase!r}; valid: {valid}")
        spec.phases.append(pb.Phase.Value(name))
    if not isinstance(reducers, list):
        raise InvalidField(f"{field}.reducers", "expected a list")
    for i, r in enumerate(reducers):
        spec.reducers.append(reducer_spec(r, f"{field}.reducers[{i}]"))
    return spec


def load_tap_config(path: str | Path) -> list[pb.TapSpec]:
    """Parse a YAML (``yaml.safe_load``) or JSON tap file."""
    text = Path(path).read_text()
    data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    entries = data.get("taps", []) if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise InvalidField("taps", "expected a list of taps")
    return [tap_spec_from_dict(e, f"taps[{i}]") for i, e in enumerate(entries)]
