"""Soak one real server: thousands of captures, streams and taps; is its RSS flat?

``layertap serve`` (the demo model) runs in its own process, so its resident
memory (``VmRSS`` in ``/proc/<pid>/status``) is the server's alone. While a
feeder thread sends live ``Infer`` traffic, three phases run in turn:

* captures: active (``input=``) and passive ones, one or several layers, n=1
  or 2, float16 downcasts, ``max_batch``, input points; a few deadlines that
  expire mid-wait and unknown layers exercise the error paths;
* streams: Subscribe open/close cycles (inline stream taps read once, closed
  before the first message, or a durable tap followed once);
* taps: durable tap create/delete churn with varied selectors and reducers,
  ``with client.tap()`` blocks and rejected selectors.

RSS is sampled every ``--interval`` seconds and every 1% of a phase. Each phase's first 10% of
operations is its warm-up; the script prints, per phase, the RSS after
warm-up, min/max/final after it, the spread against the post-warm-up
reference and a least-squares slope, and whether it stays within 5%. At the
end the server must be idle: 0 hooks, 0 taps, 0 captures, 0 subscribers, and
a pass count that matches the traffic sent.

    python benchmarks/soak.py                      # 10000 captures, 1000 streams, 5000 taps
    python benchmarks/soak.py --quick              # a few minutes at most
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import layertap
from layertap import DeadlineExceeded, LayerNotFound

LAYERS = ["conv1", "layer1", "layer2", "layer3", "layer4", "avgpool", "fc", "layer1.0.conv1", "layer3.1.relu"]
WARMUP = 0.10
FLAT = 0.05


def arrays(value: Any) -> list[np.ndarray]:
    """Every array in a capture result (a shared ReLU gives one per call, n=2 one per pass)."""
    if isinstance(value, np.ndarray):
        return [value]
    items = value.values() if isinstance(value, dict) else value
    return [a for v in items for a in arrays(v)]


class ServerProcess:
    """``layertap serve --model demo`` in a child process, on free ports."""

    def __init__(self, extra: list[str]) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="layertap-soak-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "layertap.cli", "serve", "--port", "0", "--metrics-port", "0",
               "--log-level", "WARNING", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        assert self.proc.stdout is not None
        self.port = self.metrics_url = None
        for line in self.proc.stdout:
            if m := re.search(r"serving on [^\s]+:(\d+)", line):
                self.port = int(m.group(1))
            if m := re.search(r"metrics on (\S+)", line):
                self.metrics_url = m.group(1)
            if self.port and self.metrics_url:
                break
        if not self.port:
            raise RuntimeError(f"the server did not start; see {self.log.name}")
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()

    def rss_kib(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise RuntimeError("no VmRSS line")

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/task"))

    def scrape(self) -> int:
        assert self.metrics_url
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            return len(r.read())

    def compiles(self) -> float:
        """``layertap_reducer_compiles_total`` (0 when compiling is off)."""
        assert self.metrics_url
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            m = re.search(r"^layertap_reducer_compiles_total\{[^}]*\} (\S+)$", r.read().decode(), re.M)
        return float(m.group(1)) if m else 0.0


    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Sample:
    t: float
    phase: str
    done: int
    rss_kib: int


@dataclass
class Progress:
    """What the sampler reads: the current phase and how many of its ops finished."""

    phase: str = "start"
    done: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def tick(self) -> int:
        with self.lock:
            self.done += 1
            return self.done


def warm_compile(server: ServerProcess, client: layertap.Client, x: np.ndarray, compiling: bool) -> int:
    """The first tap compiles (or loads) the statistics kernel, once per process: inductor's
    imports and the package are a one-time cost, not a leak, so they happen before any phase."""
    before = server.rss_kib()
    with client.tap("layer2", reducers=["moments"], ttl=600):
        client.infer(x)
        end = time.monotonic() + 300
        while compiling and server.compiles() < 1 and time.monotonic() < end:  # a cold compile: ~15-20 s
            time.sleep(0.5)
        settled, last = time.monotonic(), server.compiles()
        while time.monotonic() - settled < 5:  # no new compile for 5 s
            time.sleep(1)
            now = server.compiles()
            if now != last:
                settled, last = time.monotonic(), now
        client.infer(x)
    print(f"compile warm-up (the first tap's kernel, once per process): {last:.0f} compiles, RSS "
          f"{before / 1024:.1f} -> {server.rss_kib() / 1024:.1f} MiB")
    return 2  # passes it ran



class Sampler(threading.Thread):
    """Samples the server's RSS (and scrapes /metrics now and then) until stopped."""

    def __init__(self, server: ServerProcess, progress: Progress, interval: float) -> None:
        super().__init__(daemon=True)
        self.server, self.progress, self.interval = server, progress, interval
        self.samples: list[Sample] = []
        self.scrapes: list[tuple[str, int]] = []  # (phase, bytes of /metrics)
        self.halt = threading.Event()

    def take(self) -> Sample:
        s = Sample(time.perf_counter(), self.progress.phase, self.progress.done, self.server.rss_kib())
        self.samples.append(s)
        return s

    def run(self) -> None:
        ticks = 0
        while not self.halt.wait(self.interval):
            self.take()
            ticks += 1
            if ticks % 10 == 0:  # the exporter is part of the server too
                self.scrapes.append((self.progress.phase, self.server.scrape()))


class Feeder(threading.Thread):
    """Live traffic: Infer in a loop, so passive captures and taps see passes."""

    def __init__(self, client: layertap.Client, x: np.ndarray) -> None:
        super().__init__(daemon=True)
        self.client, self.x = client, x
        self.count = 0
        self.halt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                out = self.client.infer(self.x)
                assert out.shape == (self.x.shape[0], 10)
                self.count += 1
                time.sleep(0.001)  # leaves the 2-core CI boxes some air
        except BaseException as exc:  # noqa: BLE001 - reported by main
            self.error = exc


@dataclass
class Ops:
    """The operations of each phase; counts what they sent, for the final checks."""

    client: layertap.Client
    x: np.ndarray
    active_passes: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    durable_id: str = ""

    def _count(self, outcome: str, active_passes: int = 0) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            self.active_passes += active_passes

    def capture(self, i: int) -> None:
        c, x, layer = self.client, self.x, LAYERS[i % len(LAYERS)]
        if i % 100 == 37:
            try:  # a passive capture whose deadline expires while its hooks wait
                c.capture(layer, timeout=0.002)
                self._count("capture_passive")
            except DeadlineExceeded:
                self._count("capture_deadline")
            return
        if i % 100 == 71:
            try:
                c.capture("layer9", input=x)
                raise AssertionError("layer9 does not exist")
            except LayerNotFound:
                self._count("capture_unknown_layer")
            return
        kind = i % 4
        if kind == 0:  # passive, from the feeder's traffic
            out = c.capture(layer, n=2 if i % 40 == 0 else 1)
            assert all(a.shape[0] == x.shape[0] for a in arrays(out))
            self._count("capture_passive")
        elif kind == 1:
            out = c.capture(layer, input=x)
            assert all(a.shape[0] == x.shape[0] and a.dtype == np.float32 for a in arrays(out))
            self._count("capture_active", 1)
        elif kind == 2:
            half = i % 8 == 2
            d = c.capture(["layer1", "layer4", "fc"], input=x, dtype="float16" if half else None)
            assert list(d) == ["layer1", "layer4", "fc"] and d["fc"].shape == (x.shape[0], 10)
            assert d["fc"].dtype == (np.float16 if half else np.float32)
            self._count("capture_active_multi", 1)
        else:
            out = c.capture(layer, input=x, max_batch=1, point="input" if i % 8 == 3 else "output")
            assert all(a.shape[0] == 1 for a in arrays(out))
            self._count("capture_active_max_batch", 1)

    def stream(self, i: int) -> None:
        c = self.client
        kind = i % 3
        if kind == 0:
            with c.watch(LAYERS[i % len(LAYERS)], reducers=["moments", "nonfinite"], timeout=60) as s:
                summary = next(s)
                assert summary.results
            self._count("stream_read")
        elif kind == 1:  # closed before the first message: the tap must still go
            s = c.watch("layer*", reducers=["histogram"], every=2, timeout=60)
            s.close()
            self._count("stream_closed_unread")
        else:
            with c.subscribe([self.durable_id], timeout=60) as s:
                next(s)
            self._count("stream_durable")

    def tap(self, i: int) -> None:
        c = self.client
        selectors = ["layer1", "layer2.*", "layer*", "re:layer[34]\\.0\\.conv\\d", "**.relu", "fc"]
        reducers: list[Any] = [["moments"], ["minmax", "abs_max"], [{"histogram": {"bins": 16, "min": -4, "max": 4}}],
                                  [{"quantiles": {"probabilities": [0.5, 0.9]}}], ["per_channel", "norm"]]
        selector, red = selectors[i % len(selectors)], reducers[i % len(reducers)]
        if i % 25 == 24:
            try:
                c.create_tap("nosuchlayer*", ttl=60)
                raise AssertionError("the selector matches nothing")
            except LayerNotFound:
                self._count("tap_rejected")
        elif i % 10 == 3:
            with c.tap(selector, reducers=red, ttl=60, name=f"soak-{i}") as t:
                assert t.refresh().layers
            self._count("tap_with_block")
        else:
            info = c.create_tap(selector, reducers=red, every=1 + i % 3, ttl=60)
            assert info.layers
            if i % 7 == 0:
                time.sleep(0.02)  # let a few passes run its reducers
            c.delete_tap(info.id)
            self._count("tap_created_deleted")


def run_phase(name: str, total: int, op: Callable[[int], None], workers: int, progress: Progress,
              sampler: Sampler, feeder: Feeder) -> float:
    """Runs ``op(0..total-1)`` on ``workers`` threads; returns the wall time."""
    with progress.lock:
        progress.phase, progress.done = name, 0
    sampler.take()
    t0 = time.perf_counter()
    next_i = iter(range(total))
    lock = threading.Lock()
    every = max(1, total // 100)  # short phases get samples too, not just timer ticks

    def worker() -> None:
        while True:
            with lock:
                i = next(next_i, None)
            if i is None or feeder.error is not None:
                return
            op(i)
            if progress.tick() % every == 0:
                sampler.take()

    with futures.ThreadPoolExecutor(workers) as pool:
        for f in [pool.submit(worker) for _ in range(workers)]:
            f.result()
    if feeder.error is not None:
        raise RuntimeError("the Infer feeder failed") from feeder.error
    wall = time.perf_counter() - t0
    sampler.take()
    return wall


def report_phase(name: str, total: int, wall: float, samples: list[Sample]) -> bool:
    """Prints one phase's figures; returns whether its RSS stayed within FLAT after warm-up."""
    mine = [s for s in samples if s.phase == name]
    after = [s for s in mine if s.done >= WARMUP * total] or mine[-1:]
    ref = after[0].rss_kib
    rss = [s.rss_kib for s in after]
    spread = (max(rss) - min(rss)) / ref
    slope = 0.0
    if len(after) > 2 and after[-1].done > after[0].done:
        xs, ys = [s.done for s in after], rss
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / sum((a - mx) ** 2 for a in xs) * 1000
    flat = all(abs(r - ref) <= FLAT * ref for r in rss)

    def mib(kib: int) -> float:
        return kib / 1024

    print(f"{name:9s} {total:6d} ops in {wall:7.1f} s = {total / wall:7.1f} ops/s | RSS MiB: start "
          f"{mib(mine[0].rss_kib):6.1f}, after warm-up {mib(ref):6.1f}, min {mib(min(rss)):6.1f}, "
          f"max {mib(max(rss)):6.1f}, final {mib(rss[-1]):6.1f} | spread {spread:5.1%}, "
          f"slope {slope:+.1f} KiB/1000 ops, {len(after)} samples | {'flat' if flat else 'NOT FLAT'}")
    return flat


def wait_idle(client: layertap.Client, seconds: float = 10.0) -> layertap.ServerStats:
    """Stats once the server has processed the last cancellations (or after ``seconds``)."""
    deadline = time.monotonic() + seconds
    while True:
        st = client.stats()
        busy = (st.active_hooks, st.taps, st.active_captures, st.subscribers) != (0, 0, 0, 0)
        if not busy or time.monotonic() > deadline:
            return st
        time.sleep(0.1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--captures", type=int, default=10_000)
    ap.add_argument("--streams", type=int, default=1_000)
    ap.add_argument("--taps", type=int, default=5_000, help="durable tap create/delete cycles")
    ap.add_argument("--quick", action="store_true", help="500 captures, 100 streams, 300 taps")
    ap.add_argument("--workers", type=int, default=3, help="client threads per phase (plus the Infer feeder)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between RSS samples")
    ap.add_argument("--csv", help="write every RSS sample to this file")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra `layertap serve` argument, e.g. --server-arg=--workers=16 (repeatable)")
    args = ap.parse_args()
    if args.quick:
        args.captures, args.streams, args.taps = 500, 100, 300

    server = ServerProcess(args.server_arg)
    progress = Progress()
    sampler = Sampler(server, progress, args.interval)
    ok = True
    try:
        target = f"127.0.0.1:{server.port}"
        client, feed_client = layertap.Client(target), layertap.Client(target)
        x = np.random.default_rng(0).standard_normal((args.batch, 3, 32, 32)).astype(np.float32)
        idle = wait_idle(client)
        print(f"server pid {server.proc.pid} on {target}; {server.threads()} threads, RSS "
              f"{server.rss_kib() / 1024:.1f} MiB at start; idle hooks {idle.active_hooks}, passes {idle.passes}")
        print(f"phases: {args.captures} captures, {args.streams} streams, {args.taps} taps; "
              f"{args.workers} client threads + 1 Infer feeder; batch {args.batch}; cpus {os.cpu_count()}")
        warm_passes = warm_compile(server, client, x, "--no-compile" not in args.server_arg)
        feeder = Feeder(feed_client, x)
        ops = Ops(client, x)
        sampler.start()
        feeder.start()
        t_start = time.perf_counter()
        walls = {"captures": run_phase("captures", args.captures, ops.capture, args.workers, progress, sampler, feeder)}
        ops.durable_id = client.create_tap("layer2", reducers=["moments"], ttl=3600).id
        walls["streams"] = run_phase("streams", args.streams, ops.stream, args.workers, progress, sampler, feeder)
        client.delete_tap(ops.durable_id)
        walls["taps"] = run_phase("taps", args.taps, ops.tap, args.workers, progress, sampler, feeder)
        feeder.halt.set()
        feeder.join()
        total_wall = time.perf_counter() - t_start
        sampler.halt.set()
        sampler.join()
        final = wait_idle(client)
        time.sleep(1.0)
        last = sampler.take()

        print()
        totals = {"captures": args.captures, "streams": args.streams, "taps": args.taps}
        for name, wall in walls.items():
            ok &= report_phase(name, totals[name], wall, sampler.samples)
        warm = next(s for s in sampler.samples if s.phase == "captures" and s.done >= WARMUP * args.captures)
        post = [s.rss_kib for s in sampler.samples if s.t >= warm.t]
        overall_flat = max(post) <= (1 + FLAT) * warm.rss_kib and min(post) >= (1 - FLAT) * warm.rss_kib
        print(f"overall: {total_wall:.1f} s, {len(sampler.samples)} RSS samples, "
              f"{len(sampler.scrapes)} /metrics scrapes, {feeder.count} feeder Infers "
              f"({feeder.count / total_wall:.1f}/s); RSS MiB after capture warm-up "
              f"{warm.rss_kib / 1024:.1f}, max {max(post) / 1024:.1f}, min {min(post) / 1024:.1f}, final "
              f"{last.rss_kib / 1024:.1f} ({(last.rss_kib - warm.rss_kib) / warm.rss_kib:+.1%}) | "
              f"{'flat' if overall_flat else 'NOT FLAT'} within {FLAT:.0%}")
        ok &= overall_flat
        sizes: dict[str, list[int]] = {}
        for phase, size in sampler.scrapes:
            sizes.setdefault(phase, []).append(size)
        print("/metrics bytes per phase (first..last): "
              + ", ".join(f"{k} {v[0]}..{v[-1]}" for k, v in sizes.items()) + f", end {server.scrape()}")
        print("outcomes: " + ", ".join(f"{k}={v}" for k, v in sorted(ops.outcomes.items())))

        expected_passes = idle.passes + warm_passes + feeder.count + ops.active_passes
        left = client.taps()
        checks = {
            "active_hooks == 0": final.active_hooks == 0,
            "no taps left (ListTaps)": not left,
            "stats.taps == 0": final.taps == 0,
            "active_captures == 0": final.active_captures == 0,
            "subscribers == 0": final.subscribers == 0,
            "reducer_errors == 0": final.reducer_errors == 0,
            f"passes == {expected_passes} (idle + Infers + active captures)": final.passes == expected_passes,
        }
        print(f"final stats: {final}; server threads {server.threads()}")
        for what, passed in checks.items():
            print(f"  [{'ok' if passed else 'FAIL'}] {what}")
        ok &= all(checks.values())
        if left:
            print("  taps left: " + ", ".join(f"{t.id} {t.kind} {t.layers}" for t in left))
        if args.csv:
            with open(args.csv, "w") as f:
                f.write("t,phase,done,rss_kib\n")
                for s in sampler.samples:
                    f.write(f"{s.t - sampler.samples[0].t:.3f},{s.phase},{s.done},{s.rss_kib}\n")
        client.close()
        feed_client.close()
    finally:
        sampler.halt.set()
        server.stop()
    print("soak:", "PASS" if ok else "FAIL", f"(server log: {server.log.name})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
