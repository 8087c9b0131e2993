"""HTTP/2 rapid reset against ``layertap serve``: how many legitimate health probes fail during it.

One raw connection (``tests/support/h2abuse.py``, its own process) sends
HEADERS then RST_STREAM(CANCEL) in a tight loop, without a token, at
``--method``; meanwhile a grpcio channel opened before the flood sends
``Health.Check`` back to back, each with a probe's deadline (``--deadline``,
kubelet's default 1 s). Prints the probes answered and failed (by status
code), the resets sent, how the server pushed back (REFUSED_STREAM /
ENHANCE_YOUR_CALM resets, GOAWAYs and reconnects) and the server's log lines.

    python benchmarks/rapid_reset.py --seconds 10
    python benchmarks/rapid_reset.py --method /layertap.v1.TelemetryService/ListLayers
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the raw HTTP/2 client and serve's start-up reader live with the tests

from _serving import serve  # noqa: E402 - benchmarks/ is on sys.path when run as a script

TOKEN = "bench-token-0123456789abcdef"


#: ``--without-limits``: the server as before session 9, none of server/rpc/transport.py's options.
WITHOUT_LIMITS = ("from layertap.server.rpc import transport; transport.SERVER_OPTIONS.clear(); "
                  "from layertap.cli import run; run()")


def start(tmp: Path, log: Path, limits: bool) -> tuple[subprocess.Popen, int]:
    tokens = tmp / "tokens"
    tokens.write_text(f"root sha256:{hashlib.sha256(TOKEN.encode()).hexdigest()} infer,read,tap,capture,admin\n")
    launch = ["-m", "layertap.cli"] if limits else ["-c", WITHOUT_LIMITS]
    proc, address, _ = serve(["--no-compile", "--no-metrics", "--grace", "1", "--auth-tokens", str(tokens)],
                             launch=launch, stderr=log.open("w+"))
    return proc, int(address.rsplit(":", 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--method", default="/grpc.health.v1.Health/Check")
    parser.add_argument("--deadline", type=float, default=1.0)
    parser.add_argument("--without-limits", action="store_true",
                        help="serve without the HTTP/2 options of server/rpc/transport.py (the 'before' row)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        log = tmp / "serve.log"
        proc, port = start(tmp, log, limits=not args.without_limits)
        try:
            channel = grpc.insecure_channel(f"127.0.0.1:{port}")
            stub = health_pb2_grpc.HealthStub(channel)
            stub.Check(health_pb2.HealthCheckRequest(), timeout=10)  # connected before the flood
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
            flood = subprocess.Popen([sys.executable, "-m", "support.h2abuse", "rapid-reset", "--port", str(port),
                                      "--method", args.method], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
            assert flood.stdout is not None and flood.stdout.readline().strip() == "ready"
            outcomes: collections.Counter[str] = collections.Counter()
            slow = 0.0
            details: dict[str, str] = {}
            end = time.monotonic() + args.seconds
            while time.monotonic() < end:
                t = time.monotonic()
                try:
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=args.deadline)
                    outcomes["OK"] += 1
                except grpc.RpcError as exc:
                    outcomes[exc.code().name] += 1
                    details.setdefault(exc.code().name, exc.details())
                slow = max(slow, time.monotonic() - t)
            flood.terminate()
            counts = json.loads(flood.communicate(timeout=30)[0].strip().splitlines()[-1])
            channel.close()
        finally:
            proc.terminate()
            proc.wait(30)
        lines = log.read_text().splitlines()
    total = sum(outcomes.values())
    print(f"method {args.method}, {args.seconds:.0f} s, probe deadline {args.deadline:.1f} s, "
          f"{'without' if args.without_limits else 'with'} the HTTP/2 limits")
    print(f"probes: {total}, failed {total - outcomes['OK']} ({dict(outcomes)}), slowest {slow * 1000:.0f} ms")
    for code, text in details.items():
        print(f"  first {code}: {text}")
    print(f"flood: {counts['resets']} resets ({counts['resets'] / args.seconds:.0f}/s), "
          f"server RST_STREAMs {counts['server_resets']}, {counts['connections']} connections, "
          f"GOAWAY codes {counts['goaways']}")
    print(f"server log: {len(lines)} lines, {sum(' WARNING ' in ln for ln in lines)} warnings")


if __name__ == "__main__":
    main()
