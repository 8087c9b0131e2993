"""Server RSS under pre-auth connection churn: connect, one call without a token, hang up; many times.

Starts ``layertap serve`` (demo model, tokens on) or, with ``--bare``, a
grpcio server with only the Health service, as a subprocess. Each
connection is a raw HTTP/2 client (``tests/support/h2abuse.py``): preface,
one call (``--method``, no token: refused UNAUTHENTICATED by layertap; a
Health.Check on the bare server), its answer read, the socket closed. Prints
the server's RSS every ``--every`` connections. The figures in
docs/benchmarks.md ("pre-auth connection churn") come from this script.

    python benchmarks/connection_churn.py --connections 20000
    python benchmarks/connection_churn.py --connections 20000 --bare
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _serving import serve
from support.h2abuse import HEALTH_CHECK, LIST_LAYERS, H2Client, grpc_frame

BARE = """
import sys, time
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2_grpc
server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
print(f"grpc port {port}", flush=True)
server.wait_for_termination()
"""


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def make_tls(root: Path) -> tuple[str, list[str]]:
    """A CA file, and the serve flags of a certificate it signed (trustme)."""
    import trustme

    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(root / "ca.pem"))
    (root / "server.pem").write_bytes(b"".join(blob.bytes() for blob in issued.cert_chain_pems))
    (root / "server.key").write_bytes(issued.private_key_pem.bytes())
    return str(root / "ca.pem"), ["--tls-cert", str(root / "server.pem"), "--tls-key", str(root / "server.key")]


#: ``layertap serve`` with its periodic malloc_trim off (--no-trim): what the trim is for.
NO_TRIM = "import layertap.server.app as app; app.TRIM_EVERY = float('inf'); from layertap.cli import run; run()"


def start(bare: bool, extra: list[str], trim: bool = True) -> tuple[subprocess.Popen[str], int]:
    if bare:
        proc = subprocess.Popen([sys.executable, "-c", BARE], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        port = int(proc.stdout.readline().split()[-1])
        return proc, port
    tokens = Path(tempfile.mkdtemp()) / "tokens"
    tokens.write_text(f"bench sha256:{hashlib.sha256(b'churn-token-0123456789').hexdigest()} read\n")
    launch = ["-m", "layertap.cli"] if trim else ["-c", NO_TRIM]
    proc, address, _ = serve(["--no-metrics", "--no-compile", "--auth-tokens", str(tokens), *extra], launch=launch)
    return proc, int(address.rsplit(":", 1)[1])


def call(client: H2Client, method: str) -> bool:
    """One call on ``client``; whether its answer (trailers) came."""
    sid = client.start(method, grpc_frame(b""))
    client.flush()
    client.responses(sid, 1, 5)
    return b"grpc-status" in client.trailers(sid)


def one(port: int, method: str, ca: str | None = None) -> bool:
    """One connection, one call, hang up; whether an answer came."""
    client = H2Client(port, ca=ca)
    try:
        return call(client, method)
    finally:
        client.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--connections", type=int, default=20000)
    p.add_argument("--every", type=int, default=5000)
    p.add_argument("--threads", type=int, default=4, help="client threads opening connections")
    p.add_argument("--hold", type=int, default=1,
                   help="connections each client thread keeps open before hanging them all up")
    p.add_argument("--bare", action="store_true", help="a grpcio server with Health only")
    p.add_argument("--settle", type=float, default=12.0, help="seconds to wait before each reading")
    p.add_argument("--tls", action="store_true", help="layertap serve with TLS (a trustme CA)")
    p.add_argument("--no-trim", action="store_true", help="layertap serve without its periodic malloc_trim")
    p.add_argument("serve_args", nargs="*", help="extra `layertap serve` flags (after --)")
    args = p.parse_args()
    ca, tls_flags = make_tls(Path(tempfile.mkdtemp())) if args.tls else (None, [])
    proc, port = start(args.bare, [*tls_flags, *args.serve_args], trim=not args.no_trim)
    method = HEALTH_CHECK if args.bare else LIST_LAYERS
    try:
        for _ in range(200):  # warm up: threads, first allocations
            one(port, method, ca)
        time.sleep(args.settle)
        before = rss_mib(proc.pid)
        print(f"connections=0 rss={before:.1f} MiB", flush=True)
        done, failed, lock = 0, 0, threading.Lock()

        def work(n: int) -> None:
            nonlocal failed
            held: list[H2Client] = []
            for _ in range(n):
                try:
                    client = H2Client(port, ca=ca)
                except OSError:
                    with lock:
                        failed += 1
                    continue
                try:
                    ok = call(client, method)
                except OSError:
                    ok = False
                if not ok:
                    with lock:
                        failed += 1
                held.append(client)
                if len(held) >= args.hold:
                    for c in held:
                        c.close()
                    held.clear()
            for c in held:
                c.close()
        t0 = time.monotonic()
        while done < args.connections:
            step = min(args.every, args.connections - done)
            threads = [threading.Thread(target=work, args=(step // args.threads,)) for _ in range(args.threads)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            done += step // args.threads * args.threads
            time.sleep(args.settle)  # the server's periodic trim, if any, has run
            print(f"connections={done} rss={rss_mib(proc.pid):.1f} MiB failed={failed} "
                  f"({time.monotonic() - t0:.0f} s)", flush=True)
        after = rss_mib(proc.pid)
        print(f"SUMMARY {'bare grpc' if args.bare else 'layertap serve'}{' TLS' if args.tls else ''}{' no trim' if args.no_trim else ''}: before={before:.1f} after={after:.1f} MiB "
              f"(+{after - before:.1f} MiB over {done} connections, {failed} without an answer)")
    finally:
        proc.terminate()
        proc.wait(15)
    return 0


if __name__ == "__main__":
    sys.exit(main())
