"""The ``layertap`` command line: a thin shell over :class:`layertap.Client`.

``serve`` and ``demo`` hand their arguments to the server package, imported
only then, so the base install (no torch) runs every other command.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import secrets
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from ._channel import normalize_target
from ._cli_args import positive_float, positive_int
from ._cli_errors import error_line
from ._cli_explain import add_explain_command
from ._cli_generate import add_generate_command
from ._cli_incidents import add_incidents_command
from ._cli_infer import add_infer_command
from ._cli_input import add_vocab_flag, load_input, random_inputs
from ._cli_json import write_json_lines
from ._cli_profile import add_profile_command
from ._cli_table import drift_table, layers_table, stats_table, taps_table
from ._cli_tensorboard import add_tensorboard_command
from ._cli_view import SPARK_WIDTH, CaptureProgress, sparkline
from ._cli_watch import WatchOptions, run_watch
from ._client import DEFAULT_TIMEOUT, Client
from ._errors import InvalidArgument, LayertapError
from ._tokens import SCOPES, digest, format_line
from ._types import DEFAULT_REDUCERS
from ._version import __version__

__all__ = ["SPARK_WIDTH", "build_parser", "main", "parse_args", "sparkline"]

PROG = "layertap"
#: Subcommands whose arguments belong to the server package.
_PASSTHROUGH = ("serve", "demo")
_DEMOS = {"drift": "layertap.server.cli.drift_demo"}


# --------------------------------------------------------------------------- parsing


def _host(text: str) -> str:
    try:
        return normalize_target(text)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(exc.details) from None


def _reducer_list(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected a comma-separated list of reducers")
    return names


def _json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per line, with the client's field names (NaN/Inf as \"NaN\", \"+Inf\", \"-Inf\")",
    )


def build_parser() -> argparse.ArgumentParser:
    """Builds the argument parser (``serve`` and ``demo`` only document themselves here)."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Tap any layer of a served PyTorch model over gRPC."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("host", type=_host, metavar="HOST", help="host:port, or a port on 127.0.0.1")
        p.add_argument(
            "--timeout",
            type=positive_float,
            default=DEFAULT_TIMEOUT,
            help=f"deadline of each call in seconds (default {DEFAULT_TIMEOUT:g})",
        )
        p.add_argument("--token", help="bearer token (default: $LAYERTAP_TOKEN)")
        p.add_argument("--tls", action="store_true", help="connect over TLS, trusting the system's roots")
        p.add_argument("--tls-ca", metavar="CA_FILE", help="connect over TLS, trusting this CA bundle")
        return p

    p = command("layers", "List the model's modules with types, parameters and last shapes.")
    _json_flag(p)
    p.set_defaults(func=_cmd_layers)

    p = command("capture", "Capture the tensors at one or more layers into .npy/.npz.")
    p.add_argument("layers", nargs="+", metavar="LAYER",
                   help="module name(s), globs ('layer*') or re:regex; several or a pattern give an .npz keyed by layer")
    p.add_argument("-o", "--output", required=True, type=Path, help="output .npy or .npz file")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--input", type=Path, help="run this .npy (or multi-argument .npz, whose keys name the inputs) input instead of waiting for live traffic")
    source.add_argument("--random-input", action="store_true",
                        help="run a random input that fits the model's metadata instead of waiting for live traffic "
                             "(works on a fresh server; see 'layertap infer --help')")
    add_vocab_flag(p)
    p.add_argument("--n", type=positive_int, default=1, help="live passes to capture (default 1)")
    p.add_argument("--point", choices=("output", "input"), default="output")
    p.add_argument("--max-batch", type=positive_int, help="keep at most this many batch rows")
    p.add_argument("--dtype", choices=("float16", "bfloat16"), help="downcast floating tensors on the server")
    p.set_defaults(func=_cmd_capture)

    p = command(
        "watch",
        "Live table of summaries from a stream tap (Ctrl-C to stop); "
        "one line per summary when stdout is not a terminal.",
    )
    _json_flag(p)
    p.add_argument("selector", metavar="SELECTOR", help="module name, glob ('layer*') or re:regex")
    p.add_argument(
        "--reducers",
        type=_reducer_list,
        default=list(DEFAULT_REDUCERS),
        help=f"comma-separated reducers (default {','.join(DEFAULT_REDUCERS)})",
    )
    p.add_argument("--every", type=positive_int, help="summarize every N-th pass")
    p.add_argument("--point", default="output", help="output, input, grad_output, grad_input, param_grad")
    p.add_argument("--keep-padding", action="store_true",
                   help="keep the positions an attention_mask marks as padding in the statistics "
                        "(default: left out for (batch, tokens, ...) tensors)")
    p.add_argument("--derive", default="", choices=("", "entropy", "top1_prob"),
                   help="reduce the per-row softmax entropy or top-1 probability of the tensor's last axis")
    p.add_argument("--queue-size", type=positive_int, help="server-side queue length")
    p.add_argument("--count", type=positive_int, help="stop after this many summaries")
    p.add_argument("--duration", type=positive_float, help="stop after this many seconds")
    p.set_defaults(func=_cmd_watch)

    p = command("baseline", "Freeze a drift baseline from the next N live passes.")
    p.add_argument("selector", metavar="SELECTOR")
    p.add_argument("--passes", type=positive_int, default=500, help="passes in the baseline (default 500: ten windows of 50, enough to calibrate)")
    p.add_argument("--window", type=positive_int, default=50, help="sliding window compared with it (default 50)")
    p.add_argument("--point", default="output")
    p.add_argument("--name", default="", help="the baseline tap's id (default: baseline-<hash of selector and point>)")
    p.add_argument("--derive", default="", choices=("", "entropy", "top1_prob"),
                   help="baseline the per-token softmax entropy or top-1 probability of the tensor's last axis")
    for metric in ("psi", "js", "wasserstein", "mean-shift"):
        p.add_argument(f"--{metric}", type=positive_float,
                       help=f"{metric} threshold; any threshold makes the alarm fixed instead of calibrated")
    p.set_defaults(func=_cmd_baseline)

    p = command("drift", "Show current drift scores and alarms against the baselines.")
    p.add_argument("selector", nargs="?", default="", metavar="SELECTOR", help="filter layers")
    p.add_argument("--false-alarm-rate", type=positive_float, default=None, metavar="RATE",
                   help="first set the server's per-window false-alarm rate of calibrated alarms (needs admin)")
    _json_flag(p)
    p.set_defaults(func=_cmd_drift)

    p = command("taps", "List durable and stream taps with their counters.")
    _json_flag(p)
    p.set_defaults(func=_cmd_taps)

    p = command("stats", "Show the server's counters (hooks, passes, captures, subscribers).")
    _json_flag(p)
    p.set_defaults(func=_cmd_stats)

    add_infer_command(command)
    add_generate_command(command)
    add_explain_command(command)
    add_profile_command(command)
    add_tensorboard_command(command)
    add_incidents_command(command)

    p = sub.add_parser("token", help="Manage access tokens for 'layertap serve --auth-tokens'.")
    tok = p.add_subparsers(dest="token_command", metavar="ACTION", required=True)
    p = tok.add_parser("new", help="Print a new random token and the token-file line that admits it.")
    p.add_argument("--id", required=True, help="the token's id: the principal named in logs and tap owners")
    p.add_argument("--scopes", required=True, help=f"comma-separated: {','.join(SCOPES)}")
    p.add_argument("--expires", help="RFC 3339 expiry, e.g. 2027-01-01T00:00:00Z")
    p.set_defaults(func=_cmd_token_new)

    p = sub.add_parser(
        "serve",
        help="Run a layertap server (needs layertap[server]); see 'layertap serve --help'.",
        add_help=False,
    )
    p.add_argument("args", nargs=argparse.REMAINDER)
    p = sub.add_parser(
        "demo",
        help="Run a demo against a server, e.g. 'layertap demo drift' (needs layertap[server]).",
        add_help=False,
    )
    p.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses a command line; ``serve`` and ``demo`` keep their arguments verbatim.

    Raises:
        SystemExit: On a usage error (argparse prints it) or ``--help``.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in _PASSTHROUGH:
        # argparse would try to parse the server's own options.
        if args[0] == "serve":
            return argparse.Namespace(command="serve", rest=args[1:], func=_cmd_serve)
        return argparse.Namespace(
            command="demo",
            demo=args[1] if len(args) > 1 else None,
            rest=args[2:],
            func=_cmd_demo,
        )
    return build_parser().parse_args(args)


# --------------------------------------------------------------------------- helpers


def _flatten(value: Any, prefix: str, out: dict[str, np.ndarray[Any, Any]]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(item, f"{prefix}/{key}" if prefix else str(key), out)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _flatten(item, f"{prefix}/{index}", out)
    else:
        out[prefix] = np.asarray(value)


# --------------------------------------------------------------------------- commands


def _client(args: argparse.Namespace) -> Client:
    return Client(args.host, timeout=args.timeout, token=args.token, tls=args.tls_ca or args.tls)


def _cmd_layers(args: argparse.Namespace) -> int:
    with _client(args) as client:
        layers = client.layers()
    if args.json:
        write_json_lines(layers)
        return 0
    console = Console()
    console.print(layers_table(layers, console.width, f"{len(layers)} layers at {args.host}"))
    return 0


def _cmd_capture(args: argparse.Namespace) -> int:
    stderr = Console(stderr=True)
    inputs = load_input(args.input) if args.input is not None else None
    progress = CaptureProgress(stderr)
    try:
        with _client(args) as client:
            if args.random_input:
                inputs = random_inputs(client.metadata().inputs, vocab_size=args.vocab_size)
            result = client.capture(
                list(args.layers),
                input=inputs if isinstance(inputs, dict) else tuple(inputs) if inputs is not None else None,
                n=args.n,
                point=args.point,
                max_batch=args.max_batch,
                dtype=args.dtype,
                timeout=args.timeout,
                progress=progress,
            )
    finally:
        progress.close()
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    if args.n == 1:
        _flatten(result, "", arrays)
    else:
        for index, per_pass in enumerate(result):
            _flatten(per_pass, f"pass{index}", arrays)
    out: Path = args.output
    if len(arrays) == 1 and out.suffix != ".npz":
        ((name, array),) = arrays.items()
        if out.suffix != ".npy":
            out = out.with_name(out.name + ".npy")
        np.save(out, array)
    else:
        if out.suffix != ".npz":
            out = out.with_suffix(".npz")
            stderr.print(f"{len(arrays)} tensors: writing {out} instead of a single .npy")
        np.savez(out, **arrays)  # type: ignore[arg-type]
    for name, array in arrays.items():
        stderr.print(f"{name}: {array.dtype} {tuple(array.shape)}")
    print(out)
    return 0


def _cmd_watch(args: argparse.Namespace) -> int:
    with _client(args) as client, client.watch(
        args.selector,
        reducers=args.reducers,
        every=args.every,
        point=args.point,
        keep_padding=args.keep_padding or None,
        derive=args.derive or None,
        queue_size=args.queue_size,
        timeout=args.duration,
    ) as stream:
        try:
            run_watch(stream, WatchOptions(
                title=f"{args.selector} @ {args.host} ({','.join(args.reducers)})",
                count=args.count,
                duration=args.duration,
                json=args.json,
            ))
        except LayertapError as exc:
            if exc.code != "DEADLINE_EXCEEDED" or args.duration is None:
                raise  # Reaching --duration is the normal end.
        except KeyboardInterrupt:
            pass
    return 0


def _cmd_baseline(args: argparse.Namespace) -> int:
    thresholds = {
        key: value
        for key, value in (
            ("psi", args.psi),
            ("js", args.js),
            ("wasserstein", args.wasserstein),
            ("mean_shift", args.mean_shift),
        )
        if value is not None
    }
    with _client(args) as client:
        info = client.set_baseline(
            args.selector,
            passes=args.passes,
            window=args.window,
            point=args.point,
            thresholds=thresholds or None,
            name=args.name,
            derive=args.derive,
        )
    print(f"baseline tap {info.tap}: collecting {args.passes} passes over {len(info.layers)} layer(s)")
    for layer in info.layers:
        print(f"  {layer}")
    return 0


def _cmd_drift(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.false_alarm_rate is not None:
            client.baselines.set_false_alarm_rate(args.false_alarm_rate)
        rows = client.drift(args.selector)
    if args.json:
        write_json_lines(rows)
        return 0
    console = Console()
    console.print(drift_table(rows, console.width, f"drift at {args.host}"))
    return 0


def _cmd_taps(args: argparse.Namespace) -> int:
    with _client(args) as client:
        taps = client.taps()
    if args.json:
        write_json_lines(taps)
        return 0
    console = Console()
    console.print(taps_table(taps, console.width, f"{len(taps)} taps at {args.host}"))
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    with _client(args) as client:
        stats = client.stats()
    if args.json:
        write_json_lines([stats])
        return 0
    Console().print(stats_table(stats, f"server stats at {args.host}"))
    return 0


def _server_entry(module: str, what: str) -> Callable[[list[str]], Any] | None:
    try:
        entry: Callable[[list[str]], Any] = getattr(importlib.import_module(module), "main")
    except ImportError as exc:
        print(
            f"{PROG}: {what} needs the server extra: pip install 'layertap[server]' ({exc})",
            file=sys.stderr,
        )
        return None
    return entry


def _cmd_token_new(args: argparse.Namespace) -> int:
    """The token goes to stdout once; only its digest goes into the server's file."""
    scopes = [part.strip() for part in args.scopes.split(",") if part.strip()]
    bad = [scope for scope in scopes if scope not in SCOPES]
    if bad or not scopes or not args.id or any(c.isspace() or c == "#" for c in args.id):
        print(f"{PROG}: token new: --id must be one word; --scopes some of {','.join(SCOPES)}", file=sys.stderr)
        return 2
    token = secrets.token_urlsafe(32)
    line = format_line(args.id, digest(token), scopes, args.expires)
    print(f"token: {token}")
    print(f"add this line to the --auth-tokens file (then send SIGHUP to the server):\n{line}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    serve_main = _server_entry("layertap.server.cli.serve", "serve")
    if serve_main is None:
        return 1
    return int(serve_main(list(args.rest)) or 0)


def _cmd_demo(args: argparse.Namespace) -> int:
    module = _DEMOS.get(args.demo or "")
    if module is None:
        print(f"{PROG}: demo: choose one of: {', '.join(_DEMOS)}", file=sys.stderr)
        return 2
    demo_main = _server_entry(module, f"demo {args.demo}")
    if demo_main is None:
        return 1
    return int(demo_main(list(args.rest)) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit code (errors: one line on stderr, code 1)."""
    args = parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader downstream stopped reading (`layertap watch ... | head`):
        # that ends the output, it is not an error. Point stdout at devnull so
        # the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (LayertapError, OSError, ValueError) as exc:
        print(f"{PROG}: error: {error_line(exc)}", file=sys.stderr)
        return 1


def run() -> None:
    """The console script's entry: :func:`main`, then leave the process.

    A server started by ``serve`` or ``demo`` may still be inside a reducer
    compile when it has stopped: a cold one takes up to ~20 s, past any stop
    grace, and cannot be interrupted, while a thread left inside inductor's
    C++ at interpreter exit aborts the process. So when one still runs, the
    process leaves with ``os._exit`` after flushing (inductor's compile
    workers exit with their parent). Only here, never in :func:`main`, which
    in-process callers use. The server is looked up, not imported: the thin
    client never loads it.
    """
    rc = main()
    compiled = sys.modules.get("layertap.server.reducers.compiled")
    if compiled is not None and not compiled.COMPILED_STATS.wait_idle(0.5):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)


if __name__ == "__main__":
    run()
