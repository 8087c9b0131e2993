"""Stream storms for tests/e2e/test_storm.py: a ``layertap serve`` process, every streaming RPC, its gauges.

A storm opens more streams of one RPC than the server admits, reads some,
then ends them all at once: cancelled by the client, dropped with their
channels, or with a raw-socket client that is SIGKILLed
(``support.h2abuse hold``). The server's own ``layertap_streams_open`` gauge
says what it holds before and after.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from layertap.v1 import inference_pb2, inference_pb2_grpc, telemetry_pb2
from support.serve import read_startup

TESTS_DIR = Path(__file__).resolve().parents[1]
SERVING = health_pb2.HealthCheckResponse.SERVING
#: Tokens of the TLS+tokens runs: one with every scope, the weakest (read), another principal's infer.
TOKENS = {"root": "storm-root-0123456789abcdef", "reader": "storm-read-0123456789abcdef",
          "app": "storm-infer-0123456789abcdef"}
SCOPES = {"root": "infer,read,tap,capture,admin", "reader": "read", "app": "infer"}


def tokens_file(path: Path) -> Path:
    path.write_text("".join(f"{tid} sha256:{hashlib.sha256(tok.encode()).hexdigest()} {SCOPES[tid]}\n"
                            for tid, tok in TOKENS.items()))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Tls:
    """Server certificate files and the CA that signed them (trustme)."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def make(cls, root: Path) -> Tls:
        import trustme

        ca = trustme.CA()
        issued = ca.issue_cert("127.0.0.1", "localhost")
        tls = cls(root / "ca.pem", root / "server.pem", root / "server.key")
        ca.cert_pem.write_to_path(str(tls.ca))
        tls.cert.write_bytes(b"".join(blob.bytes() for blob in issued.cert_chain_pems))
        tls.key.write_bytes(issued.private_key_pem.bytes())
        return tls


class Server:
    """``layertap serve`` in its own process, its log in a file (shown when an assertion fails).

    Args:
        tmp: Directory for the log (and nothing else).
        args: Extra ``serve`` flags.
        tls: Serve TLS with these files (and every client here uses them).
        token: Bearer token of this harness's own calls (health needs none).
    """

    def __init__(self, tmp: Path, *args: str, tls: Tls | None = None, token: str | None = None) -> None:
        self.tls, self.token = tls, token
        self.log_path = tmp / "serve.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
        flags = ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key)] if tls else []
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "layertap.cli", "serve", "--port", "0", "--metrics-port", "0",
                 "--no-compile", *flags, *args], stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        assert self.proc.stdout is not None
        self.port, metrics_port = read_startup(self.proc.stdout)
        self.metrics_port = metrics_port if metrics_port is not None else -1
        if self.port < 0:
            self.proc.kill()
            raise RuntimeError(f"serve did not start:\n{self.log()}")
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        self._channels: list[grpc.Channel] = []

    def log(self, tail: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-tail:])

    @property
    def metadata(self) -> list[tuple[str, str]] | None:
        return [("authorization", f"Bearer {self.token}")] if self.token else None

    def channel(self, port: int | None = None, *, plaintext: bool = False) -> grpc.Channel:
        """A channel on a connection of its own (grpc shares one per target unless told not to)."""
        options = [("grpc.use_local_subchannel_pool", 1), ("grpc.http2.bdp_probe", 0)]
        target = f"127.0.0.1:{port or self.port}"
        if self.tls and not plaintext:
            ch = grpc.secure_channel(target, grpc.ssl_channel_credentials(self.tls.ca.read_bytes()), options)
        else:
            ch = grpc.insecure_channel(target, options)
        self._channels.append(ch)
        return ch

    def check(self, port: int | None = None, *, plaintext: bool = False, timeout: float = 10.0) -> int:
        """Health.Check on a new channel: the status, or the RpcError raised."""
        ch = self.channel(port, plaintext=plaintext)
        try:
            return int(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status)
        finally:
            ch.close()

    def infer(self, channel: grpc.Channel, x: Any, *, token: str | None = None, timeout: float = 10.0) -> int:
        """One Infer on ``channel``; its pass index."""
        from layertap._codec import encode_tensor

        token = token or self.token
        metadata = [("authorization", f"Bearer {token}")] if token else None
        resp = inference_pb2_grpc.InferenceServiceStub(channel).Infer(
            inference_pb2.InferRequest(inputs=[encode_tensor(x)]), timeout=timeout, metadata=metadata)
        return int(resp.pass_index)

    def streams_open(self) -> dict[str, float]:
        """``layertap_streams_open`` by pool, scraped from /metrics (with the token, over TLS when on)."""
        from prometheus_client.parser import text_string_to_metric_families

        scheme = "https" if self.tls else "http"
        req = urllib.request.Request(f"{scheme}://127.0.0.1:{self.metrics_port}/metrics")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        ctx = ssl.create_default_context(cafile=str(self.tls.ca)) if self.tls else None
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            text = r.read().decode()
        return {s.labels["pool"]: s.value for fam in text_string_to_metric_families(text)
                if fam.name == "layertap_streams_open" for s in fam.samples}

    def sigterm(self, within: float) -> tuple[int, float]:
        """SIGTERM, then ``(exit code, seconds to exit)``; killed (and failing) past ``within``."""
        for ch in self._channels:
            ch.close()
        start = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(within)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"SIGTERM did not end the server within {within:.0f} s:\n{self.log()}") from None
        return code, time.monotonic() - start

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@dataclass(frozen=True)
class Rpc:
    """A streaming RPC: its path, a request the server keeps the stream open for, and its admission pool."""

    name: str
    method: str
    request: Message
    response: type[Message]
    #: ``layertap_streams_open`` pool that counts it.
    pool: str
    #: Requests are a stream too (reflection): ours sends one and never half-closes.
    bidi: bool = False

    def open(self, channel: grpc.Channel, metadata: list[tuple[str, str]] | None, hold: threading.Event) -> Any:
        """Start one call; a bidi call's request stream stays open until ``hold`` is set."""
        if self.bidi:
            def requests() -> Iterator[Message]:
                yield self.request
                hold.wait(60)
            call = channel.stream_stream(self.method, request_serializer=type(self.request).SerializeToString,
                                         response_deserializer=self.response.FromString)
            return call(requests(), metadata=metadata, timeout=60)
        call = channel.unary_stream(self.method, request_serializer=type(self.request).SerializeToString,
                                    response_deserializer=self.response.FromString)
        return call(self.request, metadata=metadata, timeout=60)


def rpcs(incident_id: str) -> list[Rpc]:
    """Every streaming RPC of the server; Watch last (it is the one that wedged the server)."""
    return [
        Rpc("Subscribe", "/layertap.v1.TelemetryService/Subscribe", telemetry_pb2.SubscribeRequest(),
            telemetry_pb2.SubscribeResponse, "workers"),
        # Two passes: one Infer feeds the first, the stream then waits for the second.
        Rpc("Capture", "/layertap.v1.TelemetryService/Capture",
            telemetry_pb2.CaptureRequest(layers=["layer4"], passes=2), telemetry_pb2.CaptureResponse, "workers"),
        Rpc("GetIncident", "/layertap.v1.TelemetryService/GetIncident",
            telemetry_pb2.GetIncidentRequest(id=incident_id), telemetry_pb2.GetIncidentResponse, "workers"),
        Rpc("ServerReflectionInfo", "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
            reflection_pb2.ServerReflectionRequest(list_services=""), reflection_pb2.ServerReflectionResponse,
            "workers", bidi=True),
        Rpc("Watch", "/grpc.health.v1.Health/Watch", health_pb2.HealthCheckRequest(),
            health_pb2.HealthCheckResponse, "callbacks"),
    ]


def settle(calls: list[Any], refused: int, timeout: float = 30.0) -> list[grpc.StatusCode]:
    """Wait until ``refused`` of ``calls`` have ended (and a moment more); the codes of those that did."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and sum(c.done() for c in calls) < refused:
        time.sleep(0.05)
    time.sleep(0.3)  # an admitted stream that ends by mistake shows up as one too many
    return [c.code() for c in calls if c.done()]


def wait_until(cond: Callable[[], bool], timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return bool(cond())


def abuse(*args: str) -> subprocess.Popen:
    """``python -m support.h2abuse ARGS``, started once it printed ``ready``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "support.h2abuse", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != "ready":
        proc.kill()
        raise RuntimeError(f"h2abuse {args[0]} did not start: {line}\n{proc.stderr.read() if proc.stderr else ''}")
    return proc
