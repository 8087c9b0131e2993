"""Assemble and run a layertap gRPC server: services, health, reflection, shutdown."""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from layertap.server.codec import DTYPE_BY_NAME
from layertap.server.compile.modes import check_mode
from layertap.server.compile.serving import CompiledServing
from layertap.server.compile.stats import CompiledStats
from layertap.server.config import MODEL_DTYPES, ServerConfig
from layertap.server.drift.monitor import DriftMonitor
from layertap.server.errors import LayertapServerError
from layertap.server.explain.library import preload as preload_captum
from layertap.server.export.activations import ActivationCollector
from layertap.server.export.compiled_model import CompiledModelCollector
from layertap.server.export.endpoint import start_metrics_server, stop_metrics_server
from layertap.server.export.generation import GenerationMetrics
from layertap.server.export.health import ServerMetrics
from layertap.server.export.pipeline import PipelineCollector
from layertap.server.export.sink import MetricsSink
from layertap.server.export.snapshots import SnapshotStore
from layertap.server.export.streams import StreamsCollector
from layertap.server.generate.generator import Generator
from layertap.server.host.allocator import MMAP_THRESHOLD, TRIM_THRESHOLD, trim_free_memory, tune_malloc
from layertap.server.host.model_host import ModelHost
from layertap.server.host.model_thread import in_own_thread
from layertap.server.host.priority import set_telemetry_nice
from layertap.server.host.sources import LoadedModel, ModelLoadError, load_model
from layertap.server.host.step_aside import Passes
from layertap.server.record.wiring import start_recorder
from layertap.server.rpc.admission import PrincipalAdmission, StreamAdmission, rpc_limit
from layertap.server.rpc.auth import OPEN_SERVICES, Authenticator, arriving_principal
from layertap.server.rpc.health import HealthServicer
from layertap.server.rpc.health_listener import start_health_listener
from layertap.server.rpc.inference import InferenceService
from layertap.server.rpc.malformed import MalformedRequests
from layertap.server.rpc.open_pool import OpenPool
from layertap.server.rpc.state import ServerState, StateCell
from layertap.server.rpc.telemetry import TelemetryService
from layertap.server.rpc.telemetry import add_to_server as add_telemetry_service
from layertap.server.rpc.transport import SERVER_OPTIONS
from layertap.server.running import STOP_STEP_SECONDS, LayertapServer
from layertap.server.stream.broker import Broker
from layertap.server.stream.publisher import Publisher
from layertap.server.stream.sinks import Sinks
from layertap.server.taps.engine import TapEngine
from layertap.server.taps.tap import SERVER_OWNER
from layertap.server.taps.tap_files import load_tap_config
from layertap.server.tls import TlsFiles
from layertap.server.version import server_version
from layertap.v1 import inference_pb2, inference_pb2_grpc, telemetry_pb2
from layertap.v1 import telemetry_pb2 as pb

log = logging.getLogger("layertap.server")

SERVICE_NAMES = (
    inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name,
    telemetry_pb2.DESCRIPTOR.services_by_name["TelemetryService"].full_name,
)
#: Seconds between two trims of glibc's free memory in a served process (see _reap).
TRIM_EVERY = 10.0
#: The main port's pool for the open services (Health, no token): strangers'
#: slow calls fill only these threads, never the workers of token holders.
OPEN_WORKERS = 8


def pick_device(name: str | None) -> torch.device:
    """``--device``: CUDA when available unless told otherwise."""
    if name:
        dev = torch.device(name)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ModelLoadError(f"--device {name}: CUDA is not available on this machine")
        return dev
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class ProcessCompilation:
    """What compiling shares across every server and agent of one process, built here and handed on.

    One per process because torch's state is: inductor's caches, and the fx
    tracers that patch ``nn.Module.__call__`` for every module while a compile
    runs (:mod:`~layertap.server.host.step_aside`). So two servers in one
    process see each other's passes, and a kernel compiled for one serves both.
    """

    #: Passes running now: a background compile steps aside while they do.
    passes: Passes
    #: The reducers' compiled basic-statistics kernel, off until a server turns it on.
    stats: CompiledStats


@functools.cache
def process_compilation() -> ProcessCompilation:
    """This process's :class:`ProcessCompilation`, made on first use."""
    passes = Passes()
    return ProcessCompilation(passes, CompiledStats(enabled=False, passes=passes))


def wait_compiles(timeout: float) -> bool:
    """Whether this process's background kernel compiles are idle within ``timeout`` seconds.

    ``layertap serve`` exits at once (``os._exit``) when they are not: the
    compiler thread is joined at exit and a compile cannot be interrupted.
    """
    if process_compilation.cache_info().currsize == 0:
        return True  # nothing was ever compiled in this process
    return process_compilation().stats.wait_idle(timeout)


def _load_host(config: ServerConfig, loaded: LoadedModel | None) -> ModelHost:
    if loaded is None:
        loaded = load_model(config.model, seed=config.seed, weights=config.weights,
                            input_shape=config.input_shape, input_dtype=config.input_dtype, inputs=config.inputs,
                            model_args=config.model_args, hf_class=config.hf_class,
                            trust_remote_code=config.trust_remote_code)
    return ModelHost(loaded, device=pick_device(config.device), dtype=DTYPE_BY_NAME[config.dtype],
                     passes=process_compilation().passes)


def build_state(config: ServerConfig, loaded: LoadedModel | None = None, *, host: ModelHost | None = None,
                registry: CollectorRegistry | None = None) -> ServerState:
    """Load the model and assemble the pipeline (no sockets yet).

    The data flow is wired here and only here: host -> tap engine -> host
    transfer -> broker (subscribers) and the sinks (Prometheus export, drift).

    The model loads on a thread that exits (see ``host.model_thread``). A
    ``loaded`` model the caller built already ran its initialization on the
    caller's thread: if that was large enough to run parallel regions, that
    thread keeps an OpenMP team and forwards run slower; build it in
    :func:`~layertap.server.host.model_thread.in_own_thread` too.

    Args:
        host: A host built by the caller (a training agent's), used as is.
        registry: What ``/metrics`` serves, when metrics are on (default: a new one).
    """
    set_telemetry_nice(config.telemetry_nice)  # first: a bad value fails before the model loads
    if not 0 <= config.tap_budget < 1:
        raise ValueError(f"--tap-budget {config.tap_budget}: must be at least 0 (off) and below 1")
    if host is None:
        if config.malloc_tuning:
            # The server's own process only: an attached agent's host lives in the user's.
            why_not = tune_malloc()
            if why_not is None:
                log.info("malloc tuning: freed memory up to %d MiB per arena is kept for reuse (mmap above %d MiB)",
                         TRIM_THRESHOLD >> 20, MMAP_THRESHOLD >> 20)
            else:
                log.info("malloc tuning skipped: %s", why_not)
        if config.dtype not in MODEL_DTYPES:
            raise ModelLoadError(f"--dtype {config.dtype!r}: expected one of {', '.join(MODEL_DTYPES)}")
        # Loaded on a thread that exits: see model_thread (one OpenMP team per process).
        host = in_own_thread(_load_host, config, loaded)
        host.warm_up()
    loaded = host.loaded
    shared = process_compilation()
    if host.model_thread.passes is None:
        host.model_thread.passes = shared.passes  # a caller's host (a training agent's)
    graph: CompiledServing | None = None
    if config.compile_model:
        why_not = check_mode(config.compile_mode, host.device)
        if why_not is None and (host.training or not loaded.hooks_supported):
            why_not = "--compile-model serves a hosted model's Infer passes; this model is not one"
        if why_not is not None:
            raise ModelLoadError(why_not)
        graph = CompiledServing(host.module, host.free_dims(), mode=config.compile_mode,
                                fallback=config.compile_fallback, max_variants=config.compile_variants,
                                where=config.compile_where, passes=shared.passes)
        host.attach_graph(graph)
    # One process-wide switch: inductor's caches are process-wide too.
    shared.stats.set_enabled(config.compile_reducers)
    version = server_version()
    sinks = Sinks()
    broker = Broker(default_queue_size=config.subscriber_queue, max_subscribers=config.max_subscribers, sinks=sinks,
                    queue_bytes=config.subscriber_queue_bytes, budget_bytes=config.subscribers_budget_bytes)
    taps = TapEngine(host, publisher=Publisher(broker, sinks), max_taps=config.max_taps,
                     transfer_bytes=config.transfer_queue_bytes, stats=shared.stats, graph=graph,
                     budget=config.tap_budget)
    taps.use_op = config.tap_op
    metrics = snapshots = None
    if config.metrics_port is None:
        registry = None
    else:
        registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        metrics = ServerMetrics(registry, loaded.name, version=version)
        snapshots = SnapshotStore()
        registry.register(ActivationCollector(snapshots.snapshot, loaded.name, max_layers=config.max_export_layers))
        metrics.taps.set_function(lambda: len(taps.all_taps()))
        metrics.tap_budget.set(config.tap_budget)
        metrics.subscribers.set_function(lambda: broker.subscriber_count)
        sinks.add(MetricsSink(metrics, snapshots, taps.is_durable))
    drift = sinks.add(DriftMonitor(taps, on_score=snapshots.set_drift if snapshots is not None else None, baseline_dir=config.baseline_dir,
                                   default_window=config.drift_window, false_alarm_rate=config.drift_false_alarm_rate,
                                   on_load_error=(lambda _why: metrics.baseline_load_errors.inc()) if metrics else None,
                                   on_save_error=(lambda _why: metrics.baseline_save_errors.inc()) if metrics else None))
    if metrics is not None:
        metrics.baselines_unsaved.set_function(drift.unsaved)
    if registry is not None:
        if graph is not None:
            registry.register(CompiledModelCollector(loaded.name, graph.counters))
        registry.register(PipelineCollector(loaded.name, transfer=taps.transfer.stats,
                                            baseline_skipped=drift.skipped_passes,
                                            compiled=shared.stats.counters if config.compile_reducers else None))
    state = ServerState(config=config, host=host, version=version, taps=taps, broker=broker,
                        drift=drift, metrics=metrics, snapshots=snapshots, registry=registry,
                        passes=shared.passes, compiled_stats=shared.stats, graph=graph)
    drift.load()
    state.recorder = start_recorder(config, taps, drift, registry, loaded.name)
    if not host.training and loaded.hooks_supported:
        preload_captum()  # Explain's Captum, off the start-up path (see explain.library)
    why_not = Generator.can_generate(host)
    if why_not is None:
        state.generator = Generator(host, max_new_tokens=config.max_new_tokens, max_rows=config.max_generate_rows,
                                    tokenizer=loaded.tokenizer,
                                    listener=GenerationMetrics(registry, loaded.name) if registry is not None else None)
    else:
        state.cannot_generate = why_not
    if config.tap_config:
        for i, spec in enumerate(load_tap_config(config.tap_config)):
            try:
                taps.create(spec, kind=pb.TAP_KIND_DURABLE, forever=True, field_prefix=f"{config.tap_config}: taps[{i}]",
                            owner=SERVER_OWNER)
            except LayertapServerError as exc:
                raise ModelLoadError(f"--taps {config.tap_config}: {exc}") from None
    return state


def start_server(config: ServerConfig, loaded: LoadedModel | None = None, *, host: ModelHost | None = None,
                 registry: CollectorRegistry | None = None) -> LayertapServer:
    """Build everything and start serving; returns once the port is bound.

    Health reports NOT_SERVING until the model is loaded and warmed up.
    ``host`` and ``registry``: see :func:`build_state`.
    """
    options = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
        # Per-connection HTTP/2 limits (rapid reset, vanished peers): see server/rpc/transport.py.
        *SERVER_OPTIONS,
    ]
    for flag, value in (("--max-new-tokens", config.max_new_tokens), ("--max-generate-rows", config.max_generate_rows)):
        if value < 1:
            raise ValueError(f"{flag} {value}: must be at least 1")
    if not 0 < config.max_streams < config.workers:
        raise ValueError(f"--max-streams {config.max_streams} must be at least 1 and below --workers {config.workers}: "
                         "the workers it leaves free serve unary calls and health probes")
    auth = Authenticator(config.auth_tokens) if config.auth_tokens else None  # ValueError names the line
    tls = TlsFiles(config.tls_cert, config.tls_key, config.tls_client_ca) if config.tls_cert and config.tls_key else None
    if not 0 < config.principal_share <= 1:
        raise ValueError(f"--principal-share {config.principal_share}: must be above 0 and at most 1")
    streams = StreamAdmission(config.max_streams, callback_limit=config.max_streams)
    principals = PrincipalAdmission(
        principal_limit=max(1, int(config.workers * config.principal_share)) if auth else None,
        open_services=OPEN_SERVICES, open_workers=OPEN_WORKERS,
        principal_at_arrival=lambda: p.id if (p := arriving_principal()) is not None else None,
        call_limit=rpc_limit(config.workers), workers=config.workers)
    # Every open stream holds a worker, so at most max_streams of them are
    # admitted and workers - max_streams threads stay for unary calls. Auth
    # runs first: a refused caller never takes a stream slot. Malformed
    # request bytes are answered innermost, once a caller is admitted.
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="layertap-rpc"),
        options=options,
        # None: grpc's bound counts Health's calls too; PrincipalAdmission bounds the others (call_limit).
        maximum_concurrent_rpcs=None,
        interceptors=[i for i in (auth, principals, streams, MalformedRequests()) if i is not None],
    )
    cell = StateCell()
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(InferenceService(cell), server)
    add_telemetry_service(TelemetryService(cell), server)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", *SERVICE_NAMES):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        address = f"{config.host}:{config.port}"
        port = server.add_secure_port(address, tls.grpc_credentials()) if tls else server.add_insecure_port(address)
    except RuntimeError:  # newer grpcio raises instead of returning 0
        port = 0
    if port == 0:
        raise OSError(f"--port {config.port}: cannot bind {config.host}:{config.port} (in use?)")
    if config.reflection:
        reflection.enable_server_reflection((*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    server.start()
    health_server = health_port = None
    listener_health: HealthServicer | None = None
    listener_pool: OpenPool | None = None
    try:
        if config.health_address:
            health_server, health_port, listener_health, listener_pool = start_health_listener(
                config.health_address, health_servicer)
        state = build_state(config, loaded, host=host, registry=registry)
    except BaseException:
        server.stop(0)
        if health_server is not None:
            health_server.stop(0)
        for servicer in (health_servicer, listener_health, listener_pool, principals):
            if servicer is not None:
                servicer.close()
        raise
    cell.set(state)
    running = LayertapServer(server, state, port, health_servicer, auth=auth, tls=tls, streams=streams,
                             health_server=health_server, health_port=health_port, listener_health=listener_health,
                             listener_pool=listener_pool,
                             principals=principals)
    running._closers.append(("open services' pool", principals.close))
    if listener_pool is not None:
        running._closers.append(("health listener's pool", listener_pool.close))
    running._closers.append(("host-transfer thread", state.taps.close))
    running._closers.append(("model thread", state.host.model_thread.close))
    if state.graph is not None:
        running._closers.append(("model compiler", state.graph.close))
    if state.recorder is not None:
        running._closers.append(("flight recorder", state.recorder.close))
    if state.registry is not None:
        if auth is not None:
            auth.register(state.registry)
        callbacks = streams.callbacks
        assert callbacks is not None
        pools = {
            "workers": lambda: (streams.open_streams, streams.refused),
            "callbacks": lambda: (callbacks.open_streams, callbacks.refused),
            "health_watches": health_servicer.pool,
        }
        if listener_health is not None:
            pools["health_listener_watches"] = listener_health.pool
        if listener_pool is not None:
            pools["health_listener_calls"] = listener_pool.pool
        if principals.principals is not None:
            pools["principals"] = principals.principals.pool
        if principals.calls is not None:
            pools["calls"] = principals.calls_pool
        pools["health_calls"] = principals.open.pool.pool
        state.registry.register(StreamsCollector(state.host.loaded.name, pools))
        try:
            mserver, mport = start_metrics_server(
                state.registry, config.host, config.metrics_port or 0,
                ssl_context=tls.ssl_context() if tls else None, authorize=_scrape_check(auth))
        except OSError as exc:
            running.stop(0)  # no half-started server left behind
            raise OSError(f"--metrics-port {config.metrics_port}: cannot bind {config.host}: {exc.strerror or exc}") from None
        running.metrics_port = mport
        running._closers.append(("metrics server", lambda: stop_metrics_server(mserver)))
        log.info("metrics on %s://%s:%d/metrics", "https" if tls else "http", config.host, mport)
    reaper = threading.Thread(target=_reap, args=(state, running._stopped, TRIM_EVERY if host is None else None),
                              name="layertap-ttl", daemon=True)
    reaper.start()
    running._closers.append(("tap expiry thread", lambda: reaper.join(STOP_STEP_SECONDS)))
    for name in ("", *SERVICE_NAMES):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    for note in state.host.loaded.notes:
        log.warning("%s", note)
    log.info("serving %s (%s) on %s:%d, device=%s dtype=%s", state.host.loaded.name,
             state.host.loaded.source, config.host, port, state.host.device, config.dtype)
    return running


def _scrape_check(auth: Authenticator | None):  # type: ignore[no-untyped-def]
    """/metrics needs a bearer token with the ``read`` scope when auth is on."""
    if auth is None:
        return None

    def check(header: str | None) -> str | None:
        principal, why = auth.check_bearer(header, "read")
        if principal is None:
            auth.count("UNAUTHENTICATED" if why != "missing scope read" else "PERMISSION_DENIED",
                       "unknown", "GET /metrics", why)
            return why
        return None

    return check


def _reap(state: ServerState, stopped: threading.Event, trim_every: float | None) -> None:
    """Expire durable taps on time, and retry unsaved baselines, traffic or not.

    ``trim_every``: seconds between two ``malloc_trim`` calls (None: never, as
    in a training process that is the user's). Connections that come and go
    leave their buffers in glibc's arenas: 20,000 pre-auth connections kept
    +30 MiB untrimmed, +2 MiB per 15,000 more when trimmed (docs/benchmarks.md).
    """
    last_trim = time.monotonic()
    while not stopped.wait(1.0):
        if trim_every is not None and time.monotonic() - last_trim >= trim_every:
            trim_free_memory()
            last_trim = time.monotonic()
        try:
            state.taps.expire()
        except Exception:  # keep reaping
            log.exception("tap expiry failed")
        try:
            state.drift.retry_saves()
        except Exception:  # keep reaping
            log.exception("baseline save retry failed")


