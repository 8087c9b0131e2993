"""Server configuration: one dataclass, filled from the ``layertap serve`` flags."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Dtypes a model can be served in (``--dtype``).
MODEL_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")


@dataclass
class ServerConfig:
    """Every knob of a layertap server, with safe defaults.

    The server binds loopback unless ``host`` says otherwise, and caps request
    size, capture size, captures in flight and subscribers.
    """

    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = 9466
    model: str = "demo"
    seed: int = 0
    weights: str | None = None
    input_shape: str | None = None
    input_dtype: str = "float32"
    #: ``--model-arg key=value``: keyword arguments of a factory or of ``from_pretrained``.
    model_args: list[str] = field(default_factory=list)
    #: ``--hf-class``: the transformers class of an ``hf:`` model (default: its config's architectures).
    hf_class: str | None = None
    #: Run an ``hf:`` model's own Python code (its config's ``auto_map``).
    trust_remote_code: bool = False
    #: ``--input NAME:DTYPE:SHAPE`` declarations, one per model input (factories, exports, TorchScript).
    inputs: list[str] = field(default_factory=list)
    device: str | None = None
    dtype: str = "float32"
    max_request_bytes: int = 256 << 20
    max_capture_bytes: int = 256 << 20
    max_capture_passes: int = 16
    #: Most new tokens one Generate sequence may ask for.
    max_new_tokens: int = 512
    #: Sequences decoded together at most; later Generate requests wait for rows.
    max_generate_rows: int = 16
    #: Rows (samples x integration steps) one Explain pass runs at most; a request
    #: asks for fewer with internal_batch_size. Bounds an explanation's memory.
    max_explain_batch: int = 64
    max_concurrent_captures: int = 8
    #: Device bytes that all captures in flight may hold in clones together.
    capture_budget_bytes: int = 1 << 30
    #: Seconds a passive capture waits for live traffic before DEADLINE_EXCEEDED.
    max_capture_wait: float = 60.0
    max_subscribers: int = 32
    subscriber_queue: int = 256
    #: Bytes of summaries one subscriber's queue may hold before it drops the oldest.
    subscriber_queue_bytes: int = 16 << 20
    #: Bytes of summaries all subscribers' queues may hold together; past it the
    #: oldest messages server-wide are dropped (see stream.broker).
    subscribers_budget_bytes: int = 64 << 20
    #: Bytes of pass values waiting for the host-transfer thread; past it the
    #: oldest passes are dropped (see reducers.transfer).
    transfer_queue_bytes: int = 64 << 20
    max_taps: int = 64
    workers: int = 64
    #: Long streams (Subscribe, Capture, Health.Watch, reflection) in flight at once;
    #: the rest of the worker pool stays free for unary calls and probes.
    max_streams: int = 48
    #: With auth: the share of ``workers`` one principal's calls may hold at
    #: once, whatever its scope, so a slow client cannot take every worker.
    principal_share: float = 0.25
    #: Basic statistics from one compiled (inductor) kernel per signature,
    #: compiled in the background; False (``--no-compile``): eager torch ops only.
    compile_reducers: bool = True
    #: A basic tap's firing is one ``layertap::tap_stats`` call (``taps.firing``); False
    #: (``--no-tap-op``): the reducer plan in the hook, as before issue 42, to compare or as an escape hatch.
    tap_op: bool = True
    #: The share of the model thread's pass time tap hooks may take (``--tap-budget``, ``taps.budget``):
    #: past it, the server thins the taps' sampling, the most expensive first and fairly across
    #: principals. 0 turns the governor off.
    tap_budget: float = 0.05
    #: Serve Infer from torch.compile'd variants of the model (``--compile-model``), with in-graph tap
    #: statistics; see compile.serving. ``compile_mode`` is inductor's mode, ``compile_fallback`` what
    #: serves a tapped pass while its graph compiles (eager or pending), ``compile_variants`` the cap,
    #: ``compile_where`` where a variant compiles.
    compile_model: bool = False
    compile_mode: str = "default"
    compile_fallback: str = "pending"
    compile_variants: int = 4
    #: Where a variant compiles: ``process`` (a niced child builds an AOTInductor package; CPU models)
    #: or ``thread`` (dynamo on this process's compiler thread; what a CUDA model always uses).
    compile_where: str = "process"
    #: How much nicer than the model thread the telemetry threads run
    #: (host-transfer, recorder, /metrics); 0: same priority. See host.priority.
    telemetry_nice: int = 19
    #: Keep freed memory for the next pass (glibc mmap/trim thresholds, see
    #: host.allocator), opted into with ``--malloc-tuning``: it trades RAM for
    #: fewer page faults.
    malloc_tuning: bool = False
    #: Plaintext gRPC health listener (e.g. 127.0.0.1:50052) for probes that
    #: cannot speak TLS (Docker HEALTHCHECK, kubelet); None: none.
    health_address: str | None = None
    reflection: bool = True
    tap_config: str | None = None
    baseline_dir: str | None = None
    drift_window: int = 50
    #: Per-window false alarms of the calibrated drift alarms, all layers together.
    drift_false_alarm_rate: float = 1e-4
    max_export_layers: int = 200
    grace_seconds: float = 5.0
    #: Token file (``id sha256:<hex> scopes [expiry]`` per line); None: no auth.
    auth_tokens: str | None = None
    #: PEM certificate chain and key: TLS for gRPC and /metrics.
    tls_cert: str | None = None
    tls_key: str | None = None
    #: PEM CA bundle: clients must present a certificate it signed (mTLS).
    tls_client_ca: str | None = None
    #: Allow a non-loopback --host without both auth and TLS.
    insecure: bool = False
    #: Flight recorder: MiB of host memory for the last passes' inputs (0: off;
    #: inputs may be user data). Needs ``incident_dir``.
    record_inputs: int = 0
    #: Directory of the incident ring; None: no flight recorder (triggers refused).
    incident_dir: str | None = None
    incident_max_count: int = 100
    incident_max_bytes: int = 1 << 30
    incident_max_file_bytes: int = 64 << 20
    incident_max_age: float = 7 * 86400.0

    @property
    def max_message_bytes(self) -> int:
        """gRPC message limit: the tensor cap plus room for the envelope."""
        return self.max_request_bytes + (1 << 20)


#: Hosts that keep the server on this machine: protected mode lets them start bare.
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def check_exposure(cfg: ServerConfig) -> str | None:
    """Protected mode: why this config must not start (None: it may).

    Here, not in a CLI, because every assembler that opens a port (``serve``,
    the training agent) must refuse the same configs.
    """
    if (cfg.tls_cert is None) != (cfg.tls_key is None):
        return "--tls-cert and --tls-key go together"
    if cfg.tls_client_ca and not cfg.tls_cert:
        return "--tls-client-ca needs --tls-cert and --tls-key"
    if cfg.host in LOOPBACK or cfg.host.startswith("127.") or cfg.insecure:
        return None
    if cfg.auth_tokens and cfg.tls_cert:
        return None
    missing = " and ".join(m for m, ok in (("--auth-tokens", cfg.auth_tokens), ("--tls-cert/--tls-key", cfg.tls_cert)) if not ok)
    return (f"--host {cfg.host} exposes the server beyond this machine without {missing}; "
            "add them, or pass --insecure to accept the risk")
