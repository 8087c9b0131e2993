"""Capture throughput over loopback, next to raw gRPC byte streaming, same run.

Servers run in their own processes (so client and server do not share a
GIL): a bare gRPC server, and ``layertap serve`` hosting a model whose layer
``0`` widens a small (rows, 1) input to the (rows, 1024) float32 tensor that
is captured, so uploading the input costs next to nothing. Variants run
interleaved for ``--repeats`` rounds; the script prints medians in MB/s,
their spread and the ratios, and the CPU time each variant cost the server
and the client process per run (wall times on a shared 2-vCPU VM swing;
CPU time per byte is what a busy server pays).

Rows:
  raw            the bare server streams 1 MiB ``bytes`` messages; the client sums their lengths
  raw array      the same stream, written into a fresh numpy array as a client must (the
                 destination's first touch is what separates the two)
  protobuf path  the bare server streams CaptureResponse chunks built by protobuf, the client
                 parses them with the generated parser and copies ``data`` into a fresh array:
                 the wire path of captures before issue 10, on the same machine, same run
  active         ``client.capture(input=x)``, timed from its first header to its last byte
                 (the client's ``progress`` callback): the capture transport
  passive        a passive capture fed by another client's ``Infer``, timed the same way
  active - infer an active capture end to end minus an ``Infer`` of the same input: the
                 server's clone of the tensor in its hook plus the transport (issue 10's measure)

    python benchmarks/capture_throughput.py --mib 48 --repeats 7
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures

import grpc
import numpy as np

import layertap
from layertap.v1 import telemetry_pb2 as pb

CHUNK = 1 << 20
_SERVICE = "bench.Raw"
HERE = os.path.dirname(os.path.abspath(__file__))


def serve_raw(total: int) -> None:
    """Child process: a bare gRPC server streaming ``total`` bytes in 1 MiB chunks, two ways."""
    payload = np.random.default_rng(0).bytes(total)

    def stream(_req: bytes, _ctx: grpc.ServicerContext):  # type: ignore[no-untyped-def]
        view = memoryview(payload)
        for off in range(0, total, CHUNK):
            yield bytes(view[off : off + CHUNK])

    def protobuf_chunks(_req: bytes, _ctx: grpc.ServicerContext):  # type: ignore[no-untyped-def]
        # How captures built chunks before issue 10: a slice copied out, set on a message, serialized.
        view = memoryview(payload)
        for i, off in enumerate(range(0, total, CHUNK)):
            msg = pb.CaptureResponse()
            msg.chunk.tensor_id, msg.chunk.chunk_index, msg.chunk.offset = 0, i, off
            msg.chunk.data = view[off : off + CHUNK].tobytes()
            yield msg

    handler = grpc.method_handlers_generic_handler(_SERVICE, {
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
        "Protobuf": grpc.unary_stream_rpc_method_handler(
            protobuf_chunks, response_serializer=pb.CaptureResponse.SerializeToString),
    })
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"port {port}", flush=True)
    server.wait_for_termination()


def fanout():  # type: ignore[no-untyped-def]
    """``--model capture_throughput:fanout``: layer ``0`` widens a (rows, 1)
    input to (rows, 1024), the captured tensor; the model's output is a small
    row sum, so neither the upload nor the Infer response competes with the
    capture stream."""
    import torch

    class Widen(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.expand(-1, 1024) + 0.5  # a new (rows, 1024) tensor

    class RowSum(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum(dim=1)

    return torch.nn.Sequential(Widen(), RowSum())


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU time of process ``pid`` (this one when None), all threads."""
    if pid is None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spawn(cmd: list[str], pattern: str) -> tuple[subprocess.Popen[str], int]:
    env = {**os.environ, "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        if m := re.search(pattern, line):
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, int(m.group(1))
    raise RuntimeError(f"{cmd} did not start")


class Bench:
    """The variants, each returning the seconds it took to move ``total`` bytes."""

    def __init__(self, total: int, raw_port: int, lt_port: int) -> None:
        self.total = total
        raw_channel = grpc.insecure_channel(f"127.0.0.1:{raw_port}")
        self.raw_call = raw_channel.unary_stream(f"/{_SERVICE}/Stream")
        self.proto_call = raw_channel.unary_stream(f"/{_SERVICE}/Protobuf",
                                                   response_deserializer=pb.CaptureResponse.FromString)
        self.x = np.random.default_rng(1).standard_normal((total // 4096, 1)).astype(np.float32)
        self.feeder = layertap.Client(f"127.0.0.1:{lt_port}")
        self.client = layertap.Client(f"127.0.0.1:{lt_port}")

    def close(self) -> None:
        self.client.close()
        self.feeder.close()

    def raw(self) -> float:
        t0 = time.perf_counter()
        n = sum(len(c) for c in self.raw_call(b"", timeout=120))
        assert n == self.total
        return time.perf_counter() - t0

    def raw_array(self) -> float:
        t0 = time.perf_counter()
        buf = np.empty(self.total, np.uint8)
        off = 0
        for c in self.raw_call(b"", timeout=120):
            buf[off : off + len(c)] = np.frombuffer(c, np.uint8)
            off += len(c)
        assert off == self.total
        return time.perf_counter() - t0

    def protobuf_path(self) -> float:
        t0 = time.perf_counter()
        buf = np.empty(self.total, np.uint8)
        for msg in self.proto_call(b"", timeout=120):
            data = msg.chunk.data  # each read copies out of the message
            buf[msg.chunk.offset : msg.chunk.offset + len(data)] = np.frombuffer(data, np.uint8)
        return time.perf_counter() - t0

    def _timed_capture(self, run: Callable[[Callable[[int, int], None]], object]) -> float:
        marks: list[float] = []
        got = run(lambda _done, _total: marks.append(time.perf_counter()))
        assert getattr(got, "nbytes", 0) == self.total
        return marks[-1] - marks[0]

    def active(self) -> float:
        return self._timed_capture(lambda progress: self.client.capture("0", input=self.x, timeout=120,
                                                                        progress=progress))

    def passive(self) -> float:
        got: list[object] = []

        def run(progress: Callable[[int, int], None]) -> object:
            t = threading.Thread(target=lambda: got.append(self.client.capture("0", timeout=120, progress=progress)))
            t.start()
            while self.client.stats().active_hooks == 0:
                time.sleep(0.01)
            self.feeder.infer(self.x, timeout=120)
            t.join()
            return got[0]

        return self._timed_capture(run)

    def active_whole(self) -> float:
        t0 = time.perf_counter()
        assert self.client.capture("0", input=self.x, timeout=120).nbytes == self.total
        return time.perf_counter() - t0

    def infer(self) -> float:
        t0 = time.perf_counter()
        self.client.infer(self.x, timeout=120)
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--raw-server", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.raw_server:
        serve_raw(args.raw_server)
        return
    total = args.mib * CHUNK
    raw_proc, raw_port = spawn([sys.executable, __file__, "--raw-server", str(total)], r"port (\d+)")
    cap = str(total + CHUNK)
    lt_proc, lt_port = spawn([sys.executable, "-m", "layertap.cli", "serve", "--port", "0", "--no-metrics",
                              "--model", "capture_throughput:fanout", "--input-shape=-1,1",
                              "--max-capture-bytes", cap, "--max-request-bytes", cap], r"serving on [^\s]+:(\d+)")
    try:
        bench = Bench(total, raw_port, lt_port)
        variants = {"raw": bench.raw, "raw array": bench.raw_array, "protobuf path": bench.protobuf_path,
                    "active": bench.active, "passive": bench.passive, "active whole": bench.active_whole,
                    "infer": bench.infer}
        for run in variants.values():  # warm up
            run()
        times: dict[str, list[float]] = {k: [] for k in variants}
        cpu: dict[str, list[float]] = {k: [0.0, 0.0] for k in variants}
        for _ in range(args.repeats):
            for name, run in variants.items():
                pid = raw_proc.pid if name in ("raw", "raw array", "protobuf path") else lt_proc.pid
                server0, client0 = cpu_seconds(pid), cpu_seconds()
                times[name].append(run())
                cpu[name][0] += cpu_seconds(pid) - server0
                cpu[name][1] += cpu_seconds() - client0
        bench.close()
    finally:
        raw_proc.terminate()
        lt_proc.terminate()

    def mbs(seconds: float) -> float:
        return total / 1e6 / seconds

    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"tensor {args.mib} MiB float32, {args.repeats} interleaved rounds, {platform.machine()} "
          f"{os.cpu_count()} CPUs (median MB/s [slowest..fastest]; ratios: median of per-round ratios [min..max]):")
    for name in ("raw", "raw array", "protobuf path", "active", "passive"):
        print(f"  {name:15s}: {mbs(median[name]):7.0f}  [{mbs(max(times[name])):.0f}..{mbs(min(times[name])):.0f}]")
    print("CPU ms per run (server process, client process; whole calls, so active and passive include the pass):")
    for name, (server, client) in cpu.items():
        print(f"  {name:15s}: {server / args.repeats * 1e3:6.1f}  {client / args.repeats * 1e3:6.1f}")
    extra = median["active whole"] - median["infer"]
    print(f"  active - infer : {mbs(extra):7.0f}  ({median['active whole'] * 1e3:.0f} ms - "
          f"{median['infer'] * 1e3:.0f} ms)")
    # A ratio per round (the runs next to each other), then their median and spread.
    for name in ("active", "passive", "protobuf path"):
        for base in ("raw", "raw array"):
            ratios = sorted(b / v for b, v in zip(times[base], times[name]))
            print(f"  {name + ' / ' + base:26s}: {statistics.median(ratios):.2f}  [{ratios[0]:.2f}..{ratios[-1]:.2f}]")


if __name__ == "__main__":
    main()
