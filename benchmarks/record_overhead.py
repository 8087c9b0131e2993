"""Flight-recorder cost: Infer latency with recording on (no trigger firing) vs off, same run.

One ``layertap serve`` subprocess hosts the demo model with ``--incident-dir``
and ``--record-inputs 64`` and one durable tap (basic reducers on the 14
block-level modules). Rounds alternate (off, on, on, off, ...) by re-creating
that tap: "off" without triggers (the recorder installs nothing), "on" with a
nonfinite trigger, so every pass pins its input until its summaries are
evaluated. Inputs are finite, so no trigger fires. One process for both, so
the comparison is not skewed by where two processes landed on the cores. For
the demo input (batch 32) and a 32 MB input (batch 2731), the script prints
the ratio of median latencies with the spread of the per-round ratios.

    python benchmarks/record_overhead.py --rounds 8
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import tempfile
from pathlib import Path

import grpc
import numpy as np
import torch
from _serving import serve  # benchmarks/ is on sys.path when run as a script
from infer_latency import timed_requests

import layertap
from layertap.v1 import telemetry_pb2, telemetry_pb2_grpc

BASIC = ["moments", "minmax", "abs_max", "nonfinite"]
SELECTOR = "re:^(layer[1-4](\\.[01])?|avgpool|fc)$"


def start(tmp: Path) -> tuple[subprocess.Popen[str], str]:
    proc, address, _ = serve(["--no-compile", "--no-metrics", "--incident-dir", str(tmp / "incidents"),
                              "--record-inputs", "64"])
    return proc, address


def set_tap(stub: telemetry_pb2_grpc.TelemetryServiceStub, recording: bool) -> None:
    """(Re)create the tap, with a nonfinite trigger when ``recording``."""
    try:
        stub.DeleteTap(telemetry_pb2.DeleteTapRequest(id="guard"))
    except grpc.RpcError:
        pass
    spec = telemetry_pb2.TapSpec(name="guard", selector=SELECTOR, reducers=[
        telemetry_pb2.ReducerSpec(kind=telemetry_pb2.ReducerKind.Value(f"REDUCER_KIND_{r.upper()}")) for r in BASIC])
    if recording:
        spec.triggers.nonfinite = True
    stub.CreateTap(telemetry_pb2.CreateTapRequest(spec=spec, forever=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--requests", type=int, default=30, help="demo-input requests per round")
    ap.add_argument("--big-requests", type=int, default=3, help="32 MB requests per round")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    inputs = {
        "demo input (32x3x32x32, 384 KiB)": (rng.standard_normal((32, 3, 32, 32)).astype(np.float32), args.requests),
        "32 MB input (2731x3x32x32)": (rng.standard_normal((2731, 3, 32, 32)).astype(np.float32), args.big_requests),
    }
    print(f"# {platform.machine()} {platform.processor() or ''} python {platform.python_version()} torch {torch.__version__}"
          f", threads={torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as tmp:
        proc, addr = start(Path(tmp))
        try:
            client = layertap.Client(addr, timeout=600)
            channel = grpc.insecure_channel(addr)
            stub = telemetry_pb2_grpc.TelemetryServiceStub(channel)
            for label, (x, n) in inputs.items():
                per: dict[str, list[float]] = {"off": [], "on": []}
                ratios = []
                for r in range(args.rounds):
                    order = ("off", "on") if r % 2 == 0 else ("on", "off")
                    med = {}
                    for name in order:
                        set_tap(stub, name == "on")
                        timed_requests(client, x, 1)  # the first pass after a new tap records shapes
                        lat = timed_requests(client, x, n)
                        per[name] += lat
                        med[name] = statistics.median(lat)
                    ratios.append(med["on"] / med["off"])
                off, on = statistics.median(per["off"]), statistics.median(per["on"])
                print(f"{label}: off {off * 1e3:.2f} ms, on {on * 1e3:.2f} ms, ratio {on / off:.3f} "
                      f"(per-round ratios {min(ratios):.3f}..{max(ratios):.3f}, median {statistics.median(ratios):.3f})")
            client.close()
            channel.close()
            incidents = list((Path(tmp) / "incidents").glob("*.incident"))
            print(f"incidents written while timing: {len(incidents)} (expected 0: no trigger fired)")
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
