"""``layertap serve``: the server's command line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from layertap.cli.input import DEFAULT_VOCAB_SIZE
from layertap.server.config import MODEL_DTYPES, ServerConfig, check_exposure

if TYPE_CHECKING:
    from layertap.server.running import LayertapServer

log = logging.getLogger("layertap.server")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if not 1e-12 <= value <= 0.5:  # rates.MIN_FALSE_ALARM_RATE, MAX_FALSE_ALARM_RATE (not imported: a light CLI)
        raise argparse.ArgumentTypeError(f"must be in [1e-12, 0.5], got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    d = ServerConfig()
    p = argparse.ArgumentParser(prog="layertap serve", description="Serve a PyTorch model with layer telemetry over gRPC.")
    p.add_argument("--model", default=d.model, help="demo | torchvision name | file.pt2 | file.pt (TorchScript) | "
                   "package.module:factory | path/to/file.py:factory | hf:DIR (save_pretrained directory or hub id)")
    p.add_argument("--model-arg", dest="model_args", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument of the factory or of from_pretrained (repeatable; Python literals, else strings)")
    p.add_argument("--hf-class", help="hf: models: the transformers class to load (default: the config's architectures)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="hf: models: run the Python code the model's config names (auto_map); never without it")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the demo model's weights")
    p.add_argument("--weights", help="state_dict file, loaded with torch.load(weights_only=True)")
    p.add_argument("--input", dest="inputs", action="append", default=[], metavar="NAME:DTYPE:SHAPE",
                   help="declare one model input by forward's argument name, repeatable, for factory/export/TorchScript "
                        "models; -1 marks a free dimension (e.g. input_ids:int64:-1,-1 attention_mask:int64:-1,-1)")
    p.add_argument("--input-shape", help="shorthand for one input: its shape, -1 for any free dimension such as the "
                                         "batch (e.g. -1,3,224,224)")
    p.add_argument("--input-dtype", default=d.input_dtype,
                   help="input dtype for factory/export/TorchScript models, with --input-shape (default float32)")
    p.add_argument("--output-name", default="", help="--smoke: the output to check when the model returns several "
                                                     "(default: the tensor, else logits, else the only one)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--dtype", default=d.dtype, choices=MODEL_DTYPES)
    p.add_argument("--host", default=d.host, help="bind address (default loopback; 0.0.0.0 exposes the server)")
    p.add_argument("--port", type=int, default=d.port, help="gRPC port; 0 picks a free one")
    p.add_argument("--metrics-port", type=int, default=d.metrics_port, help="Prometheus /metrics port; 0 picks a free one")
    p.add_argument("--no-metrics", action="store_true", help="do not serve /metrics")
    p.add_argument("--no-reflection", action="store_true", help="disable gRPC server reflection")
    p.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes)
    p.add_argument("--max-capture-bytes", type=int, default=d.max_capture_bytes)
    p.add_argument("--max-capture-passes", type=int, default=d.max_capture_passes)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                   help="most new tokens one Generate sequence may ask for")
    p.add_argument("--max-generate-rows", type=int, default=d.max_generate_rows,
                   help="sequences decoded together at most; later Generate requests wait for rows")
    p.add_argument("--max-explain-batch", type=_positive, default=d.max_explain_batch,
                   help="rows (samples x integration steps) one Explain pass runs at most (default 64): bounds an "
                        "explanation's memory; Infer runs between two passes")
    p.add_argument("--max-concurrent-captures", type=int, default=d.max_concurrent_captures)
    p.add_argument("--capture-budget-bytes", type=int, default=d.capture_budget_bytes,
                   help="device bytes all captures in flight may hold in clones together")
    p.add_argument("--max-capture-wait", type=float, default=d.max_capture_wait,
                   help="seconds a passive capture waits for live traffic")
    p.add_argument("--max-subscribers", type=int, default=d.max_subscribers)
    p.add_argument("--subscriber-queue-bytes", type=int, default=d.subscriber_queue_bytes,
                   help="bytes one subscriber's queue may hold before it drops the oldest")
    p.add_argument("--subscribers-budget-bytes", type=int, default=d.subscribers_budget_bytes,
                   help="bytes all subscribers' queues may hold together before the oldest messages server-wide "
                        "are dropped (default 64 MiB)")
    p.add_argument("--transfer-queue-bytes", type=int, default=d.transfer_queue_bytes,
                   help="bytes of pass values waiting for the host-transfer thread before the oldest passes are "
                        "dropped (default 64 MiB)")
    p.add_argument("--workers", type=int, default=d.workers, help="RPC worker threads (streams hold one each)")
    p.add_argument("--max-streams", type=int, default=d.max_streams,
                   help="long streams in flight at once; the other workers stay free for unary calls and probes")
    p.add_argument("--principal-share", type=float, default=d.principal_share,
                   help="with --auth-tokens: the share of --workers one principal's calls may hold at once "
                        "(default 0.25); past it, RESOURCE_EXHAUSTED before the request is read")
    p.add_argument("--health-address", default=d.health_address,
                   help="plaintext gRPC health-only listener for probes that cannot speak TLS (e.g. 127.0.0.1:50052)")
    p.add_argument("--no-compile", dest="compile_reducers", action="store_false",
                   help="never torch.compile the reducers' statistics kernel (eager torch ops only)")
    p.add_argument("--no-tap-op", dest="tap_op", action="store_false",
                   help="serve basic taps on the reducer-plan path instead of one layertap::tap_stats call per "
                        "firing (to compare, or if the op misbehaves on a platform)")
    p.add_argument("--tap-budget", type=float, default=d.tap_budget, metavar="FRACTION",
                   help="share of the model thread's pass time tap hooks may take (default 0.05); past it the "
                        "server thins taps' sampling, most expensive first, fairly across principals, and says so "
                        "in each summary and TapInfo. 0: off")
    p.add_argument("--compile-model", action="store_true", default=d.compile_model,
                   help="serve Infer from torch.compile'd variants of the model, tap statistics inside the graph; "
                        "a tap change compiles in the background (see docs/operations.md)")
    p.add_argument("--compile-mode", default=d.compile_mode,
                   help="inductor mode for --compile-model: default, max-autotune-no-cudagraphs (reduce-overhead "
                        "and max-autotune use CUDA graphs, refused on CUDA until verified)")
    p.add_argument("--compile-fallback", choices=("eager", "pending"), default=d.compile_fallback,
                   help="while a tap's graph compiles: pending (default: the previous graph serves, the tap "
                        "starts when its graph is ready) or eager (its passes run the eager model, the tap is active "
                        "at once, at the eager model's latency)")
    p.add_argument("--compile-where", choices=("process", "thread"), default=d.compile_where,
                   help="where a variant compiles: process (default: a niced child process builds an AOTInductor "
                        "package, so serving keeps the GIL and its cores) or thread (dynamo in the server's own "
                        "process; what a CUDA model always uses)")
    p.add_argument("--compile-variants", type=_positive, default=d.compile_variants,
                   help="compiled variants (tap sets) kept at most, least recently used dropped (default 4)")
    p.add_argument("--telemetry-nice", type=int, default=d.telemetry_nice,
                   help="raise the telemetry threads' nice value by this much (0-19; 0: as the model), so that "
                        "under full CPU load telemetry falls behind before inference slows down (Linux)")
    p.add_argument("--malloc-tuning", action="store_true", default=d.malloc_tuning,
                   help="glibc only: keep freed memory (up to 64 MiB per malloc arena) for the next pass instead of "
                        "page-faulting it back in; costs resident memory (see docs/operations.md)")
    p.add_argument("--taps", dest="tap_config", help="YAML or JSON file of durable taps to create at start")
    p.add_argument("--baseline-dir", help="directory where drift baselines are saved and reloaded")
    p.add_argument("--drift-window", type=int, default=d.drift_window,
                   help="passes in the sliding drift window of baselines that name none (SetBaseline with window 0, reloaded ones); default 50")
    p.add_argument("--drift-false-alarm-rate", type=_rate, default=d.drift_false_alarm_rate,
                   help="expected false drift alarms per window over all calibrated layers (split evenly across "
                        "them); default 1e-4; change it at run time with SetDriftFalseAlarmRate (admin)")
    p.add_argument("--max-export-layers", type=int, default=d.max_export_layers)
    p.add_argument("--grace", dest="grace_seconds", type=float, default=d.grace_seconds, help="seconds to drain on SIGTERM")
    p.add_argument("--auth-tokens", help="token file: 'id sha256:<hex> scope,scope [RFC 3339 expiry]' per line; SIGHUP reloads")
    p.add_argument("--tls-cert", help="PEM certificate chain for gRPC and /metrics (SIGHUP reloads)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", help="PEM CA bundle; clients must present a certificate it signed (mTLS)")
    p.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without auth and TLS")
    p.add_argument("--record-inputs", type=int, default=d.record_inputs, metavar="MIB",
                   help="flight recorder: keep the last passes' inputs in MiB of host memory (default 0: off)")
    p.add_argument("--incident-dir", help="flight recorder: directory of the incident ring (enables tap triggers)")
    p.add_argument("--incident-max-count", type=int, default=d.incident_max_count, help="incidents kept at most")
    p.add_argument("--incident-max-bytes", type=int, default=d.incident_max_bytes, help="bytes of all incidents")
    p.add_argument("--incident-max-file-bytes", type=int, default=d.incident_max_file_bytes,
                   help="bytes of one incident (captured tensors beyond it are left out)")
    p.add_argument("--incident-max-age", type=float, default=d.incident_max_age, help="seconds an incident is kept")
    p.add_argument("--smoke", action="store_true",
                   help="start on a free port, capture the model's last block once through the client, print it, exit")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR, for the server's log on stderr")
    return p


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    fields = set(ServerConfig.__dataclass_fields__)
    cfg = ServerConfig(**{k: v for k, v in vars(args).items() if k in fields})
    if args.no_metrics:
        cfg.metrics_port = None
    cfg.reflection = not args.no_reflection
    if args.smoke:
        cfg.port = 0
        cfg.metrics_port = None if cfg.metrics_port is None else 0
    return cfg


def suggested_layer(server: LayertapServer) -> str | None:
    """A layer the served model really has and runs, for hints and ``--smoke``."""
    from layertap.server.host.suggest import suggest_layer

    host = server.state.host
    if not host.loaded.hooks_supported:
        return None  # TorchScript: no hooks, so nothing can be captured.
    return suggest_layer(host.module, set(host.layer_shapes))


def vocab_size(server: LayertapServer) -> int | None:
    """The served model's vocabulary size when it takes token ids, for the hint's ``--vocab-size``.

    The metadata has no field for it, so the hint passes it: the bound the
    server checks ids against when it has one (``InputSpec.vocab``), else what
    the model embeds (a factory's module). None for a model with no integer
    input, or no vocabulary to find.
    """
    import torch

    from layertap.server.host.sources import vocabulary

    inputs = server.state.host.loaded.inputs
    if not any(not spec.dtype.is_floating_point and spec.dtype != torch.bool for spec in inputs):
        return None
    checked = next((spec.vocab for spec in inputs if spec.vocab), None)
    return checked if checked is not None else vocabulary(server.state.host.module)


def hint(server: LayertapServer, layer: str | None) -> str:
    """The first command to try: one that succeeds on a fresh server with no traffic.

    An active capture of ``layer`` with a random input made from the
    metadata (``--random-input``). Tests and scripts wait for a line
    starting ``layertap: try``; the command is between backquotes.
    """
    config = server.state.config
    address = f"{config.host}:{server.port}"
    # The flags the client needs against this server, so the printed command runs as is.
    flags = " --tls-ca CA.pem" if config.tls_cert else ""
    token = " with $LAYERTAP_TOKEN set" if config.auth_tokens else ""
    if layer is None:
        return f"layertap: try `layertap layers {address}{flags}`{token}"
    vocab = vocab_size(server) if server.state.host.loaded.hooks_supported else None
    if vocab is not None and vocab < DEFAULT_VOCAB_SIZE:
        flags = f" --vocab-size {vocab}{flags}"
    return f"layertap: try `layertap capture {address} {layer} --random-input -o {layer}.npy{flags}`{token}"


def generate_hint(server: LayertapServer, layer: str | None) -> str:
    """A Generate command for a model that generates, watching the layers beside ``layer``
    (``model.layers.1`` gives ``model.layers.*``)."""
    config = server.state.config
    flags = " --tls-ca CA.pem" if config.tls_cert else ""
    parent, _, last = (layer or "").rpartition(".")
    watch = f" --watch '{parent}.*'" if parent and last.isdigit() else ""
    return (f"layertap: generate with `layertap generate {config.host}:{server.port} --ids 1,2,3 "
            f"--max-new-tokens 8{watch}{flags}`")


def smoke(address: str, layer: str, output_name: str = "") -> int:
    """Capture ``layer`` from the running server with the real client and print it.

    The input fits every declared input (random floats, zeros for integer
    ids, ones for a mask); the output checked is ``output_name``, else the
    one tensor, ``logits``, or the only output.
    """
    import numpy as np

    from layertap import Client

    rng = np.random.default_rng(0)
    with Client(address) as client:
        meta = client.metadata()
        inputs = {}
        for spec in meta.inputs:
            shape = [2 if d == -1 else d for d in spec.shape]
            if spec.dtype.startswith(("float", "bfloat")):
                inputs[spec.name] = rng.standard_normal(shape).astype(np.float32)
            else:
                fill = 1 if "mask" in spec.name else 0
                inputs[spec.name] = np.full(shape, fill, dtype=spec.dtype if spec.dtype != "bool" else np.bool_)
        act = client.capture(layer, input=inputs)
        out = client.infer(inputs)
        if isinstance(out, dict):
            name = output_name or ("logits" if "logits" in out else next(iter(out), ""))
            if name not in out:
                print(f"layertap serve: error: --output-name {name!r}: the outputs are {', '.join(out)}", file=sys.stderr)
                return 2
            picked = out[name]
        elif isinstance(out, list):
            picked = out[int(output_name.removeprefix("output") or 0)]
        else:
            picked = out
        print(f"layertap: model={meta.model_name} source={meta.source} device={meta.device} "
              f"params={meta.parameter_count}")
        print(f"layertap: captured {layer} {tuple(act.shape)} {act.dtype} mean={float(np.mean(act)):.6f} "
              f"std={float(np.std(act)):.6f}; infer output {tuple(np.shape(picked))}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from layertap.server.app import start_server
    from layertap.server.cli.signals import install_signal_handlers
    from layertap.server.host.sources import ModelLoadError

    config = config_from_args(args)
    if (why := check_exposure(config)) is not None:
        print(f"layertap serve: error: {why}", file=sys.stderr)
        return 2
    try:
        server = start_server(config)
    except ModelLoadError as exc:
        print(f"layertap serve: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"layertap serve: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # a malformed --auth-tokens file or certificate
        print(f"layertap serve: error: {exc}", file=sys.stderr)
        return 2
    print(f"layertap: serving on {config.host}:{server.port}", flush=True)
    if server.metrics_port is not None:
        print(f"layertap: metrics on {'https' if config.tls_cert else 'http'}://{config.host}:{server.metrics_port}/metrics", flush=True)
    layer = suggested_layer(server)
    if args.smoke:
        try:
            if layer is None:
                print("layertap serve: error: --smoke needs a model with hookable child modules", file=sys.stderr)
                return 2
            return smoke(f"{config.host}:{server.port}", layer, args.output_name)
        finally:
            server.stop(0)
    # Before the hint: a supervisor that reads it may signal at once.
    install_signal_handlers(server)
    print(hint(server, layer), flush=True)
    if server.state.generator is not None:
        print(generate_hint(server, layer), flush=True)
    server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
