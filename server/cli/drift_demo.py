"""``layertap demo drift``: in-distribution traffic, a baseline, then shifted traffic.

The demo drives a model through the real client at a steady rate:

1. it sets a drift baseline over ``layer*`` from the first passes, fed with
   in-distribution inputs, N(0, 1);
2. after ``--shift-after`` seconds (and once the baseline is ready) it feeds
   shifted inputs, N(shift, 1), so drift shows on the dashboard within a
   minute at the default rate and window;
3. every few seconds it prints a compact drift table.

Without ``--target`` it serves the demo model in-process, with ``/metrics`` on
``--metrics-port`` (9466, what deploy/prometheus/prometheus.yml scrapes).
Ctrl-C (or SIGTERM) stops it cleanly; a second Ctrl-C aborts.
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any, TextIO

import numpy as np

from layertap.server.drift.null import MIN_WINDOWS
from layertap.server.drift.thresholds import DRIFT_METRICS

log = logging.getLogger("layertap.demo")

PROG = "layertap demo drift"
_DTYPES = {"float32": np.float32, "float16": np.float16, "float64": np.float64}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Drive a model with in-distribution inputs, freeze a drift baseline, then shift the inputs.",
    )
    p.add_argument("--target", help="HOST:PORT of a running layertap server (default: serve the demo model in-process)")
    p.add_argument("--port", type=int, default=0, help="in-process server: gRPC port (default: a free one)")
    p.add_argument("--metrics-port", type=int, default=9466, help="in-process server: /metrics port; 0 picks a free one")
    p.add_argument("--selector", default="layer*", help="layers to baseline (default: layer*)")
    p.add_argument("--baseline-passes", type=_positive_int, default=100, help="passes in the baseline (default: 100)")
    p.add_argument("--window", type=_positive_int, default=20, help="passes in the sliding drift window (default: 20)")
    p.add_argument("--rate", type=_positive_float, default=10.0, help="inference passes per second (default: 10)")
    p.add_argument("--batch", type=_positive_int, default=8, help="inputs per pass (default: 8)")
    p.add_argument("--shift-after", type=_non_negative_float, default=20.0,
                   help="seconds of in-distribution traffic before the shift (default: 20)")
    p.add_argument("--shift", type=float, default=1.0,
                   help="mean of the shifted inputs, N(shift, 1), in input σ (default: 1.0)")
    p.add_argument("--duration", type=_non_negative_float, default=60.0,
                   help="seconds to run; 0 runs until Ctrl-C (default: 60)")
    p.add_argument("--print-every", type=_positive_float, default=3.0, help="seconds between drift tables (default: 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the demo model and the inputs")
    p.add_argument("--log-level", default="WARNING", help="server log level (default: WARNING)")
    return p


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _positive_float(text: str) -> float:
    v = float(text)
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return v


def _non_negative_float(text: str) -> float:
    v = float(text)
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return v


class _StopOnSignal:
    """SIGINT/SIGTERM set an event instead of raising, so the loop ends between passes.

    A second SIGINT falls back to ``KeyboardInterrupt``. Only the main thread
    can install handlers; elsewhere (tests calling ``main`` on a thread) this
    does nothing.
    """

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.stop.set()

    def __enter__(self) -> _StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _fmt(v: float, width: int = 7) -> str:
    return f"{'-':>{width}}" if math.isnan(v) else f"{v:{width}.3f}"


def format_drift_table(drift: Sequence[Any], *, elapsed: float, phase: str, passes: int) -> str:
    """The compact table printed every few seconds (``drift`` is ``client.drift()``)."""
    lines = [f"t={elapsed:6.1f}s  inputs={phase:<15} passes={passes}",
             f"  {'layer':<24} {'state':<16} {'win':>4} {'psi':>7} {'js':>7} {'w1':>7} {'mean_sh':>7} {'chan':>5}  flag"]
    for d in drift:
        if d.state == "ready":
            state = "ready"
        else:
            state = f"{d.state} {d.baseline_passes}"
        scored = d.window_passes > 0
        chan = "-" if d.channel_drift_fraction is None or not scored else f"{d.channel_drift_fraction:.0%}"
        if scored:
            scores = " ".join(_fmt(getattr(d, m)) for m in DRIFT_METRICS)
        else:
            scores = " ".join(_fmt(math.nan) for _ in DRIFT_METRICS)
        flag = "DRIFT" if d.drifted else ("ok" if scored else "")
        lines.append(f"  {d.layer:<24} {state:<16} {d.window_passes:>4} {scores} {chan:>5}  {flag}")
    return "\n".join(lines)


def _input_maker(meta: Any, batch: int, seed: int) -> Any:
    """A function ``shift -> list of arrays`` matching the model's declared inputs."""
    rng = np.random.default_rng(seed)
    specs = []
    for spec in meta.inputs:
        shape = tuple(batch if d == -1 else int(d) for d in spec.shape)
        dtype = _DTYPES.get(spec.dtype)
        if dtype is None:
            raise ValueError(f"input {spec.name!r} has dtype {spec.dtype}; the drift demo feeds float inputs only")
        specs.append((shape, dtype))

    def make(shift: float) -> list[np.ndarray]:
        return [(rng.standard_normal(shape) + shift).astype(dtype) for shape, dtype in specs]

    return make


def run(client: Any, args: argparse.Namespace, stop: threading.Event, out: TextIO) -> list[str]:
    """Drive traffic until ``--duration`` or ``stop``; returns the layers drifting at the end."""
    meta = client.metadata()
    make_inputs = _input_maker(meta, args.batch, args.seed)
    # A baseline shorter than five windows cannot calibrate its alarm: the demo then gives the
    # default thresholds, so the alarm is fixed and still fires.
    fixed = args.baseline_passes < MIN_WINDOWS * args.window
    info = client.set_baseline(args.selector, passes=args.baseline_passes, window=args.window,
                               thresholds={"psi": 0.2} if fixed else None)
    print(f"layertap demo: baseline {info.tap} over {len(info.layers)} layer(s) ({', '.join(info.layers)}), "
          f"{args.baseline_passes} passes, window {args.window}, "
          f"{'fixed thresholds (too short to calibrate)' if fixed else 'calibrated alarm'}", file=out, flush=True)
    print(f"layertap demo: {args.rate:g} passes/s of N(0, 1) inputs; shifting to N({args.shift:g}, 1) "
          f"after {args.shift_after:g}s", file=out, flush=True)
    period = 1.0 / args.rate
    start = time.monotonic()
    next_table = start + args.print_every
    shifted = False
    waiting_noted = False
    passes = 0
    drift: list[Any] = []
    while not stop.is_set():
        now = time.monotonic()
        elapsed = now - start
        if args.duration and elapsed >= args.duration:
            break
        if not shifted and elapsed >= args.shift_after:
            drift = client.drift(args.selector)
            if all(d.state == "ready" for d in drift):
                shifted = True
                print(f"layertap demo: t={elapsed:.1f}s switching to shifted inputs N({args.shift:g}, 1)",
                      file=out, flush=True)
            elif not waiting_noted:
                waiting_noted = True
                print(f"layertap demo: t={elapsed:.1f}s baseline still collecting; the shift waits for it",
                      file=out, flush=True)
        client.infer(*make_inputs(args.shift if shifted else 0.0))
        passes += 1
        if time.monotonic() >= next_table:
            drift = client.drift(args.selector)
            print(format_drift_table(drift, elapsed=time.monotonic() - start,
                                     phase=f"N({args.shift:g}, 1)" if shifted else "N(0, 1)", passes=passes),
                  file=out, flush=True)
            next_table += args.print_every * max(1, math.ceil((time.monotonic() - next_table) / args.print_every))
        # Keep the schedule (start + k * period) so the rate holds on average.
        delay = start + passes * period - time.monotonic()
        if delay > 0:
            stop.wait(delay)
    drift = client.drift(args.selector)
    print(format_drift_table(drift, elapsed=time.monotonic() - start,
                             phase=f"N({args.shift:g}, 1)" if shifted else "N(0, 1)", passes=passes),
          file=out, flush=True)
    drifting = [d.layer for d in drift if d.drifted]
    why = "stopped" if stop.is_set() else "done"
    print(f"layertap demo: {why} after {passes} passes; drifting layers: {', '.join(drifting) or 'none'}",
          file=out, flush=True)
    return drifting


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``layertap demo drift``; returns the exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from layertap import Client, LayertapError

    stop = threading.Event()
    server = None
    with _StopOnSignal(stop):
        try:
            if args.target:
                target = args.target
            else:
                server = _start_demo_server(args)
                if server is None:
                    return 2
                target = f"127.0.0.1:{server.port}"
            with Client(target) as client:
                run(client, args, stop, sys.stdout)
        except KeyboardInterrupt:
            print("layertap demo: interrupted", file=sys.stderr)
            return 130
        except (LayertapError, ValueError) as exc:
            print(f"{PROG}: error: {' '.join(str(exc).split())}", file=sys.stderr)
            return 1
        finally:
            if server is not None:
                server.stop(0)
    return 0


def _start_demo_server(args: argparse.Namespace) -> Any:
    from layertap.server.app import start_server
    from layertap.server.config import ServerConfig
    from layertap.server.host.sources import ModelLoadError

    config = ServerConfig(port=args.port, metrics_port=args.metrics_port, model="demo", seed=args.seed,
                          drift_window=args.window, grace_seconds=1.0)
    try:
        server = start_server(config)
    except (OSError, ModelLoadError) as exc:
        hint = " (is another server on it? try --metrics-port 0)" if isinstance(exc, OSError) else ""
        print(f"{PROG}: error: cannot start the demo server: {exc}{hint}", file=sys.stderr)
        return None
    print(f"layertap demo: serving the demo model on {config.host}:{server.port}", flush=True)
    if server.metrics_port is not None:
        print(f"layertap demo: metrics on http://{config.host}:{server.metrics_port}/metrics", flush=True)
    return server


if __name__ == "__main__":
    sys.exit(main())
