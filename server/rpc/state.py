"""Everything the services share, built once per server."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from layertap.server.compile.serving import CompiledServing
from layertap.server.compile.stats import CompiledStats
from layertap.server.config import ServerConfig
from layertap.server.drift.monitor import DriftMonitor
from layertap.server.errors import Unavailable
from layertap.server.export.health import ServerMetrics
from layertap.server.export.snapshots import SnapshotStore
from layertap.server.generate.generator import Generator
from layertap.server.host.model_host import ModelHost
from layertap.server.host.step_aside import Passes
from layertap.server.record.recorder import Recorder
from layertap.server.stream.broker import Broker
from layertap.server.taps.capture_limits import CaptureBudget, CaptureLimits, CaptureSlots
from layertap.server.taps.engine import TapEngine
from layertap.v1 import telemetry_pb2 as pb


@dataclass
class ServerState:
    config: ServerConfig
    host: ModelHost
    version: str
    taps: TapEngine
    broker: Broker
    drift: DriftMonitor
    metrics: ServerMetrics | None = None
    snapshots: SnapshotStore | None = None
    #: What ``/metrics`` serves; None when metrics are off.
    registry: CollectorRegistry | None = None
    #: The flight recorder (``--incident-dir``); None when off.
    recorder: Recorder | None = None
    #: Runs Generate requests; None when the model cannot generate (``cannot_generate`` says why).
    generator: Generator | None = None
    cannot_generate: str = ""
    #: The process's pass registry: Infer's serving work makes a background compile wait.
    passes: Passes = field(default_factory=Passes)
    #: The process's compiled basic-statistics kernel (``app.process_compilation``).
    compiled_stats: CompiledStats | None = None
    #: Compiled serving of the model (``--compile-model``); None: eager only.
    graph: CompiledServing | None = None
    captures: CaptureSlots = field(init=False)
    capture_limits: CaptureLimits = field(init=False)
    #: Bytes every capture's live clones hold together, against ``--capture-budget-bytes``.
    capture_budget: CaptureBudget = field(init=False)

    def __post_init__(self) -> None:
        self.capture_limits = CaptureLimits(
            max_bytes=self.config.max_capture_bytes,
            max_passes=self.config.max_capture_passes,
            max_concurrent=self.config.max_concurrent_captures,
            budget_bytes=self.config.capture_budget_bytes,
            max_wait=self.config.max_capture_wait,
        )
        self.captures = CaptureSlots(self.capture_limits.max_concurrent)
        metrics = self.metrics
        self.capture_budget = CaptureBudget(
            self.capture_limits.budget_bytes,
            on_skip=metrics.capture_skipped_passes.inc if metrics is not None else None,
        )
        if metrics is not None:
            budget = self.capture_budget
            metrics.capture_budget_held.set_function(lambda: budget.held)

    def count_capture(self, code: str, nbytes: int) -> None:
        """Record a finished capture in the metrics, when metrics are on."""
        if self.metrics is not None:
            self.metrics.record_capture(code, nbytes)

    def stats(self) -> pb.GetServerStatsResponse:
        """The GetServerStats response."""
        return pb.GetServerStatsResponse(
            active_hooks=self.host.hooks.active,
            passes=self.host.passes,
            active_captures=self.captures.active,
            subscribers=self.broker.subscriber_count,
            taps=len(self.taps.all_taps()),
            reducer_errors=self.taps.reducer_errors,
            stream_dropped=self.broker.dropped_total,
            **self.host.graph_stats(),
        )


class StateCell:
    """Holds the state once the model is loaded; services answer UNAVAILABLE before."""

    def __init__(self) -> None:
        self._state: ServerState | None = None

    def set(self, state: ServerState) -> None:
        self._state = state

    def get(self) -> ServerState:
        if self._state is None:
            raise Unavailable("the model is still loading; watch grpc.health.v1 for SERVING")
        return self._state


class StateBacked:
    """Base of the servicers: the shared state, once the model is loaded."""

    def __init__(self, cell: StateCell) -> None:
        self._cell = cell

    @property
    def state(self) -> ServerState:
        return self._cell.get()
