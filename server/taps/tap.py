"""A registered tap: its spec, its layers' reducer plans, sampling and counters.

Its own module so that stages downstream (drift, the recorder) can name the
type without importing the engine that drives it. Sinks in stream/ see it
only as a ``stream.sinks.TapView``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from layertap.server.errors import InvalidField
from layertap.server.host.hooks import HookHandle
from layertap.server.host.padding import PaddingCut
from layertap.server.host.rows import RequestCut
from layertap.server.reducers.derive import Derivation
from layertap.server.reducers.latency import LayerTimer
from layertap.server.reducers.plan import ReducerPlan
from layertap.server.stream.summary_wire import timestamp
from layertap.server.taps.sampling import Sampler
from layertap.v1 import telemetry_pb2 as pb

#: Guards ``Tap.deliver``'s sums, written by every subscriber's stream thread.
_DELIVERY_LOCK = threading.Lock()

#: The owner of taps the server creates itself (``--taps``, baselines): no principal.
SERVER_OWNER = ""


@dataclass(slots=True)
class TapCost:
    """One tap's figures for the overhead budget (``taps.budget``), over its current window.

    The model thread writes them (``taps.pass_decision``, :meth:`Tap.settle`); the governor reads and
    clears them at the window's end, on the same thread.
    """

    #: Hook and publishing seconds of its sampled passes, and those passes.
    sampled_seconds: float = 0.0
    sampled_passes: int = 0
    #: Passes its own sampling picked (before the budget's thinning).
    picked: int = 0
    #: The same for its always-on part (``nonfinite`` on unsampled passes): seconds, passes it ran,
    #: and unsampled passes it could have run on.
    always_seconds: float = 0.0
    always_passes: int = 0
    eligible: int = 0
    #: Its cost per sampled pass and per always-on pass: up at once to a window's figure, down a quarter of
    #: the gap a window (``budget._follow``), and kept while a window measures none.
    per_sampled: float = 0.0
    per_always: float = 0.0
    #: Whether the last window measured its sampled passes (``per_sampled`` then holds that window's figure).
    fresh: bool = False
    #: Its plan's estimated seconds per sampled pass (``taps.cost_model``, unscaled; 0: none).
    estimate: float = 0.0
    #: ``Tap.published_*seconds`` already counted.
    published_seen: float = 0.0
    published_always_seen: float = 0.0
    #: The always-on part's stride, and the picks since each part's last thinned run.
    always_stride: int = 1
    thin: int = 0
    thin_always: int = 0
    #: What the last decision counted, to undo it for a pass the tap turned out not to see:
    #: (picked, sampled, always eligible, always ran, thin before, thin_always before).
    last: tuple[bool, bool, bool, bool, int, int] = (False, False, False, False, 0, 0)

    def refund(self) -> None:
        """Undoes the counts of the last decision (see ``taps.pass_decision.refund``)."""
        picked, sampled, eligible, always, self.thin, self.thin_always = self.last
        self.picked -= picked
        self.sampled_passes -= sampled
        self.eligible -= eligible
        self.always_passes -= always
        self.last = (False, False, False, False, self.thin, self.thin_always)


@dataclass
class Tap:
    """A registered tap and its counters."""

    id: str
    spec: pb.TapSpec
    kind: pb.TapKind.ValueType
    layers: list[str]
    plan: ReducerPlan
    always: ReducerPlan | None
    sampler: Sampler
    created_wall: float
    expires_at: float | None = None  # engine clock
    expires_wall: float | None = None
    hits: int = 0
    drops: int = 0
    errors: int = 0
    last_error: str = ""
    disabled: bool = False
    #: The principal that created it (SERVER_OWNER for the server's own: --taps, baselines).
    owner: str = SERVER_OWNER
    handles: list[HookHandle] = field(default_factory=list)
    #: Calls of each layer (point) seen in the current pass.
    calls: dict[str | tuple[str, int], int] = field(default_factory=dict)
    #: Per-layer reducer plans that override ``plan`` (drift baselines freeze
    #: histogram edges per layer).
    layer_plans: dict[str, ReducerPlan] = field(default_factory=dict)
    #: Times each layer's forward when the plan has a latency reducer.
    timer: LayerTimer | None = None
    #: ``PassContext.phase`` values of the passes it sees (``spec.phases``); None: every pass.
    phases: frozenset[int] | None = None
    #: The Generate request whose inline tap this is: it sees only that request's rows of its passes.
    request_id: str | None = None
    #: What it reads of each tensor in place of the tensor (``spec.derive``); None: the tensor itself.
    derive: Derivation | None = None
    #: Its ``TapServing`` state now (the engine's :meth:`~.graph.GraphFeed.serving`); None: eager hooks.
    serving: Callable[[Tap], pb.TapServing.ValueType] | None = field(default=None, repr=False)
    _pass: int = -1
    _sampled: bool = False
    #: The current pass is not for this tap (another phase, or without its request).
    _skip: bool = False
    #: The current pass's cut of its request's rows (request taps only).
    _cut: RequestCut | None = None
    #: The current pass's padding left out of its (batch, tokens) tensors, None to reduce them whole.
    _padding: PaddingCut | None = None
    #: The current pass gives it a result (its flag in ``taps.firing``): seen, and sampled or with ``always``.
    _on: bool = False
    #: Whether the overhead budget may thin it: a client's tap (CreateTap, Subscribe, Generate), not the
    #: server's own (``--taps`` files, drift baselines, made owner SERVER_OWNER whoever asked for them).
    governed: bool = True
    #: The pass running when it was made (None: none): it sees passes from the next one on.
    born: int | None = None
    #: The overhead budget's thinning (``taps.budget``): it samples 1 in ``throttle`` of the passes its own
    #: sampling picks (1: all), and why; its figures for the budget.
    throttle: int = 1
    throttle_reason: str = ""
    cost: TapCost = field(default_factory=lambda: TapCost())
    #: Hook seconds of the current pass (the model thread's; :meth:`settle` books them).
    _spent: float = 0.0
    #: Seconds the host-transfer thread spent publishing its sampled pieces and its unsampled
    #: (always-on) ones; that thread is their only writer.
    published_seconds: float = 0.0
    published_always_seconds: float = 0.0
    #: Seconds subscribers' stream threads spent building and serializing its summaries (``deliver``).
    delivered_seconds: float = 0.0
    delivered_always_seconds: float = 0.0

    def deliver(self, seconds: float, *, always: bool) -> None:
        """Books a stream thread's seconds on its summaries (sampled, or unsampled: ``always``); many
        threads write, so under a lock."""
        with _DELIVERY_LOCK:
            if always:
                self.delivered_always_seconds += seconds
            else:
                self.delivered_seconds += seconds

    @property
    def durable(self) -> bool:
        return self.kind == pb.TAP_KIND_DURABLE

    def settle(self) -> None:
        """Books the last pass's hook time for the budget: to its sampled passes', its always-on part's, or
        to neither (what a pass it is off in costs is the budget's fixed part)."""
        if self._spent:
            if self._sampled:
                self.cost.sampled_seconds += self._spent
            elif self._on:
                self.cost.always_seconds += self._spent
            self._spent = 0.0

    def info(self) -> pb.TapInfo:
        msg = pb.TapInfo(
            id=self.id, spec=self.spec, kind=self.kind, layers=self.layers, hits=self.hits,
            drops=self.drops, errors=self.errors, last_error=self.last_error, disabled=self.disabled,
            created_at=timestamp(self.created_wall), owner=self.owner,
            serving=self.serving(self) if self.serving is not None else pb.TAP_SERVING_EAGER,
            throttle=self.throttle, throttle_reason=self.throttle_reason,
        )
        if self.expires_wall is not None:
            msg.expires_at.CopyFrom(timestamp(self.expires_wall))
        return msg


def check_phases(spec: pb.TapSpec, field_prefix: str = "spec") -> frozenset[int] | None:
    """The phases a spec names, or None when it names none (every pass).

    A phase named twice counts once: ``phases`` is a set, and refusing a
    repeat would only make callers deduplicate.

    Raises:
        InvalidField: An unknown ``Phase`` value, naming ``spec.phases[i]``.
    """
    if not spec.phases:
        return None
    known = set(pb.Phase.values())
    for i, phase in enumerate(spec.phases):
        if phase not in known:
            raise InvalidField(f"{field_prefix}.phases[{i}]",
                               f"unknown phase {phase}; use PHASE_UNSPECIFIED (plain forwards), PHASE_PREFILL "
                               "or PHASE_DECODE")
    return frozenset(spec.phases)
