"""Taps on a compiled model (issue 29): Infer latency over the real server, side by side in one run.

Servers (one at a time, each a ``layertap serve`` subprocess hosting the demo
model; batch-32 Infer through the real client, a subscriber draining every tap):

1. ``--compile-model`` (fallback eager): the compiled base against the
   compiled model with a basic tap (moments, minmax, zero_fraction,
   nonfinite) on the 14 block-level modules, its statistics in the graph, in
   interleaved rounds; then the latency distribution while a tap on new
   layers is created (its graph compiles in the background; tapped passes
   run eager meanwhile) against the steady distribution.
2. ``--compile-model --compile-fallback pending``: the same tap change, the
   old graph serving meanwhile.
3. eager ``serve``: the eager base against the eager model with the same tap.

And in this process, on the module alone (no server): the compiled base,
the statistics inside the graph (dynamo variants, and on CPU the AOTInductor
packages a child process builds, which ``serve --compile-model`` runs by
default), and the same statistics as Python hooks between graphs (``torch._dynamo.disable``'d hooks on the tapped modules: a
graph break at each, the reducers' plan run between the pieces).

    python benchmarks/compiled_serving.py --requests 40 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import tempfile
import threading
import time
from typing import Any

import numpy as np
import torch
from _serving import serve  # benchmarks/ is on sys.path when run as a script

import layertap

BASIC = ["moments", "minmax", "zero_fraction", "nonfinite"]
SELECTOR = "re:^(layer[1-4](\\.[01])?|avgpool|fc)$"  # the 14 block-level modules
#: Taps on layers the 14-block graph lacks: each forces a new compile.
CHANGES = ["re:^layer[1-4]\\.0\\.conv1$", "re:^layer[1-4]\\.1\\.conv1$"]


def start_server(*extra: str) -> tuple[subprocess.Popen[str], str]:
    proc, address, _ = serve(["--no-metrics", *extra])  # metrics unread here: no fixed port to collide
    return proc, address


def timed(client: layertap.Client, x: np.ndarray, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        client.infer(x)
        out.append(time.perf_counter() - start)
    return out


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3


class Watched:
    """A stream tap with a subscriber draining it, until closed."""

    def __init__(self, client: layertap.Client, selector: str) -> None:
        self.stream = client.watch(selector, reducers=BASIC)
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        try:
            for _ in self.stream:
                pass
        except layertap.LayertapError:
            pass

    def close(self) -> None:
        self.stream.close()
        self.thread.join(10)


def wait_serving(client: layertap.Client, x: np.ndarray, want: str = "in_graph", timeout: float = 600) -> float:
    """Seconds until every tap is served ``want`` (Infer keeps running meanwhile)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        client.infer(x)
        taps = client.taps()
        if taps and all(t.serving == want for t in taps):
            return time.monotonic() - start
        time.sleep(0.05)
    raise RuntimeError(f"taps not {want} after {timeout} s: {[t.serving for t in client.taps()]}")


def wait_compiled_base(client: layertap.Client, x: np.ndarray, timeout: float = 600) -> None:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        before = client.stats().compiled_passes
        client.infer(x)
        if client.stats().compiled_passes > before:
            return
        time.sleep(0.2)
    raise RuntimeError("the untapped graph never served")


def rounds(client: layertap.Client, x: np.ndarray, n: int, requests: int) -> tuple[list[float], list[float]]:
    """Interleaved (untapped, tapped) medians; the tapped one's graph is already compiled."""
    base, tapped = [], []
    for _ in range(n):
        base.append(statistics.median(timed(client, x, requests)))
        w = Watched(client, SELECTOR)
        try:
            wait_serving(client, x, timeout=60)  # a cached variant: no compile
            timed(client, x, 3)
            tapped.append(statistics.median(timed(client, x, requests)))
        finally:
            w.close()
    return base, tapped


def tap_change(client: layertap.Client, x: np.ndarray, selector: str) -> tuple[list[float], float]:
    """Infer latencies from a tap's creation until its graph serves, and that time."""
    lat: list[float] = []
    stop = threading.Event()

    def load() -> None:
        with layertap.Client(client_address, timeout=120) as c2:
            while not stop.is_set():
                t0 = time.perf_counter()
                c2.infer(x)
                lat.append(time.perf_counter() - t0)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    time.sleep(0.5)
    n0 = len(lat)
    taps = len(client.taps())
    w = Watched(client, selector)
    start = time.monotonic()
    try:
        while len(client.taps()) <= taps:  # the stream's tap is in
            time.sleep(0.01)
        while not all(t.serving == "in_graph" for t in client.taps()):
            time.sleep(0.1)
            if time.monotonic() - start > 600:
                raise RuntimeError("the new graph never served")
        took = time.monotonic() - start
        time.sleep(0.5)
    finally:
        stop.set()
        worker.join(30)
        w.close()
    return lat[n0:], took


client_address = ""


def serve_compiled(args: argparse.Namespace, x: np.ndarray, fallback: str, report: list[str]) -> None:
    global client_address
    proc, client_address = start_server("--compile-model", "--compile-fallback", fallback,
                                        "--compile-where", args.compile_where)
    try:
        with layertap.Client(client_address, timeout=120) as client:
            t0 = time.monotonic()
            wait_compiled_base(client, x)
            report.append(f"[{fallback}] untapped graph served after {time.monotonic() - t0:.1f} s")
            base_tap = Watched(client, SELECTOR)
            took = wait_serving(client, x)
            report.append(f"[{fallback}] 14-block tap: its graph served after {took:.1f} s")
            steady = timed(client, x, args.steady)
            if fallback == "eager":
                base_tap.close()
                b, t = rounds(client, x, args.rounds, args.requests)
                ratios = [tt / bb for bb, tt in zip(b, t)]
                report.append(f"[compiled] base median {statistics.median(b) * 1e3:.2f} ms; 14-block tap in graph "
                              f"{statistics.median(t) * 1e3:.2f} ms: {statistics.median(ratios):.3f}x "
                              f"[{min(ratios):.3f}..{max(ratios):.3f}] over {args.rounds} rounds x {args.requests}")
                base_tap = Watched(client, SELECTOR)
                wait_serving(client, x, timeout=60)
                steady = timed(client, x, args.steady)
            report.append(f"[{fallback}] steady (14-block tap in graph): p50 {pct(steady, 50):.2f} ms, "
                          f"p99 {pct(steady, 99):.2f} ms over {len(steady)}")
            for sel in CHANGES[:args.changes]:
                lat, took = tap_change(client, x, sel)
                stats = client.stats()
                report.append(f"[{fallback}] tap change {sel}: graph served after {took:.1f} s; {len(lat)} Infers: "
                              f"p50 {pct(lat, 50):.2f} ms, p99 {pct(lat, 99):.2f} ms, max {max(lat) * 1e3:.1f} ms "
                              f"({pct(lat, 99) / pct(steady, 99):.2f}x steady p99); request-thread compiles "
                              f"{stats.request_thread_compiles}")
            base_tap.close()
    finally:
        proc.terminate()
        proc.wait(60)


def serve_eager(args: argparse.Namespace, x: np.ndarray, report: list[str]) -> None:
    proc, address = start_server()
    try:
        with layertap.Client(address, timeout=120) as client:
            timed(client, x, 10)
            w = Watched(client, SELECTOR)
            timed(client, x, 20)
            time.sleep(20)  # the reducers' kernel compiles in the background
            w.close()
            base, tapped = [], []
            for _ in range(args.rounds):
                base.append(statistics.median(timed(client, x, args.requests)))
                w = Watched(client, SELECTOR)
                time.sleep(0.3)
                timed(client, x, 3)
                tapped.append(statistics.median(timed(client, x, args.requests)))
                w.close()
            ratios = [t / b for b, t in zip(base, tapped)]
            report.append(f"[eager] base median {statistics.median(base) * 1e3:.2f} ms; 14-block tap (hooks) "
                          f"{statistics.median(tapped) * 1e3:.2f} ms: {statistics.median(ratios):.3f}x "
                          f"[{min(ratios):.3f}..{max(ratios):.3f}]")
    finally:
        proc.terminate()
        proc.wait(60)


def module_level(args: argparse.Namespace, report: list[str]) -> None:
    """Compiled base, statistics in the graph, statistics as hooks between graphs: the module alone."""
    from layertap.server.compile.variant import Variant, clone_tree
    from layertap.server.host.demo_model import build_demo_model
    from layertap.server.reducers.plan import ReducerPlan, build_reducers
    from layertap.server.taps.graph import GraphFeed
    from layertap.v1 import telemetry_pb2 as pb

    device = torch.device(args.device)
    model = build_demo_model(0).to(device).eval()
    layers = [n for n, _ in model.named_modules() if re.match(SELECTOR.removeprefix("re:"), n)]
    with torch.inference_mode():  # a served pass's inputs reach the graph as inference tensors
        x = torch.randn(args.batch, 3, 32, 32, device=device)
    plan = ReducerPlan(build_reducers([pb.ReducerSpec(kind=k) for k in (
        pb.REDUCER_KIND_MOMENTS, pb.REDUCER_KIND_MINMAX, pb.REDUCER_KIND_ZERO_FRACTION, pb.REDUCER_KIND_NONFINITE)]))
    from torch._inductor.compile_fx import compile_fx

    base = Variant(model, (), compile_fx, 0)
    graph = Variant(model, tuple(layers), compile_fx, 1, GraphFeed.statistics)
    packaged = {}
    if device.type == "cpu":  # what serve --compile-model runs on CPU: packages built by a child process
        from layertap.server.compile.process import ProcessVariant
        from layertap.server.compile.skeleton import skeleton_bytes

        work = tempfile.mkdtemp(prefix="layertap-bench-")
        with open(os.path.join(work, "skeleton"), "wb") as f:
            f.write(skeleton_bytes(model))
        for key in ((), tuple(layers)):
            packaged[key] = ProcessVariant(model, key, os.path.join(work, "skeleton"), GraphFeed.statistics,
                                           {0: (0,)}, {}, work)
            packaged[key].compile((x,), {})
    hooked = clone_tree(model)
    out: list[torch.Tensor] = []

    @torch._dynamo.disable
    def between(_m: Any, _a: Any, o: torch.Tensor) -> None:
        out.append(plan.run(o))

    for name in layers:
        hooked.get_submodule(name).register_forward_hook(between)
    torch._dynamo.config.recompile_limit = 64
    hooks_fn = torch.compile(hooked)
    with torch.inference_mode():
        xd = x.clone()
        base.compile((xd,), {})
        graph.compile((xd,), {})
        hooks_fn(xd)
        assert base.run((x,), {}) is not None and graph.run((x,), {}) is not None, "a compiled entry rejects x"
        runs = {"compiled base": lambda: base.run((x,), {}), "stats in graph": lambda: graph.run((x,), {}),
                **({"package base": lambda: packaged[()].run((x,), {}),
                    "package stats in graph": lambda: packaged[tuple(layers)].run((x,), {})} if packaged else {}),
                "hooks between graphs": lambda: (hooks_fn(x), out.clear()),
                "eager, no taps": lambda: model(x)}
        med: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(args.rounds):
            for name, fn in runs.items():
                for _ in range(3):
                    fn()
                ts = []
                for _ in range(args.requests):
                    t0 = time.perf_counter()
                    fn()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    ts.append(time.perf_counter() - t0)
                med[name].append(statistics.median(ts))
    for name, ms in med.items():
        against = "package base" if name.startswith("package") else "compiled base"
        ratios = [m / b for m, b in zip(ms, med[against])]  # round by round, as they ran side by side
        report.append(f"[module] {name:22s} {statistics.median(ms) * 1e3:7.2f} ms  {statistics.median(ratios):.3f}x "
                      f"[{min(ratios):.3f}..{max(ratios):.3f}] of the {against}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=40, help="Infer calls per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steady", type=int, default=300, help="Infer calls of the steady distribution")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--changes", type=int, default=len(CHANGES), choices=range(1, len(CHANGES) + 1),
                    help="tap changes timed per server (each compiles a new graph: minutes under load)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: compiled,pending,eager,module")
    ap.add_argument("--only", default="", help="comma-separated parts to run (default: all)")
    ap.add_argument("--device", default="cpu", help="the module-level part's device (the servers pick their own)")
    ap.add_argument("--compile-where", choices=("process", "thread"), default="process",
                    help="the compiled servers' --compile-where (where a variant compiles)")
    args = ap.parse_args()
    parts = {"compiled", "pending", "eager", "module"}
    skip = set(filter(None, args.skip.split(","))) | (parts - set(args.only.split(",")) if args.only else set())
    torch.set_num_threads(os.cpu_count() or 1)
    x = np.random.default_rng(0).standard_normal((args.batch, 3, 32, 32)).astype(np.float32)
    report: list[str] = [f"layertap compiled serving (--compile-where {args.compile_where}): demo model, "
                         f"batch {args.batch}, {platform.machine()}, "
                         f"{os.cpu_count()} CPUs, torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}"]
    if "compiled" not in skip:
        serve_compiled(args, x, "eager", report)
        print("\n".join(report), flush=True)
    if "pending" not in skip:
        serve_compiled(args, x, "pending", report)
    if "eager" not in skip:
        serve_eager(args, x, report)
    if "module" not in skip:
        module_level(args, report)
    report.append(f"load average at the end {os.getloadavg()[0]:.1f}")
    print("\n".join(report))


if __name__ == "__main__":
    main()
