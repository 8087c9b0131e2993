"""The Prometheus exporter's sink: pipeline events become metrics.

Health counters are fed where events happen; per-layer series come from the
latest summaries of durable taps only, which keeps the ``tap`` label bounded
(stream taps come and go with their subscribers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from layertap.server.export.health import ServerMetrics
from layertap.server.export.snapshots import SnapshotStore
from layertap.server.host.model_host import PassContext
from layertap.server.stream.sinks import BasicPiece, Sink, TapView
from layertap.server.stream.summary_wire import timestamp
from layertap.v1 import telemetry_pb2 as pb


class MetricsSink(Sink):
    """Feeds ``ServerMetrics`` and the ``SnapshotStore`` read at scrape time."""

    def __init__(self, metrics: ServerMetrics, store: SnapshotStore,
                 durable: Callable[[], dict[str, bool]]) -> None:
        self.metrics = metrics
        self.store = store
        self._durable = durable

    def on_summaries(self, ctx: PassContext, summaries: list[pb.Summary]) -> None:
        durable = self._durable()
        self.store.update_from_summaries((s.tap, s) for s in summaries if durable.get(s.tap))

    def on_basic(self, ctx: PassContext, pieces: Sequence[tuple[BasicPiece, np.ndarray]]) -> None:
        """The same fold as :meth:`on_summaries`, from the statistics slots: no message built or read."""
        durable = self._durable()
        wall = timestamp(ctx.wall_time)  # as a summary carries it, to the nanosecond
        self.store.update_from_basic(
            wall.seconds + wall.nanos * 1e-9, ctx.index, ctx.phase,
            [(p.tap.id, p.layer, p.tap.spec.point, p.output_index, p.call_index, p.sampled, p.plan.basic_layout,
              values.tolist(), p.shape) for p, values in pieces if durable.get(p.tap.id)])

    def on_tap_created(self, tap: TapView) -> None:
        self.store.add_tap(tap.id)

    def on_tap_removed(self, tap: TapView, reason: str) -> None:
        if tap.durable:  # only durable taps are exported, so only they need forgetting
            self.store.remove_tap(tap.id)

    def on_tap_error(self, tap: TapView) -> None:
        self.metrics.reducer_errors.inc()

    def on_hook_time(self, seconds: float) -> None:
        self.metrics.observe_hooks(seconds)

    def on_overhead(self, share: float, floor: float, budget: float, throttled: int) -> None:
        self.metrics.observe_overhead(share, floor, budget, throttled)

    def on_delivery(self, dropped: int) -> None:
        self.metrics.stream_messages.inc()
        if dropped:
            self.metrics.stream_dropped.inc(dropped)

    def on_budget(self, dropped: int, held_bytes: int) -> None:
        self.metrics.stream_held_bytes.set(held_bytes)
        if dropped:
            self.metrics.stream_dropped.inc(dropped)
            self.metrics.stream_budget_dropped.inc(dropped)
