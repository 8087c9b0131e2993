"""Triggers: which layers of a durable tap's pass record an incident.

A trigger reads only the summaries the tap already produced, on the
host-transfer thread, so checking costs nothing on the model thread. Each
trigger needs the reducer it reads; :func:`check_triggers` refuses a spec that
lacks it, naming the field, rather than a trigger that can never fire.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from layertap.server.errors import InvalidField, Unsupported
from layertap.server.stream.sinks import Sink
from layertap.v1 import telemetry_pb2 as pb

NONFINITE = "nonfinite"
ABS_MAX = "abs_max"
MEAN_SIGMA = "mean_sigma"
#: Seconds between two incidents of one trigger when the spec leaves it 0.
DEFAULT_INTERVAL_SECONDS = 60.0
#: Longest interval a spec may ask for (a day): beyond it a typo silences a trigger.
MAX_INTERVAL_SECONDS = 86400.0
#: Shortest (besides 0, the default): each incident replays a forward pass and
#: takes a place in the shared ring, so a tap may not fire on every pass.
MIN_INTERVAL_SECONDS = 1.0
#: The reducer each trigger reads.
NEEDS: dict[str, int] = {
    NONFINITE: pb.REDUCER_KIND_NONFINITE,
    ABS_MAX: pb.REDUCER_KIND_ABS_MAX,
    MEAN_SIGMA: pb.REDUCER_KIND_MOMENTS,
}
#: Points a replay can reproduce: a forward pass has no gradients.
REPLAYABLE_POINTS = (pb.POINT_OUTPUT, pb.POINT_INPUT)

#: ``(layer, point name) -> (baseline mean, baseline std)``, or None without a baseline.
BaselineLookup = Callable[[str, int, int], "tuple[float, float] | None"]


def enabled(triggers: pb.Triggers) -> list[str]:
    """Names of the triggers a spec turns on."""
    on = []
    if triggers.nonfinite:
        on.append(NONFINITE)
    if triggers.abs_max_above:
        on.append(ABS_MAX)
    if triggers.mean_sigma:
        on.append(MEAN_SIGMA)
    return on


def check_triggers(spec: pb.TapSpec, *, durable: bool, field_prefix: str = "spec") -> None:
    """Validate ``spec.triggers`` against the rest of the spec.

    Raises:
        InvalidField: Triggers on a stream tap, on a gradient point, without the
            reducer they read, or with a negative or non-finite value.
    """
    if not spec.HasField("triggers"):
        return
    t, where = spec.triggers, f"{field_prefix}.triggers"
    for name in ("abs_max_above", "mean_sigma", "min_interval_seconds"):
        v = getattr(t, name)
        if not math.isfinite(v) or v < 0:
            raise InvalidField(f"{where}.{name}", f"must be a finite value >= 0 (0 = off/default), got {v}")
    if t.min_interval_seconds > MAX_INTERVAL_SECONDS or 0 < t.min_interval_seconds < MIN_INTERVAL_SECONDS:
        raise InvalidField(f"{where}.min_interval_seconds", f"{MIN_INTERVAL_SECONDS:g} to {MAX_INTERVAL_SECONDS:g} "
                                                           f"seconds (0: {DEFAULT_INTERVAL_SECONDS:g}), got {t.min_interval_seconds}")
    on = enabled(t)
    if not on:
        return
    if not durable:
        raise InvalidField(where, "triggers work on durable taps only (CreateTap or a --taps file)")
    if (spec.point or pb.POINT_OUTPUT) not in REPLAYABLE_POINTS:
        raise InvalidField(where, "triggers need point output or input: a replayed forward pass has no gradients")
    kinds = {r.kind for r in spec.reducers}
    for name in on:
        if NEEDS[name] not in kinds:
            reducer = pb.ReducerKind.Name(NEEDS[name]).removeprefix("REDUCER_KIND_").lower()
            raise InvalidField(f"{where}.{name}", f"needs the {reducer} reducer in {field_prefix}.reducers")


class TriggerCheck(Sink):
    """The sink that answers for ``spec.triggers`` when no recorder runs.

    A spec that turns a trigger on is refused, naming the flag that would
    record it, rather than accepted and never fired. (With ``--incident-dir``
    the recorder answers instead, with :func:`check_triggers` alone.)
    """

    def check_spec(self, spec: pb.TapSpec, *, durable: bool, field_prefix: str) -> None:
        check_triggers(spec, durable=durable, field_prefix=field_prefix)
        if enabled(spec.triggers):
            raise Unsupported(f"{field_prefix}.triggers: start the server with --incident-dir to record incidents",
                              field=f"{field_prefix}.triggers")


def _results(summary: pb.Summary) -> dict[str, pb.ReducerResult]:
    return {r.WhichOneof("value") or "": r for r in summary.results}


def fired(triggers: pb.Triggers, summary: pb.Summary, baseline: BaselineLookup) -> list[str]:
    """The triggers one summary sets off."""
    res = _results(summary)
    out = []
    if triggers.nonfinite and "nonfinite" in res:
        nf = res["nonfinite"].nonfinite
        if nf.nan_count + nf.inf_count > 0:
            out.append(NONFINITE)
    if triggers.abs_max_above and "abs_max" in res:
        v = res["abs_max"].abs_max.value
        if v > triggers.abs_max_above or math.isnan(v):
            out.append(ABS_MAX)
    if triggers.mean_sigma and "moments" in res:
        ref = baseline(summary.layer, summary.point, summary.phase)  # a decode step against a decode baseline
        if ref is not None:
            mean, std = ref
            m = res["moments"].moments.mean
            if std > 0 and (math.isnan(m) or abs(m - mean) > triggers.mean_sigma * std):
                out.append(MEAN_SIGMA)
    return out


@dataclass
class Firing:
    """One tap's triggers in one pass: layer -> trigger names, and the summaries that fired."""

    layers: dict[str, list[str]]
    summaries: list[pb.Summary]

    @property
    def triggers(self) -> list[str]:
        return sorted({name for names in self.layers.values() for name in names})


def evaluate(triggers: pb.Triggers, summaries: Iterable[pb.Summary], baseline: BaselineLookup) -> Firing | None:
    """Every layer of one tap's pass that fired, or None."""
    layers: dict[str, list[str]] = {}
    hits: list[pb.Summary] = []
    for s in summaries:
        names = fired(triggers, s, baseline)
        if names:
            have = layers.setdefault(s.layer, [])
            have.extend(n for n in names if n not in have)
            hits.append(s)
    return Firing(layers, hits) if layers else None


class RateLimit:
    """At most one incident per (tap, trigger) per interval; thread-safe."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._last: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def admit(self, tap: str, names: list[str], interval: float) -> list[str]:
        """The triggers among ``names`` allowed now; marks them as used."""
        now = self._clock()
        with self._lock:
            ok = [n for n in names if now - self._last.get((tap, n), -math.inf) >= interval]
            for n in ok:
                self._last[(tap, n)] = now
            return ok

    def forget(self, tap: str) -> None:
        """A deleted tap's limits go with it (a new tap of that name starts fresh)."""
        with self._lock:
            for key in [k for k in self._last if k[0] == tap]:
                del self._last[key]


def interval_of(triggers: pb.Triggers) -> float:
    return triggers.min_interval_seconds or DEFAULT_INTERVAL_SECONDS
