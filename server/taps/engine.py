"""Taps: hooks that run reducers on chosen layers and publish summaries.

The hot path (a hook) only launches reducer kernels and appends their result
vector to the pass buffer: no host sync. When the pass ends the buffer goes
to the host-transfer thread in one device-to-host copy, and its values to the
publisher (``stream.publisher``), which turns them into ``Summary`` messages
for the broker and the sinks (metrics, drift, recorder). The engine never
sees a summary.

A tap whose every plan is basic fires as one ``layertap::tap_stats`` call
into a row of the pass's buffer (``taps.firing``); the rest take the plan
path (``taps.plan_path``). Which passes feed a tap, and what it
reduces of each tensor, is settled once per pass (``taps.pass_decision``).
A tap that derives a quantity (``TapSpec.derive``: per-token entropy of the
logits) reads it in place of each tensor, before the cut and the fold.
"""

from __future__ import annotations

import logging
import random
import secrets
import threading
import time

from layertap.server.compile.kernel import BATCH, DENSE, Signature
from layertap.server.compile.serving import CompiledServing
from layertap.server.compile.stats import CompiledStats
from layertap.server.errors import AlreadyExists, LimitExceeded, NotFound, echo
from layertap.server.host.hooks import POINT_NAMES
from layertap.server.host.model_host import ModelHost, PassContext
from layertap.server.reducers.batched import BATCH_DTYPES
from layertap.server.reducers.latency import LayerTimer
from layertap.server.reducers.spec import TOKEN_MODEL_SOURCES
from layertap.server.reducers.transfer import DEFAULT_TRANSFER_BYTES, HostTransfer, PassBuffer
from layertap.server.stream.broker import Broker
from layertap.server.stream.publisher import Piece, Publisher
from layertap.server.stream.sinks import Sinks, TapView
from layertap.server.taps.budget import Governor
from layertap.server.taps.cost_model import CostModel
from layertap.server.taps.firing import Firing, OpLayout, op_eligible, plans_op_eligible
from layertap.server.taps.graph import GraphFeed
from layertap.server.taps.layer_hooks import TapHooks
from layertap.server.taps.pass_decision import PassDecisions, refund
from layertap.server.taps.plan_path import PlanPath
from layertap.server.taps.sampling import Clock
from layertap.server.taps.shared_streams import SharedStreams
from layertap.server.taps.spec_check import SpecChecker
from layertap.server.taps.tap import SERVER_OWNER, Tap
from layertap.v1 import telemetry_pb2 as pb

log = logging.getLogger("layertap.server")

DEFAULT_TTL_SECONDS = 600.0

class TapEngine:
    """Owns every tap on a model host; is the host's pass observer.

    Args:
        publisher: Where pass values and tap events go; the app builds it. Without
            one the engine makes its own from ``broker`` and ``sinks``.
        stats: The compiled basic-statistics kernel its plans use (``app.py``'s); None: eager.
        graph: The host's compiled serving (``serve --compile-model``), fed the taps' in-graph statistics.
        budget: The share of pass time hooks may take (``taps.budget``); 0, the default here, turns it off.
    """

    def __init__(self, host: ModelHost, broker: Broker | None = None, *, clock: Clock = time.monotonic,
                 wall: Clock = time.time, max_taps: int = 64, rng: random.Random | None = None,
                 transfer_queue: int = 64, sinks: Sinks | None = None,
                 transfer_bytes: int = DEFAULT_TRANSFER_BYTES, publisher: Publisher | None = None,
                 stats: CompiledStats | None = None, graph: CompiledServing | None = None,
                 budget: float = 0.0) -> None:
        self.host = host
        self.stats = stats
        self.publisher = publisher if publisher is not None else Publisher(broker, sinks)
        self.clock = clock
        self.wall = wall
        self.max_taps = max_taps
        #: Whether the model's 3-d tensors are ``(batch, tokens, hidden)``: the
        #: default feature axis of per-channel reducers and drift is then the last.
        self.token_model = host.loaded.source in TOKEN_MODEL_SOURCES
        self.checker = SpecChecker(host, self.publisher.sinks, token_model=self.token_model, stats=stats, clock=clock,
                                   rng=rng or random.Random())
        #: The overhead budget (``serve --tap-budget``): thins taps' sampling to keep hooks within it.
        self.governor = Governor(budget, clock)
        #: Plans' costs measured per element and per firing, for admission (``taps.cost_model``).
        self.costs = CostModel(host)
        self._lock = threading.RLock()
        self._taps: dict[str, Tap] = {}
        #: Stream taps that subscribers share (``taps.shared_streams``).
        self.streams = SharedStreams()
        #: The taps as a tuple, for the model thread's pass decision (copy-on-write under the lock).
        self._tap_list: tuple[Tap, ...] = ()
        self._buffer: PassBuffer | None = None
        self._pieces: list[Piece[Tap]] = []
        self._hook_seconds = 0.0
        self.reducer_errors = 0
        #: Whether basic taps fire as one ``layertap::tap_stats`` call (``taps.firing``); benchmarks compare.
        self.use_op = True
        #: Each tap's hooked firings, and the layout binding the op-eligible ones to rows (None: none).
        self._firings: dict[str, list[Firing]] = {}
        self._layout: OpLayout | None = None
        #: Taps changed while a pass may run: the layout is rebuilt when it ends.
        self._relayout_due = False
        # Bounded in bytes too: one pass of wide taps holds megabytes of values.
        self.transfer = HostTransfer(maxsize=transfer_queue, max_bytes=transfer_bytes)
        #: Model thread only: each tap's pass, settled once (sampling, phases, request rows, padding).
        self.decisions = PassDecisions()
        #: Firings that are not one op call: reduced by their plans (``taps.plan_path``).
        self.plans = PlanPath(host.modules, stats, self.decisions.decide, self._pass_buffer, self._fail)
        #: One hook per hooked (layer, point) for all taps; a pass calls the firings of the taps on in it.
        self.tap_hooks = TapHooks(host.hooks, self._decide_all)
        #: Feeds compiled passes' in-graph statistics to the taps (``serve --compile-model``).
        self.graph_feed = GraphFeed(host, self.all_taps, self._pass_buffer, graph, self.tap_hooks.torch_handles)
        if graph is not None:
            graph.taps = self.graph_feed
        host.add_observer(self)

    @property
    def broker(self) -> Broker:
        return self.publisher.broker

    @property
    def sinks(self) -> Sinks:
        """Downstream consumers (see stream.sinks); they answer spec checks too."""
        return self.publisher.sinks

    # -- registry ------------------------------------------------------------
    def create(self, spec: pb.TapSpec, *, kind: pb.TapKind.ValueType = pb.TAP_KIND_DURABLE, ttl: float | None = None,
               forever: bool = False, field_prefix: str = "spec", trusted_selector: bool = False,
               owner: str = SERVER_OWNER, request_id: str | None = None) -> Tap:
        """Validate ``spec``, install hooks and return the new tap.

        ``trusted_selector`` lifts the selector size cap for selectors the
        server writes itself (a reloaded baseline lists all its layers).
        ``request_id`` binds the tap to one Generate request: it fires only on
        passes that hold the request and reduces only the request's rows (see
        ``taps.rows`` for what is sliced and what is reduced whole); its
        summaries name that request alone. Such a tap watches a forward point.

        Raises:
            InvalidField: a field is wrong (the message names it).
            NotFound: the selector matches no layer.
            LimitExceeded: too many taps.
        """
        checked = self.checker.check(spec, kind=kind, ttl=ttl, owner=owner, field_prefix=field_prefix,
                                     trusted_selector=trusted_selector, request_id=request_id)
        layers, point, plan = checked.layers, checked.point, checked.plan
        if owner != SERVER_OWNER:  # admission by cost (each plan and shape timed once, on the model thread)
            with self._lock:  # first what the lock checks again below: a refusal for those costs no timing
                self._check_room(spec.name, field_prefix)
            op = self.use_op and plans_op_eligible([plan], derived=checked.derivation is not None,
                                                   request=request_id is not None, point=point)
            estimate = self.costs.admit(plan, layers, point, governor=self.governor, owner=owner, op=op,
                                        live=self._tap_list, field=f"{field_prefix}.reducers")
        # Lock order everywhere: the model lock, then the engine lock. Hooks go
        # in between passes, so a tap never sees half a pass.
        with self.host.pass_lock(), self._lock:
            tap_id = spec.name or f"tap-{secrets.token_hex(4)}"
            self._check_room(tap_id, field_prefix)
            stored = pb.TapSpec()
            stored.CopyFrom(spec)
            stored.point = point
            tap = Tap(tap_id, stored, kind, layers, plan, plan.nonfinite_only(), checked.sampler, self.wall())
            tap.owner, tap.governed = owner, owner != SERVER_OWNER
            if owner != SERVER_OWNER:
                tap.cost.estimate = estimate
            # Made during a pass (a training step runs without the model lock): it starts with the next.
            tap.born = self.host.current_pass_index()
            tap.phases, tap.request_id, tap.derive = checked.phases, request_id, checked.derivation
            tap.serving = self.graph_feed.serving
            if kind == pb.TAP_KIND_DURABLE and not forever:
                life = DEFAULT_TTL_SECONDS if ttl is None else ttl
                tap.expires_at = self.clock() + life
                tap.expires_wall = self.wall() + life
            firings = self._firings[tap_id] = [Firing(tap, layer, self.plans.fire, self._fail) for layer in layers]
            self.tap_hooks.add(firings, point)
            if plan.timed:
                # Added after the tap's own hook: its stop hook is prepended, so it runs first.
                timer = tap.timer = LayerTimer(self.host.device)
                for layer in layers:
                    def start(ctx: PassContext, _v: object, _l: str = layer) -> None:
                        timer.start(_l, ctx.index)

                    def stop(_ctx: PassContext, _v: object, _l: str = layer) -> None:
                        timer.stop(_l)

                    tap.handles.append(self.host.hooks.add_timer(layer, start, stop))
            self._taps[tap_id] = tap
            self._tap_list = tuple(self._taps.values())
            self._update_reuse()
            self._relayout()
        self.publisher.tap_created(tap)
        if plan.needs_basic_stats and self.stats is not None and not (self.use_op and op_eligible(tap)):
            # Compile ahead for what the hooked layers produce in a server pass
            # (the model's dtype, dense, inference mode), so the first passes
            # already run compiled; other signatures are queued when first seen.
            for form in (DENSE, BATCH) if self.host.dtype in BATCH_DTYPES else (DENSE,):
                self.stats.compile_ahead(Signature(self.host.device, self.host.dtype, form,
                                                       grad=False, inference=True, autocast=None))
        log.info("tap %s created: kind=%s layers=%d point=%s", tap_id, pb.TapKind.Name(kind), len(layers), POINT_NAMES[point])
        return tap

    def _check_room(self, name: str, field_prefix: str) -> None:
        """Room for one more tap, and ``name`` free (under the engine lock)."""
        if len(self._taps) >= self.max_taps:
            raise LimitExceeded(f"{len(self._taps)} taps exist, the server limit is {self.max_taps}")
        if name in self._taps:
            # The holder's owner lets the RPC layer tell the caller's own name from another's.
            raise AlreadyExists(f"{field_prefix}.name: a tap named {echo(name)} exists; delete it or pick "
                                "another name", field=f"{field_prefix}.name", metadata={"owner": self._taps[name].owner})

    def delete(self, tap_id: str, reason: str = "deleted") -> Tap:
        with self._lock:
            tap = self._taps.pop(tap_id, None)
            self.streams.forget(tap_id)
            self._tap_list = tuple(self._taps.values())
            self._update_reuse()  # off before the hooks go: a firing meanwhile reduces afresh, never wrongly
            # A pass may be running (no model lock here): its layout stays until the pass ends; the
            # tap's hooks go now, so it fires no more.
            self._relayout_due = True
            if tap is not None:
                self._unhook(tap)
            self._firings.pop(tap_id, None)
        if tap is None:
            raise NotFound(f"no tap {echo(tap_id)}; list taps with ListTaps / client.taps()")
        self.publisher.tap_removed(tap, reason)
        log.info("tap %s %s", tap_id, reason)
        return tap

    def set_layer_reducers(self, tap_id: str, layer: str, reducers: list[pb.ReducerSpec], *,
                           tap: Tap | None = None) -> None:
        """Give one layer of a tap its own reducers (e.g. frozen histogram edges).

        Args:
            tap: The tap the caller means. A tap deleted and re-created under the
                same id (a replaced baseline) is another tap and must not get
                the old one's plan: NotFound, as when the id is gone.
        """
        current: Tap = tap if tap is not None else self.get(tap_id)
        plan = self.checker.plan(reducers, f"{tap_id}.{layer}.reducers", current.spec)
        with self.host.pass_lock(), self._lock:  # between passes: a pass never mixes plans
            live = self._taps.get(tap_id)
            if live is None or live is not current:
                raise NotFound(f"no tap {echo(tap_id)} (deleted or replaced meanwhile)")
            live.layer_plans[layer] = plan
            self._relayout()

    def get(self, tap_id: str) -> Tap:
        tap = self.find(tap_id)
        if tap is None:
            raise NotFound(f"no tap {echo(tap_id)}; list taps with ListTaps / client.taps()")
        return tap

    def find(self, tap_id: str) -> Tap | None:
        """The tap, or None (a stream's summaries may outlive their tap)."""
        with self._lock:
            return self._taps.get(tap_id)

    def event(self, tap: TapView, kind: str, message: str) -> None:
        """Tells the tap's subscribers now (a sink's event: the recorder's incidents)."""
        self.publisher.event(tap, kind, message)

    def all_taps(self) -> list[Tap]:
        with self._lock:
            return list(self._taps.values())

    def is_durable(self) -> dict[str, bool]:
        with self._lock:
            return {k: t.durable for k, t in self._taps.items()}

    def expire(self) -> list[str]:
        """Delete durable taps whose TTL has passed; returns their ids."""
        now = self.clock()
        with self._lock:
            due = [t.id for t in self._taps.values() if t.expires_at is not None and t.expires_at <= now]
        for tap_id in due:
            try:
                self.delete(tap_id, reason="expired")
            except NotFound:
                pass
        return due

    def _update_reuse(self) -> None:
        """Recompute the plan path's ``reuse_on`` from the live taps (the caller holds the engine lock)."""
        self.plans.reuse_on = self.plans.reuse.possible(
            (layer, t.spec.point) for t in self._taps.values() for layer in t.layers)

    def _relayout(self) -> None:
        """Binds the op-eligible taps' firings to rows of a new layout (under the engine lock). Never raises.

        A training step runs without the model lock: while the current layout holds a pass's rows, the
        rebuild waits for that pass's end (new taps take the plan path until then), as after a failure."""
        old = self._layout
        if old is not None and (old.dirty or old.fired):
            self._relayout_due = True
            return
        self._relayout_due = False
        if old is not None:
            old.unbind()
        self._layout = None
        firings = [f for tap in self._taps.values() if self.use_op and not tap.disabled and op_eligible(tap)
                   for f in self._firings.get(tap.id, ())]
        try:
            self._layout = OpLayout(firings, self.host.device, self.decisions.decide, self.host.masked) \
                if firings else None
        except Exception:
            log.exception("could not lay out the taps' rows; they run on the plan path until the next pass")
            self._relayout_due = True
        finally:
            self.tap_hooks.changed()  # bound or unbound: the layer hooks choose their firings again

    def _decide_all(self, ctx: PassContext) -> tuple[int, ...]:
        """Every tap's pass, decided at the pass's first hook (``taps.layer_hooks``); each tap's id,
        negated when it is off. A tap whose decision raises is disabled; the others are decided."""
        taps = self._tap_list
        decide = self.decisions.decide
        for tap in taps:
            try:
                decide(tap, ctx)
            except Exception as exc:  # noqa: BLE001 - a tap must never fail inference
                tap._skip, tap._on = True, False
                self._fail(tap, "(its pass decision)", exc)
        return tuple(id(t) if t._on else -id(t) for t in taps)

    def _unhook(self, tap: Tap) -> None:
        with self._lock:  # its own firings: a tap made since under the same id keeps its own
            self.tap_hooks.remove([f for f in self._firings.get(tap.id, ()) if f.tap is tap], tap.spec.point)
        for h in tap.handles:
            h.remove()
        tap.handles.clear()

    # -- model thread --------------------------------------------------------
    def _pass_buffer(self) -> tuple[PassBuffer, list[Piece[Tap]]]:
        """The current pass's buffer (made on first use) and pieces: compiled passes feed them too."""
        if self._buffer is None:
            self._buffer = PassBuffer()
        return self._buffer, self._pieces

    def _fail(self, tap: Tap, layer: str, exc: BaseException) -> None:
        tap.errors += 1
        tap.disabled = True
        tap.last_error = f"{layer}: {type(exc).__name__}: {exc}"
        self._relayout_due = True
        self.reducer_errors += 1
        # Its pieces already in this pass are partial; the publisher skips disabled taps.
        self._unhook(tap)
        self.publisher.tap_failed(tap, tap.last_error)
        log.warning("tap %s disabled after a reducer error: %s", tap.id, tap.last_error)

    def pass_finished(self, ctx: PassContext) -> None:
        """Ship the pass's results to the host-transfer thread (one D2H copy)."""
        layout = self._layout
        if layout is not None and layout.dirty:
            self._pass_buffer()  # the layout's block goes in the pass's buffer
        buffer, pieces = self._buffer, self._pieces
        self._buffer, self._pieces = None, []
        self.plans.reuse.clear()
        self.decisions.pass_ended()
        for tap in self._tap_list:  # decided for the pass at its start: those that saw none of it get it back
            if tap._pass == ctx.index and not tap.calls and not self.tap_hooks.ran(self._firings.get(tap.id, ()),
                                                                                   ctx.index):
                refund(tap)
        if layout is not None:
            if buffer is not None:
                try:
                    layout.finish(ctx, buffer, pieces)
                except Exception as exc:  # noqa: BLE001 - a reducer must never fail inference
                    for firing in {id(f.tap): f for f in layout.firings}.values():
                        if not firing.tap.disabled:
                            self._fail(firing.tap, firing.layer, exc)
            layout.book()  # to its taps (the pass's total is in the layer hooks' already)
        if self._relayout_due or (layout is not None and layout.grow):
            with self._lock:
                self._relayout()
        if buffer is None or not pieces or ctx.failed:
            self.plans.batch.discard()
        elif len(self.plans.batch):
            t0 = time.perf_counter()

            def failed(keys: list[int], exc: Exception) -> None:
                for tap, layer in {id(pieces[k].tap): (pieces[k].tap, pieces[k].layer) for k in keys}.values():
                    if not tap.disabled:
                        self._fail(tap, layer, exc)

            given = self.plans.batch.finish(buffer.add_rows, failed)
            spent = time.perf_counter() - t0
            self._hook_seconds += spent
            for k in given:  # the budget's: each tap pays for its small tensors, as for the others
                pieces[k].tap._spent += spent / len(given)
        hook_seconds, self._hook_seconds = self._hook_seconds + self.tap_hooks.take_seconds(), 0.0
        if hook_seconds:
            self.sinks.on_hook_time(hook_seconds)
        governor = self.governor
        if governor.pass_ended(time.perf_counter() - ctx.started, hook_seconds, self.all_taps):
            self.sinks.on_overhead(governor.share, governor.floor, governor.budget, governor.throttled)
        if buffer is None or not pieces or ctx.failed:
            self.sinks.on_pass_skipped(ctx)  # a pass whose forward raised publishes nothing
            return
        def dropped() -> None:  # rare: the taps are found only then, not on every pass
            for tap in {id(p.tap): p.tap for p in pieces}.values():
                tap.drops += 1

        rank = self.host.rank[0] if self.host.rank is not None else None
        self.transfer.submit(buffer.finish(),
                             lambda values: self.publisher.publish(ctx, pieces, values, self.is_durable, rank),
                             dropped)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every finished pass has been published."""
        return self.transfer.flush(timeout)

    def close(self) -> None:
        self.host.remove_observer(self)
        for tap in self.all_taps():
            self._unhook(tap)
        self.transfer.close()
