"""Infer latency under wide subscribers, with the overhead budget on and off (issue 43's figure).

``layertap serve`` (demo model) runs as a subprocess, once with ``--tap-budget
0.05`` and once with ``--tap-budget 0``. On each, batch-1 Infer calls from one
client give p50 and p95 idle, then with 1, 5 and 30 subscribers whose stream
taps cover every layer (``**``: moments, histogram, per_channel). The
subscribers live in another process, as real clients do, and either never read
or read as fast as messages come. Each row prints its p50 and p95 against the
same server's idle figures, measured right before and right after the row
(their pooled calls), the summaries each subscriber got (min over
subscribers) and the strides the budget set (``Summary.throttle``).

    python benchmarks/overhead_budget.py --requests 200
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # serve's start-up reader lives with the tests
from support.serve import read_startup

SUBSCRIBERS = textwrap.dedent('''
    import json, sys, threading, grpc
    from layertap.v1 import telemetry_pb2 as pb, telemetry_pb2_grpc
    port, n, read = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "read"
    spec = pb.TapSpec(selector="**", reducers=[pb.ReducerSpec(kind=k) for k in (
        pb.REDUCER_KIND_MOMENTS, pb.REDUCER_KIND_HISTOGRAM, pb.REDUCER_KIND_PER_CHANNEL)])
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.http2.bdp_probe", 0)]) for _ in range(n)]
    calls = [telemetry_pb2_grpc.TelemetryServiceStub(ch).Subscribe(pb.SubscribeRequest(stream_taps=[spec]))
             for ch in channels]
    got, sampled, strides = [0] * n, [0] * n, {}
    def drain(i):
        try:
            for msg in calls[i]:
                for s in msg.summaries:
                    got[i] += 1
                    sampled[i] += not s.unsampled
                    strides[max(1, s.throttle)] = strides.get(max(1, s.throttle), 0) + 1
        except grpc.RpcError:
            pass
    for call in calls:
        next(call)  # open: its stream tap exists
    if read:
        for i in range(n):
            threading.Thread(target=drain, args=(i,), daemon=True).start()
    print("open", flush=True)
    sys.stdin.readline()
    for call in calls:
        call.cancel()
    print(json.dumps({"got": got, "sampled": sampled, "strides": strides}), flush=True)
''')


def start_server(budget: float) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-m", "layertap.cli", "serve", "--port", "0", "--no-compile",
                             "--tap-budget", str(budget)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    assert proc.stdout is not None
    port, _ = read_startup(proc.stdout)
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    return proc, port


def latencies(port: int, n: int) -> np.ndarray:
    from layertap import Client

    x = np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32)
    out = []
    with Client(f"127.0.0.1:{port}") as c:
        for _ in range(10):
            c.infer(x, timeout=60)
        for _ in range(n):
            t0 = time.perf_counter()
            c.infer(x, timeout=60)
            out.append(time.perf_counter() - t0)
    return np.array(out) * 1e3


def with_subscribers(port: int, n: int, mode: str, requests: int, settle: float) -> tuple[np.ndarray, dict]:
    proc = subprocess.Popen([sys.executable, "-c", SUBSCRIBERS, str(port), str(n), mode],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    assert proc.stdout.readline().strip() == "open"
    from layertap import Client

    x = np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32)
    with Client(f"127.0.0.1:{port}") as c:  # the governor's first windows: over the budget, then thinned
        end = time.monotonic() + settle
        while time.monotonic() < end:
            c.infer(x, timeout=60)
    ms = latencies(port, requests)
    proc.stdin.write("\n")
    proc.stdin.flush()
    report = json.loads(proc.stdout.readline())
    proc.wait(30)
    time.sleep(1.0)  # its stream taps go
    return ms, report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=200, help="timed Infer calls per row")
    p.add_argument("--settle", type=float, default=5.0, help="seconds of Infer before each row is timed")
    p.add_argument("--counts", default="1,5,30")
    p.add_argument("--budgets", default="0.05,0")
    args = p.parse_args()
    print(f"# {platform.processor() or platform.machine()}, {platform.python_version()}")
    print("| budget | subscribers | reading | idle p50 / p95 ms | Infer p50 ms | p95 ms | p50 vs idle | p95 vs idle | "
          "summaries (min per subscriber) | sampled (min) | strides seen |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for budget in (float(b) for b in args.budgets.split(",")):
        proc, port = start_server(budget)
        try:
            after = latencies(port, args.requests)
            for n in (int(c) for c in args.counts.split(",")):
                for mode in ("never", "read"):
                    before = after
                    ms, rep = with_subscribers(port, n, mode, args.requests, args.settle)
                    after = latencies(port, args.requests)
                    idle = np.concatenate([before, after])
                    p50, p95 = np.percentile(idle, 50), np.percentile(idle, 95)
                    q50, q95 = np.percentile(ms, 50), np.percentile(ms, 95)
                    strides = ", ".join(f"{k}: {v}" for k, v in sorted(rep["strides"].items(), key=lambda kv:
                                                                       int(kv[0])))
                    got = f"{min(rep['got'])}" if mode == "read" else "(not read)"
                    sampled = f"{min(rep['sampled'])}" if mode == "read" else ""
                    print(f"| {budget:g} | {n} | {mode} | {p50:.2f} / {p95:.2f} | {q50:.2f} | {q95:.2f} | {q50 / p50:.2f} "
                          f"| {q95 / p95:.2f} "
                          f"| {got} | {sampled} | {strides} |", flush=True)
        finally:
            proc.terminate()
            proc.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
