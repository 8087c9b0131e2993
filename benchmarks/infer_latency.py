"""End-to-end tap overhead: median Infer latency over the real server, tapped vs not, same run.

One ``layertap serve`` subprocess (so client and server do not share a GIL)
hosts the demo model; the real client sends batch-32 Infer requests. Rounds
alternate between no tap and each tapped variant (A B A C ...), and the
script prints each variant's median latency over the untapped rounds next to
it, with the spread of the per-round ratios. The 14 block-level modules are
tapped, as in ``benchmarks/overhead.py``; every tap has one live subscriber
draining it, as a real deployment would.

Compiling: the server compiles the basic-statistics kernel in the background
when the first tap is created; this script creates and deletes each tap once
and waits for the compile counter to settle before timing (pass
``--no-compile`` to time the eager kernels).

    python benchmarks/infer_latency.py --requests 40 --rounds 7
"""

from __future__ import annotations

import argparse
import platform
import re
import statistics
import subprocess
import threading
import time
import urllib.request

import numpy as np
import torch
from _serving import serve  # benchmarks/ is on sys.path when run as a script

import layertap

BASIC = ["moments", "minmax", "zero_fraction", "nonfinite"]
SELECTOR = "re:^(layer[1-4](\\.[01])?|avgpool|fc)$"  # the 14 block-level modules
VARIANTS: dict[str, dict] = {
    "basic reducers": {"reducers": BASIC},
    "+ histogram + quantiles": {"reducers": [*BASIC, "histogram", "quantiles"]},
    "basic, every=10": {"reducers": BASIC, "every": 10},
}


def start_server(no_compile: bool, telemetry_nice: int | None = None,
                 malloc_tuning: bool = False) -> tuple[subprocess.Popen[str], str, int]:
    args = ["--metrics-port", "0"]
    if no_compile:
        args.append("--no-compile")
    if malloc_tuning:
        args.append("--malloc-tuning")
    if telemetry_nice is not None:
        args += ["--telemetry-nice", str(telemetry_nice)]
    proc, address, metrics = serve(args)
    return proc, address, -1 if metrics is None else metrics


def compiles(metrics_port: int) -> float:
    """``layertap_reducer_compiles_total`` (0 when compiling is off)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(r"^layertap_reducer_compiles_total\{[^}]*\} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def timed_requests(client: layertap.Client, x: np.ndarray, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        client.infer(x)
        out.append(time.perf_counter() - start)
    return out


class Tapped:
    """A stream tap with a subscriber draining it in a thread, for the duration of a round."""

    def __init__(self, client: layertap.Client, options: dict) -> None:
        self._client = client
        self._stream = client.watch(SELECTOR, **options)
        self._thread = threading.Thread(target=self._drain, daemon=True)

    def _drain(self) -> None:
        try:
            for _ in self._stream:
                pass
        except layertap.LayertapError:
            pass  # cancelled at the end of the round

    def __enter__(self) -> Tapped:
        self._thread.start()
        end = time.monotonic() + 30
        while self._client.stats().active_hooks < 14:  # the stream's tap is in
            if time.monotonic() > end:
                raise RuntimeError("the stream tap's hooks did not appear")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stream.close()
        self._thread.join(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=40, help="Infer calls per round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--telemetry-nice", type=int, help="the server's --telemetry-nice (default: its own default)")
    ap.add_argument("--malloc-tuning", action="store_true", help="start the server with --malloc-tuning")
    args = ap.parse_args()

    proc, address, metrics_port = start_server(args.no_compile, args.telemetry_nice, args.malloc_tuning)
    try:
        x = np.random.default_rng(0).standard_normal((args.batch, 3, 32, 32)).astype(np.float32)
        with layertap.Client(address, timeout=120) as client:
            timed_requests(client, x, 10)  # warm up
            for options in VARIANTS.values():  # first sightings: let every compile finish untimed
                with Tapped(client, options):
                    timed_requests(client, x, 5)
            settled, last = time.monotonic(), compiles(metrics_port)
            while time.monotonic() - settled < 5:  # no new compile for 5 s
                time.sleep(1)
                now = compiles(metrics_port)
                if now != last:
                    settled, last = time.monotonic(), now
            ratios: dict[str, list[float]] = {k: [] for k in VARIANTS}
            bases: list[float] = []
            for _ in range(args.rounds):
                for name, options in VARIANTS.items():
                    base = statistics.median(timed_requests(client, x, args.requests))
                    with Tapped(client, options):
                        timed_requests(client, x, 3)
                        tapped = statistics.median(timed_requests(client, x, args.requests))
                    bases.append(base)
                    ratios[name].append(tapped / base)
    finally:
        proc.terminate()
        proc.wait(30)

    print(f"layertap infer latency: demo model, batch {args.batch}, 14 block taps, {platform.machine()}, "
          f"torch {torch.__version__}, compile={'off' if args.no_compile else 'on'} ({last:.0f} kernels), "
          f"telemetry-nice={'default' if args.telemetry_nice is None else args.telemetry_nice}, "
          f"--malloc-tuning={'yes' if args.malloc_tuning else 'no'}")
    print(f"untapped median Infer {statistics.median(bases) * 1e3:.2f} ms; "
          f"{args.rounds} interleaved rounds x {args.requests} requests")
    print(f"{'variant':28s} {'median':>7s}  spread")
    for name, rs in ratios.items():
        print(f"{name:28s} {statistics.median(rs):6.2f}x  [{min(rs):.2f}..{max(rs):.2f}]")


if __name__ == "__main__":
    main()
