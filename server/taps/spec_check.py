"""A tap spec checked field by field before anything is hooked: each refusal names its field.

Why its own module: checking is all the registry does before it takes the
model lock, and it is what a new request field touches; the engine keeps the
taps and their passes.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from layertap.server.compile.stats import CompiledStats
from layertap.server.errors import InvalidField, Unsupported
from layertap.server.host.hooks import POINT_NAMES
from layertap.server.host.model_host import ModelHost
from layertap.server.limits import check_name, check_ttl
from layertap.server.reducers.derive import Derivation
from layertap.server.reducers.derive import derivation as derive_fn
from layertap.server.reducers.plan import ReducerPlan, build_reducers
from layertap.server.reducers.spec import SpecError
from layertap.server.stream.sinks import Sinks
from layertap.server.taps.sampling import Clock, Sampler
from layertap.server.taps.selectors import MAX_SELECTOR_BYTES, select_layers
from layertap.server.taps.tap import check_phases
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["FORWARD_POINTS", "CheckedSpec", "SpecChecker"]

#: Points a request's inline tap may watch: a Generate pass runs no backward.
FORWARD_POINTS = (pb.POINT_OUTPUT, pb.POINT_INPUT)


@dataclass(frozen=True)
class CheckedSpec:
    """What a valid spec asks for, built: its layers, point, phases, derivation, plan and sampler."""

    layers: list[str]
    point: pb.Point.ValueType
    phases: frozenset[int] | None
    derivation: Derivation | None
    plan: ReducerPlan
    sampler: Sampler


class SpecChecker:
    """Checks specs against one host: its layers, its padding and whether its tensors hold tokens."""

    def __init__(self, host: ModelHost, sinks: Sinks, *, token_model: bool, stats: CompiledStats | None,
                 clock: Clock, rng: random.Random) -> None:
        self.host, self.sinks, self.token_model, self.stats = host, sinks, token_model, stats
        self._clock, self._rng = clock, rng

    def check(self, spec: pb.TapSpec, *, kind: pb.TapKind.ValueType, ttl: float | None, owner: str,
              field_prefix: str, trusted_selector: bool, request_id: str | None) -> CheckedSpec:
        """``spec`` built, or the first wrong field's error.

        Raises:
            InvalidField: a field is wrong (the message names it).
            NotFound: the selector matches no layer.
            Unsupported: the model source has no module hooks.
        """
        if spec.name:  # first, as the RPCs checked it before any other field
            self.sinks.check_name(spec.name, owner=owner, field=f"{field_prefix}.name")
        if not self.host.loaded.hooks_supported:
            raise Unsupported(f"model source {self.host.loaded.source!r} does not support module hooks")
        layers = select_layers(spec.selector, self.host.layer_names, f"{field_prefix}.selector",
                               max_bytes=None if trusted_selector else MAX_SELECTOR_BYTES)
        point = spec.point or pb.POINT_OUTPUT
        if point not in POINT_NAMES:
            raise InvalidField(f"{field_prefix}.point", f"unknown point {spec.point}")
        if request_id is not None and point not in FORWARD_POINTS:
            raise InvalidField(f"{field_prefix}.point", "a request's inline tap sees forward passes only: "
                                                       "use point output or input")
        phases = check_phases(spec, field_prefix)
        try:
            derivation = derive_fn(spec.derive, f"{field_prefix}.derive")
        except SpecError as exc:
            raise InvalidField(exc.field, exc.message) from None
        if not spec.reducers:
            raise InvalidField(f"{field_prefix}.reducers", "name at least one reducer, e.g. moments")
        plan = self.plan(spec.reducers, f"{field_prefix}.reducers", spec)
        if ttl is not None:
            check_ttl(ttl)
        if spec.name:
            check_name(spec.name, f"{field_prefix}.name")
        sampler = Sampler(spec.sampling, clock=self._clock, rng=self._rng, field=f"{field_prefix}.sampling")
        self.sinks.check_spec(spec, durable=kind == pb.TAP_KIND_DURABLE, field_prefix=field_prefix)
        if plan.timed and point != pb.POINT_OUTPUT:
            raise InvalidField(f"{field_prefix}.point", "the latency reducer times a module's forward: "
                                                       "use point output")
        return CheckedSpec(layers, point, phases, derivation, plan, sampler)

    def plan(self, reducers: Sequence[pb.ReducerSpec], field: str, spec: pb.TapSpec) -> ReducerPlan:
        """The plan of ``reducers`` for a tap of ``spec``, once it is known to read the folded
        tensors of a tap that leaves padding out.

        Raises:
            InvalidField: A wrong reducer, or a per-channel dim that names the batch or token axis.
        """
        try:
            plan = ReducerPlan(build_reducers(list(reducers), field, tokens=self.token_model), kernel=self.stats)
            if self.host.masked and not spec.keep_padding:
                plan.folded()
        except SpecError as exc:
            raise InvalidField(exc.field, exc.message) from None
        return plan
