"""Server RSS under never-reading wide subscribers, and after they leave.

Starts ``layertap serve`` (demo model) as a subprocess, drives inference from
a few threads, opens N Subscribe streams whose stream taps cover every layer
(``**``, reducers moments, histogram and per_channel) and never reads them,
then cancels them. Prints the server's RSS over time, its budget metrics, and
whether a Health.Check on a fresh channel still answers. The figures in
docs/benchmarks.md ("session 9: memory budgets") come from this script.

    python benchmarks/wide_subscribers.py --subscribers 30 --seconds 60
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from layertap.v1 import telemetry_pb2 as pb
from layertap.v1 import telemetry_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # serve's start-up reader lives with the tests
from support.serve import read_startup

WIDE = [pb.REDUCER_KIND_MOMENTS, pb.REDUCER_KIND_HISTOGRAM, pb.REDUCER_KIND_PER_CHANNEL]


def rss_mib(pid: int) -> float:
    """Resident set size of ``pid`` in MiB, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def rss_parts(pid: int) -> dict[str, float]:
    """Resident MiB of ``pid`` by kind of mapping, from /proc/PID/smaps.

    ``heap``: glibc's main arena (``[heap]``); ``arenas``: glibc's thread
    arenas (anonymous mappings inside 64 MiB-aligned reservations);
    ``pymalloc``: anonymous mappings of exactly 1 MiB (CPython's object
    arenas); ``stacks``: 8 MiB ones (threads' stacks); ``anon``: other anonymous memory (large ``mmap`` blocks: tensors,
    big buffers); ``files``: mapped files (libraries).
    """
    parts = dict.fromkeys(("heap", "arenas", "pymalloc", "stacks", "anon", "files"), 0.0)
    kind = "files"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                start, end = (int(x, 16) for x in head[0].split("-"))
                name = head[5] if len(head) > 5 else ""
                if name == "[heap]":
                    kind = "heap"
                elif name:
                    kind = "files"  # libraries; [stack] and [vdso] are small
                elif start % (64 << 20) == 0:  # a thread arena's heap starts 64 MiB-aligned
                    kind = "arenas"
                elif end - start == 1 << 20:
                    kind = "pymalloc"
                elif abs((end - start) - (8 << 20)) <= 64 << 10:  # a thread stack (ulimit -s 8 MiB, less its guard page)
                    kind = "stacks"
                else:
                    kind = "anon"
            elif head[0] == "Rss:":
                parts[kind] += int(head[1]) / 1024
    return parts


def parts_line(pid: int) -> str:
    with open(f"/proc/{pid}/status") as f:
        threads = next(line.split()[1] for line in f if line.startswith("Threads:"))
    return " ".join(f"{k}={v:.0f}" for k, v in rss_parts(pid).items()) + f" threads={threads}"


def start_server(extra: list[str]) -> tuple[subprocess.Popen[str], int, int | None]:
    """``layertap serve --port 0``; returns the process, its gRPC and metrics ports."""
    proc = subprocess.Popen([sys.executable, "-m", "layertap.cli", "serve", "--port", "0", "--metrics-port", "0",
                             "--no-compile", *extra], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    port, mport = read_startup(proc.stdout)
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    return proc, port, mport


def scrape(port: int, prefix: str = "layertap_") -> dict[str, float]:
    """The server's ``/metrics`` samples whose names start with ``prefix``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith(prefix)}


def wide_request() -> pb.SubscribeRequest:
    """One stream tap on every layer with the reducers of the hostile campaign."""
    spec = pb.TapSpec(selector="**", reducers=[pb.ReducerSpec(kind=k) for k in WIDE])
    return pb.SubscribeRequest(stream_taps=[spec])


def infer_loop(port: int, stop: threading.Event, batch: int) -> None:
    """Infer in a loop until ``stop``: the passes the taps summarise."""
    from layertap import Client

    x = np.random.default_rng(0).standard_normal((batch, 3, 32, 32)).astype(np.float32)
    with Client(f"127.0.0.1:{port}") as c:
        while not stop.is_set():
            try:
                c.infer(x, timeout=10)
            except Exception:  # noqa: BLE001 - a refused call is part of the load
                time.sleep(0.01)


def health_check(port: int, timeout: float = 5.0) -> str:
    """A Health.Check on a channel of its own: the status name, or the error."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        except grpc.RpcError as exc:
            return f"{exc.code().name}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--subscribers", type=int, default=30)
    p.add_argument("--seconds", type=float, default=60.0, help="how long the subscribers stay")
    p.add_argument("--after", type=float, default=10.0, help="seconds to watch RSS after they cancel")
    p.add_argument("--drivers", type=int, default=2, help="inference threads")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--metrics", default="budget|dropped|held", help="regex of metric names to print")
    p.add_argument("serve_args", nargs="*", help="extra `layertap serve` flags (after --)")
    args = p.parse_args()
    proc, port, mport = start_server(args.serve_args)
    try:
        stop = threading.Event()
        drivers = [threading.Thread(target=infer_loop, args=(port, stop, args.batch), daemon=True)
                   for _ in range(args.drivers)]
        for t in drivers:
            t.start()
        time.sleep(3)
        before = rss_mib(proc.pid)
        print(f"rss before subscribers: {before:.0f} MiB ({parts_line(proc.pid)})", flush=True)
        channels = [grpc.insecure_channel(f"127.0.0.1:{port}") for _ in range(args.subscribers)]
        calls = [telemetry_pb2_grpc.TelemetryServiceStub(ch).Subscribe(wide_request()) for ch in channels]
        start = time.monotonic()
        peak = before
        while time.monotonic() - start < args.seconds:
            time.sleep(min(5.0, args.seconds))
            now = rss_mib(proc.pid)
            peak = max(peak, now)
            print(f"t={time.monotonic() - start:5.1f}s rss={now:.0f} MiB ({parts_line(proc.pid)})", flush=True)
        if mport is not None:
            for k, v in sorted(scrape(mport).items()):
                if re.search(args.metrics, k):
                    print(f"  {k} {v:.0f}")
        for call in calls:
            call.cancel()
        for ch in channels:
            ch.close()
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.after:
            time.sleep(min(2.0, args.after))
            m = scrape(mport) if mport is not None else {}
            print(f"after cancel t={time.monotonic() - t0:4.1f}s rss={rss_mib(proc.pid):.0f} MiB "
                  f"({parts_line(proc.pid)}) taps={m.get('layertap_taps', -1):.0f} "
                  f"subscribers={m.get('layertap_subscribers', -1):.0f} "
                  f"transfer_passes={m.get('layertap_transfer_passes_total', -1):.0f}", flush=True)
        after = rss_mib(proc.pid)
        print(f"health check (new channel): {health_check(port)}")
        stop.set()
        print(f"SUMMARY before={before:.0f} peak={peak:.0f} after={after:.0f} MiB "
              f"(after/before {after / before:.2f})")
    finally:
        proc.terminate()
        proc.wait(15)
    return 0


if __name__ == "__main__":
    sys.exit(main())
