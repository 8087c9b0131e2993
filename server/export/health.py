"""The server's own health metrics, updated by the code paths that see each event."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from layertap.server.export.cuda import CudaMemoryCollector, cuda_available
from layertap.server.version import server_version
from layertap.server.version import torch_version as _torch_version  # the parameter shadows the name

__all__ = ["EXPLAIN_BATCH_BUCKETS", "EXPLAIN_BUCKETS", "HOOK_BUCKETS", "INFERENCE_BUCKETS", "ServerMetrics"]

#: Hooks plus reducers take tens of µs to a few ms per pass.
HOOK_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3)
INFERENCE_BUCKETS = (1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 500e-3, 1.0, 2.5, 5.0, 10.0)
#: Grad-CAM of a small batch takes milliseconds; 256 integration steps of a large model, minutes.
EXPLAIN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: Passes per Explain request: one or two for Grad-CAM, up to 256 steps and more for integrated gradients.
EXPLAIN_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class ServerMetrics:
    """The server's health metrics, all labelled ``model``.

    Gauges such as ``subscribers`` and ``taps`` can be bound to a callback
    with ``metrics.taps.set_function(fn)`` so they are read at scrape time.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        *,
        version: str | None = None,
        torch_version: str | None = None,
        cuda: bool | None = None,
    ) -> None:
        """Create and register the metrics.

        Args:
            registry: Where to register (never the global one implicitly).
            model_name: Value of the ``model`` label.
            version: layertap version for ``layertap_build_info`` (default: installed).
            torch_version: torch version (default: ``torch.__version__`` if importable).
            cuda: Export CUDA memory; None detects ``torch.cuda.is_available()``.
        """
        self.model = model_name
        m = ("model",)
        r = registry
        self._requests = Counter(
            "layertap_inference_requests", "Infer requests by gRPC status code.", m + ("status",), registry=r
        )
        self.inference_duration = Histogram(
            "layertap_inference_duration_seconds", "Infer request latency, hooks included.", m,
            buckets=INFERENCE_BUCKETS, registry=r,
        ).labels(model_name)
        self.hook_duration = Histogram(
            "layertap_hook_duration_seconds", "Hook plus reducer time per forward pass, all taps together.", m,
            buckets=HOOK_BUCKETS, registry=r,
        ).labels(model_name)
        self.reducer_errors = Counter(
            "layertap_reducer_errors", "Reducer failures (the tap is disabled after repeated errors).", m, registry=r
        ).labels(model_name)
        self._captures = Counter("layertap_captures", "Capture calls by final gRPC status code.", m + ("code",), registry=r)
        self.capture_bytes = Counter(
            "layertap_capture_bytes", "Tensor bytes sent by Capture.", m, registry=r
        ).labels(model_name)
        self.capture_budget_held = Gauge(
            "layertap_capture_budget_held_bytes",
            "Bytes of captured clones held now against --capture-budget-bytes; at the budget, passive captures skip passes.",
            m, registry=r,
        ).labels(model_name)
        self.capture_skipped_passes = Counter(
            "layertap_capture_skipped_passes",
            "Live passes passive captures skipped because captures in flight held the whole capture budget.",
            m, registry=r,
        ).labels(model_name)
        self.stream_messages = Counter(
            "layertap_stream_messages", "Subscribe messages sent.", m, registry=r
        ).labels(model_name)
        self.stream_dropped = Counter(
            "layertap_stream_dropped", "Subscribe messages dropped by full subscriber queues.", m, registry=r
        ).labels(model_name)
        self.stream_budget_dropped = Counter(
            "layertap_stream_budget_dropped",
            "Subscribe messages dropped, oldest first, because all subscriber queues together held "
            "--subscribers-budget-bytes (also counted in layertap_stream_dropped_total); rising means readers fall behind.",
            m, registry=r,
        ).labels(model_name)
        self.stream_held_bytes = Gauge(
            "layertap_stream_held_bytes",
            "Bytes (wire size) of Subscribe messages queued for all subscribers, against --subscribers-budget-bytes.",
            m, registry=r,
        ).labels(model_name)
        self.overhead_share = Gauge(
            "layertap_tap_overhead_share",
            "Share of pass time the taps took over the overhead budget's last window (about 0.5 s): the model "
            "thread's hooks and the host-transfer thread's publishing, which holds the same GIL.", m, registry=r,
        ).labels(model_name)
        self.overhead_floor = Gauge(
            "layertap_tap_overhead_floor_share",
            "The part of layertap_tap_overhead_share no sampling stride can cut: the layer hooks' dispatch and "
            "the pass's one decision for all taps, work no tap's figure holds (small tensors reduced together at "
            "the pass's end), the server's own taps (--taps, baselines); above --tap-budget, every tap already "
            "runs at its sparsest.",
            m, registry=r,
        ).labels(model_name)
        self.tap_budget = Gauge(
            "layertap_tap_budget", "The overhead budget (--tap-budget): the hook share the governor keeps to; 0: off.",
            m, registry=r,
        ).labels(model_name)
        self.taps_throttled = Gauge(
            "layertap_taps_throttled",
            "Taps the overhead budget thins now (TapInfo.throttle > 1; TapInfo.throttle_reason says why).",
            m, registry=r,
        ).labels(model_name)
        self.subscribers = Gauge("layertap_subscribers", "Open Subscribe streams.", m, registry=r).labels(model_name)
        self.taps = Gauge("layertap_taps", "Registered taps, durable and stream.", m, registry=r).labels(model_name)
        self.baseline_load_errors = Counter(
            "layertap_baseline_load_errors", "Baseline files refused at start-up.", m, registry=r
        ).labels(model_name)
        self.baseline_save_errors = Counter(
            "layertap_baseline_save_errors",
            "Failed writes of frozen baselines to --baseline-dir, retries included (e.g. a full disk).",
            m, registry=r,
        ).labels(model_name)
        self.baselines_unsaved = Gauge(
            "layertap_baselines_unsaved",
            "Frozen baselines whose file is not written yet (state UNSAVED): they would be lost at restart.",
            m, registry=r,
        ).labels(model_name)
        self.baselines_lost = Counter(
            "layertap_baselines_lost",
            "Frozen baselines still unsaved when the server stopped (a last write failed too): lost.",
            m, registry=r,
        ).labels(model_name)
        self._explains = Counter(
            "layertap_explain_requests", "Explain calls by method and final gRPC status code.", m + ("method", "code"),
            registry=r,
        )
        self._explain_duration = Histogram(
            "layertap_explain_duration_seconds", "Explain call latency by method, every internal batch included.",
            m + ("method",), buckets=EXPLAIN_BUCKETS, registry=r,
        )
        self._explain_batches = Histogram(
            "layertap_explain_batches",
            "Passes (internal batches) one Explain call ran under the model lock, by method; _sum is every call's.",
            m + ("method",), buckets=EXPLAIN_BATCH_BUCKETS, registry=r,
        )
        self.build_info = Info("layertap_build", "layertap and torch versions.", m, registry=r).labels(model_name)
        self.build_info.info({"version": version or server_version(), "torch_version": torch_version or _torch_version()})
        # Export the usual outcomes from the start so rate() and the dashboard
        # see a zero instead of a missing series before the first event.
        self._requests.labels(model_name, "OK")
        self._captures.labels(model_name, "OK")
        if cuda is None:
            cuda = cuda_available()
        self.cuda_collector: CudaMemoryCollector | None = None
        if cuda:
            self.cuda_collector = CudaMemoryCollector(model_name)
            r.register(self.cuda_collector)

    def record_inference(self, status: str, seconds: float | None = None) -> None:
        """Count one Infer call by status code name (``"OK"``, ``"INVALID_ARGUMENT"``...)."""
        self._requests.labels(self.model, status).inc()
        if seconds is not None:
            self.inference_duration.observe(seconds)

    def record_explain(self, method: str, code: str, seconds: float, batches: int) -> None:
        """One finished Explain call: its method, status code name, seconds and passes run."""
        self._explains.labels(self.model, method, code).inc()
        self._explain_duration.labels(self.model, method).observe(seconds)
        self._explain_batches.labels(self.model, method).observe(batches)

    def observe_hooks(self, seconds: float) -> None:
        """Hook plus reducer time of one forward pass."""
        self.hook_duration.observe(seconds)

    def observe_overhead(self, share: float, floor: float, budget: float, throttled: int) -> None:
        """One overhead-budget window: the taps' share of pass time, its floor, the budget, the taps thinned."""
        self.overhead_share.set(share)
        self.overhead_floor.set(floor)
        self.tap_budget.set(budget)
        self.taps_throttled.set(throttled)

    def record_capture(self, code: str, nbytes: int = 0) -> None:
        """Count one finished Capture call and the tensor bytes it sent."""
        self._captures.labels(self.model, code).inc()
        if nbytes:
            self.capture_bytes.inc(nbytes)
