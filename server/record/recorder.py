"""The flight recorder: a sink that turns a trigger into a stored, replayed incident.

Data flow, by thread:

* model thread: a hook on the root module's input pins a copy of each live
  pass's input (only while some durable tap has triggers, and only with
  ``--record-inputs``); when the pass publishes nothing, it is let go at once;
* host-transfer thread (:meth:`Recorder.on_summaries`): triggers are checked
  on the pass's summaries, the input is unpinned, and the taps that fired
  become one job on a small bounded queue (full: the incidents are dropped and
  counted); the job's input stays counted against ``--record-inputs``;
* recorder thread: replays the input once with captures on the union of the
  firing taps' layers, checks each tap's summaries against it, writes one
  incident per tap to the ring (owned by the tap's owner: see
  ``server/rpc/incidents.py``), counts it and tells the tap's subscribers (a
  ``TapEvent`` of kind ``incident`` whose message is the incident id).

A Generate pass's incident carries its place in the generation (phase,
position, request ids) in its summaries and in every stored tensor's header;
``Incident`` itself has no field for it. A decode step is never replayed: it
reads its requests' KV cache, which is not retained, so its input is not kept
either. A prefill is replayed when its pass named its inputs
(``PassContext.inputs``).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from layertap.server.codec import tensor_to_bytes, wire_dtype
from layertap.server.drift.monitor import DriftMonitor
from layertap.server.drift.phases import phase_name
from layertap.server.host.hooks import POINT_NAMES
from layertap.server.host.inputs import ModelInputs
from layertap.server.host.model_host import PHASE_DECODE, PHASE_NONE, PassContext, flatten_tensors
from layertap.server.host.priority import telemetry_thread
from layertap.server.record.replay import Share, anomalous_rows, replay
from layertap.server.record.retention import InputRetention
from layertap.server.record.store import IncidentStore, StoredTensor, new_id
from layertap.server.record.tap_events import TapEvents
from layertap.server.record.triggers import Firing, RateLimit, check_triggers, enabled, evaluate, interval_of
from layertap.server.stream.sinks import Sink, TapView
from layertap.server.stream.summary_wire import Place, timestamp
from layertap.v1 import telemetry_pb2 as pb

log = logging.getLogger(__name__)

#: Passes waiting for a replay; more in a burst are dropped and counted.
JOB_QUEUE = 8
#: Longest replay note kept in an incident.
NOTE_CHARS = 2000


@dataclass
class _Job:
    """One pass that set off triggers: every tap that fired, and its input."""

    ctx: PassContext
    inputs: ModelInputs | None
    firings: list[tuple[TapView, Firing]] = field(default_factory=list)


class Recorder(Sink):
    """Triggers, input retention, replay and the incident ring, for one server.

    Args:
        taps: The tap engine, as the recorder may use it: its host runs the replays, its events tell subscribers.
        store: The on-disk ring.
        record_bytes: Host memory for retained inputs; 0 records incidents without input or replay.
        drift: Where the mean trigger finds a layer's baseline.
    """

    def __init__(self, taps: TapEvents, store: IncidentStore, *, record_bytes: int = 0,
                 drift: DriftMonitor | None = None, registry: CollectorRegistry | None = None,
                 model_name: str = "", clock: Callable[[], float] = time.monotonic) -> None:
        self.taps = taps
        self.host = taps.host
        self.store = store
        self.drift = drift
        self.retention = InputRetention(record_bytes) if record_bytes > 0 else None
        self.limits = RateLimit(clock)
        self._taps: dict[str, TapView] = {}
        self._lock = threading.Lock()
        self._input_hook: object | None = None
        self._jobs: queue.Queue[_Job | None] = queue.Queue(JOB_QUEUE)
        #: Kinds of failure whose traceback was logged (once each; later ones get one line).
        self._traced: set[str] = set()
        #: Firings refused by the rate limit, and incidents lost to a full job queue.
        self.rate_limited = 0
        self.dropped = 0
        self._incidents: Counter | None = None
        if registry is not None:
            self._incidents = Counter("layertap_incidents", "Flight-recorder incidents recorded, by tap and trigger.",
                                      ("model", "tap", "trigger"), registry=registry)
            self._model = model_name
            registry.register(_RecorderCollector(self, model_name))
        self._thread = telemetry_thread(self._run, "layertap-recorder")  # see host.priority
        self._thread.start()

    # -- taps (RPC threads) ----------------------------------------------------
    def check_spec(self, spec: pb.TapSpec, *, durable: bool, field_prefix: str) -> None:
        check_triggers(spec, durable=durable, field_prefix=field_prefix)

    def on_tap_created(self, tap: TapView) -> None:
        if not tap.durable or not enabled(tap.spec.triggers):
            return
        with self._lock:
            self._taps[tap.id] = tap
            if self.retention is not None and self._input_hook is None:
                # The root module's input is the pass's input, already on the device.
                with self.host.pass_lock():
                    self._input_hook = self.host.hooks.add("", pb.POINT_INPUT, self._keep_input)

    def on_tap_removed(self, tap: TapView, reason: str) -> None:
        with self._lock:
            current = self._taps.get(tap.id)
            if current is None or current is not tap:
                return
            del self._taps[tap.id]
            self.limits.forget(tap.id)
            if not self._taps and self._input_hook is not None:
                self._input_hook.remove()  # type: ignore[attr-defined]
                self._input_hook = None

    # -- model thread --------------------------------------------------------------
    def _keep_input(self, ctx: PassContext, args: object) -> None:
        if ctx.active or self.retention is None or _unreplayable(ctx) is not None:
            return
        # A server-side pass knows its positional and keyword inputs; a training step only its arguments.
        inputs = ctx.inputs if ctx.inputs is not None else ModelInputs.positional([t for _k, t in flatten_tensors(args)])
        if not all(isinstance(t, torch.Tensor) for t in inputs.tensors()):
            return  # a cache object among them: the pass depends on state a copy would not hold
        if inputs.nbytes <= self.retention.max_bytes:
            # A copy, taken before the forward runs: a model may write to its input in place.
            # On CUDA it is asynchronous (pinned); it is read only from on_summaries, after the
            # host-transfer thread waited on the pass's event, recorded later on the same stream.
            inputs = inputs.map(lambda t, _i: t.detach().to("cpu", non_blocking=True, copy=True))
        self.retention.keep(ctx.index, inputs)

    def on_pass_skipped(self, ctx: PassContext) -> None:
        """A pass that publishes no summaries is never evaluated: let its input go."""
        if self.retention is not None:
            self.retention.forget(ctx.index)

    # -- host-transfer thread ------------------------------------------------------
    def wants_summaries(self, tap_id: str) -> bool:
        """Only a tap with triggers: no other can fire (the pass's input is let go all the same)."""
        with self._lock:
            return tap_id in self._taps

    def on_summaries(self, ctx: PassContext, summaries: list[pb.Summary]) -> None:
        inputs = self.retention.take(ctx.index) if self.retention is not None else None
        queued = False
        try:
            firings = self._fired(ctx, summaries)
            if firings:
                self._jobs.put_nowait(_Job(ctx, inputs, firings))
                queued = True  # the recorder thread releases the input
        except queue.Full:
            self.dropped += len(firings)
            log.warning("incidents on taps %s dropped: %d replays already queued",
                        ",".join(t.id for t, _f in firings), JOB_QUEUE)
        finally:
            if not queued and self.retention is not None:
                self.retention.release(inputs)

    def _fired(self, ctx: PassContext, summaries: list[pb.Summary]) -> list[tuple[TapView, Firing]]:
        """The taps whose triggers fired on this pass and passed the rate limit."""
        with self._lock:
            taps = dict(self._taps)
        if not taps or ctx.active:
            return []
        fired: list[tuple[TapView, Firing]] = []
        by_tap: dict[str, list[pb.Summary]] = {}
        for s in summaries:
            if s.tap in taps:
                by_tap.setdefault(s.tap, []).append(s)
        for tap_id, group in by_tap.items():
            tap = taps[tap_id]
            triggers = tap.spec.triggers
            # A derived tap (entropy) is held against its own derived baseline, never the tensor's.
            firing = evaluate(triggers, group, functools.partial(self._baseline, derive=tap.spec.derive))
            if firing is None:
                continue
            admitted = set(self.limits.admit(tap_id, firing.triggers, interval_of(triggers)))
            if not admitted:
                self.rate_limited += 1
                continue
            layers = {k: [n for n in v if n in admitted] for k, v in firing.layers.items()}
            layers = {k: v for k, v in layers.items() if v}
            hits = [s for s in firing.summaries if s.layer in layers]
            fired.append((tap, Firing(layers, hits)))
        return fired

    def _baseline(self, layer: str, point: int, phase: int = 0, *, derive: int = 0) -> tuple[float, float] | None:
        if self.drift is None:
            return None
        b = self.drift.baseline_for(layer, POINT_NAMES.get(point or pb.POINT_OUTPUT, "output"), phase_name(phase),
                                    derive=derive)
        return None if b is None else (b.mean, b.std)

    # -- recorder thread -------------------------------------------------------------
    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._record(job)
            except Exception as exc:  # one bad incident must not stop the recorder
                # A full disk fails every incident (about one a second): one line each, the traceback
                # once per kind of failure.
                kind = type(exc).__name__
                if kind in self._traced:
                    log.error("recording incidents of pass %d failed: %s: %s (traceback logged at the first such "
                              "failure)", job.ctx.index, kind, exc)
                else:
                    self._traced.add(kind)
                    log.exception("recording incidents of pass %d failed", job.ctx.index)
            finally:
                if self.retention is not None:
                    self.retention.release(job.inputs)
                self._jobs.task_done()

    def _record(self, job: _Job) -> list[pb.Incident]:
        """One replay for the pass, then one incident per tap that fired."""
        ctx, cap = job.ctx, self.store.limits.max_incident_bytes
        input_bytes = job.inputs.nbytes if job.inputs is not None else 0
        shares = [Share(tap, firing.summaries, cap - input_bytes, self._rows_finder(tap, firing),
                        rows={layer: set() for layer in firing.layers}) for tap, firing in job.firings]
        captured: dict[tuple[str, int, int, int], torch.Tensor] = {}
        note = ""
        if job.inputs is None:
            note = ("the input was not retained: --record-inputs is off" if self.retention is None
                    else _unreplayable(ctx)
                    or "the input was not retained (pushed out by the --record-inputs bound or lost)")
        else:
            try:
                captured = replay(self.host, shares, job.inputs)
            except Exception as exc:  # noqa: BLE001 - the incident says so
                note = f"the replay raised {type(exc).__name__}: {exc}"[:NOTE_CHARS]
        replayed = job.inputs is not None and not note
        return [self._write(ctx, firing, share, job.inputs if replayed else None, captured, note)
                for (_tap, firing), share in zip(job.firings, shares)]

    def _rows_finder(self, tap: TapView, firing: Firing) -> Callable[[str, torch.Tensor], list[int]]:
        point = tap.spec.point or pb.POINT_OUTPUT
        return lambda layer, t: anomalous_rows(t, tap.spec.triggers, firing.layers[layer],
                                               self._baseline(layer, point, derive=tap.spec.derive))

    def _write(self, ctx: PassContext, firing: Firing, share: Share, inputs: ModelInputs | None,
               captured: dict[tuple[str, int, int, int], torch.Tensor], note: str) -> pb.Incident:
        tap = share.tap
        rec = pb.Incident(id=new_id(time.time()), tap=tap.id, triggers=firing.triggers, pass_index=ctx.index,
                          time=timestamp(ctx.wall_time), summaries=firing.summaries, replay_note=note)
        tensors: list[StoredTensor] = []
        if inputs is not None:
            rec.replayed = True
            rec.replay_matches = not share.problems
            rec.replay_note = "; ".join(share.problems)[:NOTE_CHARS]
            rec.tensors_dropped = share.dropped
            tensors = [_stored(t, "", pb.POINT_INPUT, i, 0, ctx) for i, t in enumerate(inputs.tensors())]
            tensors += [_stored(captured[key], key[0], key[1], key[3], key[2], ctx) for key in share.kept]
        rec.layers.extend(pb.IncidentLayer(layer=layer, point=share.point, triggers=names,
                                           rows=sorted(share.rows[layer]))
                          for layer, names in firing.layers.items())
        rec.rows.extend(sorted(set().union(*share.rows.values())))
        self.store.write(rec, tensors, owner=tap.owner)  # the tap's owner owns what its trigger recorded
        if self._incidents is not None:
            for name in rec.triggers:
                self._incidents.labels(self._model, tap.id, name).inc()
        self.taps.event(tap, "incident", rec.id)
        log.warning("incident %s: tap %s, triggers %s, layers %s, rows %s, replay %s", rec.id, tap.id,
                    ",".join(rec.triggers), ",".join(firing.layers), list(rec.rows),
                    "matches" if rec.replay_matches else f"differs/absent ({rec.replay_note[:200]})")
        return rec

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Block until every queued incident is written (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._jobs.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._jobs.unfinished_tasks

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(5.0)


def _unreplayable(ctx: PassContext) -> str | None:
    """Why a live pass cannot be replayed from its input alone, or None when it can."""
    if ctx.phase == PHASE_DECODE:
        return "a decode step reads its requests' KV cache, which is not retained: no replay"
    if ctx.phase != PHASE_NONE and ctx.inputs is None:
        return "the Generate pass did not name its inputs: no replay"
    return None


def _stored(t: torch.Tensor, layer: str, point: int, index: int, call: int, ctx: PassContext) -> StoredTensor:
    """A replayed tensor, headed by the live pass that fired (its index, training step and place in a generation)."""
    data = tensor_to_bytes(t)
    header = pb.CaptureHeader(layer=layer, point=point, output_index=index, call_index=call,
                              dtype=wire_dtype(t.dtype), shape=list(t.shape), pass_index=ctx.index,
                              total_bytes=len(data))
    if ctx.step is not None:
        header.step, header.has_step = ctx.step, True
    if (place := Place.of_pass(ctx)) is not None:
        place.stamp(header)
    return StoredTensor(header, data)


class _RecorderCollector(Collector):
    """The recorder's counters, read at scrape time."""

    def __init__(self, recorder: Recorder, model: str) -> None:
        self._r = recorder
        self._model = model

    def collect(self) -> Iterator[Metric]:
        r, m = self._r, [self._model]
        for name, doc, value in (
            ("layertap_record_lost_passes", "Passes whose retained input went before their summaries were evaluated.",
             r.retention.lost if r.retention is not None else 0),
            ("layertap_incidents_rate_limited", "Trigger firings refused by the per-trigger rate limit.", r.rate_limited),
            ("layertap_incidents_dropped", "Incidents lost because the replay queue was full.", r.dropped),
            ("layertap_incident_files_skipped", "Incident files that could not be read (corrupt or truncated).",
             r.store.skipped_files),
        ):
            family = CounterMetricFamily(name, doc, labels=["model"])
            family.add_metric(m, value)
            yield family

