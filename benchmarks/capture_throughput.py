"""Capture throughput over loopback, next to raw gRPC byte streaming, same run.

Both servers run in their own processes (so client and server do not share a
GIL): a bare gRPC server that streams 1 MiB ``bytes`` chunks, and
``layertap serve`` hosting an identity model. Runs alternate (A B A B ...);
the script prints medians in MB/s and their ratio.

The capture is passive: a second client's ``Infer`` supplies the tensor, and
the time counted runs from the capture's first header to its last byte (the
client's ``progress`` callback), so the upload of the input is not counted.

    python benchmarks/capture_throughput.py --mib 128 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import numpy as np

import layertap

CHUNK = 1 << 20
_SERVICE = "bench.Raw"
HERE = os.path.dirname(os.path.abspath(__file__))


def serve_raw(total: int) -> None:
    """Child process: a bare gRPC server streaming ``total`` bytes in 1 MiB chunks."""
    payload = np.random.default_rng(0).bytes(total)

    def stream(_req: bytes, _ctx: grpc.ServicerContext):  # type: ignore[no-untyped-def]
        view = memoryview(payload)
        for off in range(0, total, CHUNK):
            yield bytes(view[off : off + CHUNK])

    handler = grpc.method_handlers_generic_handler(_SERVICE, {
        "Stream": grpc.unary_stream_rpc_method_handler(stream)
    })
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"port {port}", flush=True)
    server.wait_for_termination()


def identity():  # type: ignore[no-untyped-def]
    """``--model capture_throughput:identity``: layer ``0`` passes the input
    through (the captured tensor); the model's output is a small row sum, so
    the Infer response does not compete with the capture stream."""
    import torch

    class RowSum(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum(dim=1)

    return torch.nn.Sequential(torch.nn.Identity(), RowSum())


def spawn(cmd: list[str], pattern: str) -> tuple[subprocess.Popen[str], int]:
    env = {**os.environ, "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        if m := re.search(pattern, line):
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, int(m.group(1))
    raise RuntimeError(f"{cmd} did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--raw-server", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.raw_server:
        serve_raw(args.raw_server)
        return
    total = args.mib * CHUNK
    raw_proc, raw_port = spawn([sys.executable, __file__, "--raw-server", str(total)], r"port (\d+)")
    cap = str(total + CHUNK)
    lt_proc, lt_port = spawn([sys.executable, "-m", "layertap.cli", "serve", "--port", "0", "--no-metrics",
                              "--model", "capture_throughput:identity", "--input-shape=-1,1024",
                              "--max-capture-bytes", cap, "--max-request-bytes", cap], r"serving on [^\s]+:(\d+)")
    try:
        raw_channel = grpc.insecure_channel(f"127.0.0.1:{raw_port}")
        raw_call = raw_channel.unary_stream(f"/{_SERVICE}/Stream")
        x = np.random.default_rng(1).standard_normal((total // 4096, 1024)).astype(np.float32)
        feeder = layertap.Client(f"127.0.0.1:{lt_port}", max_message_bytes=total + (8 << 20))
        client = layertap.Client(f"127.0.0.1:{lt_port}")

        def capture() -> float:
            marks: list[float] = []
            got: list = []

            def progress(done: int, _total: int) -> None:
                marks.append(time.perf_counter())

            t = threading.Thread(target=lambda: got.append(client.capture("0", timeout=120, progress=progress)))
            t.start()
            while client.stats().active_hooks == 0:
                time.sleep(0.01)
            feeder.infer(x, timeout=120)
            t.join()
            assert got[0].nbytes == total
            return marks[-1] - marks[0]

        def raw() -> float:
            t0 = time.perf_counter()
            n = sum(len(c) for c in raw_call(b"", timeout=120))
            assert n == total
            return time.perf_counter() - t0

        def raw_into_array() -> float:
            # The same stream, written into a fresh array as a client must:
            # shows what the destination buffer's first touch costs here.
            t0 = time.perf_counter()
            buf = np.empty(total, np.uint8)
            off = 0
            for c in raw_call(b"", timeout=120):
                buf[off : off + len(c)] = np.frombuffer(c, np.uint8)
                off += len(c)
            assert off == total
            return time.perf_counter() - t0

        raw(), raw_into_array(), capture()  # warm up
        times: dict[str, list[float]] = {"raw": [], "raw_array": [], "capture": []}
        for _ in range(args.repeats):
            times["raw"].append(raw())
            times["raw_array"].append(raw_into_array())
            times["capture"].append(capture())
        mbs = {k: total / 1e6 / statistics.median(v) for k, v in times.items()}
        spread = {k: (total / 1e6 / max(v), total / 1e6 / min(v)) for k, v in times.items()}
        print(f"tensor {args.mib} MiB float32, {args.repeats} interleaved repeats (median, [min..max] MB/s):")
        print(f"  raw gRPC 1 MiB bytes stream : {mbs['raw']:7.0f}  [{spread['raw'][0]:.0f}..{spread['raw'][1]:.0f}]")
        print(f"  raw stream into a new array : {mbs['raw_array']:7.0f}  [{spread['raw_array'][0]:.0f}..{spread['raw_array'][1]:.0f}]")
        print(f"  layertap capture stream     : {mbs['capture']:7.0f}  [{spread['capture'][0]:.0f}..{spread['capture'][1]:.0f}]")
        print(f"  capture / raw               : {mbs['capture'] / mbs['raw']:.2f}")
        print(f"  capture / raw into array    : {mbs['capture'] / mbs['raw_array']:.2f}")
        client.close()
        feeder.close()
    finally:
        raw_proc.terminate()
        lt_proc.terminate()


if __name__ == "__main__":
    main()
