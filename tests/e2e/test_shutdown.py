"""Honest shutdown: every thread and listener stops, in bounded time, before the process exits."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.e2e import batch, scrape

import layertap
from layertap.server import app, running
from layertap.server.app import SERVICE_NAMES
from layertap.v1 import inference_pb2, inference_pb2_grpc, tensor_pb2

pytestmark = pytest.mark.e2e

TESTS_DIR = Path(__file__).resolve().parents[1]
GRACE = 1.0
#: Grace of the health-listener test: long enough to read the listener mid-drain on a busy machine.
DRAIN = 6.0
#: Seconds past the grace period that a SIGTERMed server may take to exit: room for a busy machine, and
#: still well under what the bound rules out (a cold compile of 15-20 s waited for; the watchdog's 21 s).
EXIT_SLACK = 6.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _ports(proc: subprocess.Popen) -> tuple[int | None, int | None]:
    """``(grpc port, metrics port)`` from a ``serve`` subprocess's start-up lines."""
    port = metrics_port = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if "serving on" in line:
            port = int(line.rsplit(":", 1)[1])
        if "metrics on" in line:
            metrics_port = int(line.rsplit(":", 1)[1].split("/")[0])
        if line.startswith("layertap: try"):
            break
    return port, metrics_port


def _sigterm(proc: subprocess.Popen) -> tuple[int, float]:
    """SIGTERM, then ``(exit code, seconds to exit)``; it must exit within the grace plus slack."""
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(GRACE + EXIT_SLACK)
    return code, time.monotonic() - start


def test_sigterm_during_a_cold_compile_exits_0_within_the_grace(tmp_path):
    """A tap queues a reducer compile that takes 15-20 s cold; SIGTERM must not wait for it,
    and the process must not abort (the compile thread is inside inductor's C++)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # cold
    proc = subprocess.Popen(
        [sys.executable, "-m", "layertap.cli", "serve", "--port", "0", "--grace", str(GRACE)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        port, _ = _ports(proc)
        assert port
        with layertap.Client(f"127.0.0.1:{port}") as client:
            client.create_tap("layer1", reducers=["moments"], ttl=60)  # queues the compile
            client.infer(batch(seed=0))
        code, took = _sigterm(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read() if proc.stderr else ""
    assert code == 0, err
    assert took < GRACE + EXIT_SLACK
    assert "terminate called" not in err and "Traceback" not in err, err


def test_sigterm_stops_metrics_and_transfer_then_exits_0(tmp_path):
    log_path = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "layertap.cli", "serve", "--port", "0", "--metrics-port", "0",
             "--grace", str(GRACE), "--health-address", "127.0.0.1:0"],
            stdout=subprocess.PIPE, stderr=log_file, text=True, env=env)
    try:
        port, metrics_port = _ports(proc)
        assert port and metrics_port, log_path.read_text()
        with layertap.Client(f"127.0.0.1:{port}") as client:
            client.create_tap("layer1", reducers=["moments"], ttl=60)
            for i in range(3):  # work for the host-transfer thread
                client.infer(batch(seed=i))
        assert scrape(metrics_port)
        code, took = _sigterm(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path.read_text()
    assert code == 0, log
    assert took < GRACE + EXIT_SLACK
    lines = [ln for ln in log.splitlines() if " layertap.server" in ln]
    for step in ("health listener stopped", "metrics server stopped", "host-transfer thread stopped",
                 "tap expiry thread stopped"):
        assert any(step in ln for ln in lines), f"{step!r} not logged:\n{log}"
    assert "shutdown complete" in lines[-1], log  # the last word, after every step
    assert "did not stop" not in log and "Traceback" not in log


def test_wait_returns_only_after_stop_has_finished(make_server, monkeypatch):
    """`layertap serve` exits when wait() returns: the steps after the gRPC drain must be done by then."""
    real = app.stop_metrics_server
    stopped = threading.Event()

    def slow_stop(server: object) -> None:
        time.sleep(1.0)
        real(server)
        stopped.set()

    monkeypatch.setattr(app, "stop_metrics_server", slow_stop)
    srv = make_server(metrics_port=0)
    stopper = threading.Thread(target=srv.stop, args=(0,))
    waiter_done: list[bool] = []
    waiter = threading.Thread(target=lambda: (srv.wait(), waiter_done.append(stopped.is_set())))
    waiter.start()
    stopper.start()
    waiter.join(10)
    stopper.join(10)
    assert waiter_done == [True]


def test_a_stuck_step_is_abandoned_in_bounded_time(caplog):
    release = threading.Event()
    caplog.set_level(logging.INFO, logger="layertap.server")
    start = time.monotonic()
    running._run_bounded("stuck thing", release.wait, 0.2)
    assert time.monotonic() - start < 5  # its 0.2 s, not the stuck step's forever: room for a busy machine
    release.set()
    assert "stuck thing did not stop within 0.2s" in caplog.text
    running._run_bounded("quick thing", lambda: None, 1)
    assert "quick thing stopped" in caplog.text


# -- the plaintext health listener (--health-address) ------------------------------


@pytest.fixture
def tls_files(tmp_path):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    paths = {name: tmp_path / name for name in ("ca.pem", "server.pem", "server.key")}
    ca.cert_pem.write_to_path(str(paths["ca.pem"]))
    paths["server.pem"].write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    paths["server.key"].write_bytes(cert.private_key_pem.bytes())
    return paths


def test_health_listener_serves_plaintext_health_only_under_tls(make_server, tls_files, tmp_path):
    token = "health-test-token-0123456789"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"root sha256:{hashlib.sha256(token.encode()).hexdigest()} infer,read,tap,capture,admin\n")
    srv = make_server(tls_cert=str(tls_files["server.pem"]), tls_key=str(tls_files["server.key"]),
                      auth_tokens=str(tokens), health_address="127.0.0.1:0", grace_seconds=DRAIN)
    assert srv.health_port and srv.health_port != srv.port
    plain = grpc.insecure_channel(f"127.0.0.1:{srv.health_port}")
    health = health_pb2_grpc.HealthStub(plain)
    for name in ("", *SERVICE_NAMES):
        assert health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == SERVING
    # Nothing but Health on it, token or not.
    infer = inference_pb2_grpc.InferenceServiceStub(plain)
    x = batch(1)
    request = inference_pb2.InferRequest(inputs=[tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=list(x.shape), raw_data=x.tobytes())])
    for metadata in (None, [("authorization", f"Bearer {token}")]):
        with pytest.raises(grpc.RpcError) as err:
            infer.Infer(request, timeout=5, metadata=metadata)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # The main port still speaks TLS only, and still serves the model there.
    with pytest.raises(grpc.RpcError) as err:
        health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{srv.port}")).Check(
            health_pb2.HealthCheckRequest(), timeout=3)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with layertap.Client(f"127.0.0.1:{srv.port}", token=token, tls=str(tls_files["ca.pem"])) as client:
        assert client.infer(x).shape[0] == 1

    # Stop: the listener reports NOT_SERVING through the drain, then goes away.
    # A Watch on the main port never ends by itself, so the drain lasts DRAIN seconds.
    secure = grpc.secure_channel(f"127.0.0.1:{srv.port}",
                                 grpc.ssl_channel_credentials(tls_files["ca.pem"].read_bytes()))
    draining = health_pb2_grpc.HealthStub(secure).Watch(health_pb2.HealthCheckRequest(), timeout=30)
    assert next(draining).status == SERVING
    watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=30)
    assert next(watch).status == SERVING
    stopper = threading.Thread(target=srv.stop)
    start = time.monotonic()
    stopper.start()
    assert next(watch).status == NOT_SERVING
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == NOT_SERVING
    assert time.monotonic() - start < DRAIN  # still draining: the answer came from the listener
    stopper.join(DRAIN + EXIT_SLACK)
    assert not stopper.is_alive()
    secure.close()
    with pytest.raises(grpc.RpcError) as err:
        next(watch)
    assert err.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(grpc.RpcError) as err:
        health.Check(health_pb2.HealthCheckRequest(), timeout=3)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    plain.close()


def test_health_address_in_use_stops_start(make_server):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(OSError, match="--health-address"):
            make_server(health_address=address)


def test_shutdown_ends_a_waiting_passive_capture_unavailable(make_server):
    """A passive capture waiting for traffic does not hold the drain for its whole grace period."""
    srv = make_server(grace_seconds=20.0)
    result: dict[str, BaseException] = {}

    def capture() -> None:
        with layertap.Client(f"127.0.0.1:{srv.port}") as client:
            try:
                client.capture("layer4", timeout=60)
            except BaseException as exc:  # noqa: BLE001 - inspected below
                result["error"] = exc

    t = threading.Thread(target=capture)
    t.start()
    assert wait_for_hooks(srv, 1)
    start = time.monotonic()
    srv.stop()
    assert time.monotonic() - start < 10, "the drain waited out the grace period"
    t.join(10)
    assert isinstance(result.get("error"), layertap.ServerUnavailable), result
    assert srv.state.host.hooks.active == 0


def wait_for_hooks(srv, n: int) -> bool:  # type: ignore[no-untyped-def]
    from support.e2e import wait_for

    return wait_for(lambda: srv.state.host.hooks.active == n, 10)


WEDGED_SERVER = """
import sys, threading
from layertap.server.app import start_server
from layertap.server.config import ServerConfig

from layertap.server.cli import signals
from layertap.server.cli.signals import install_signal_handlers

signals.SHUTDOWN_MARGIN = {margin}  # read when the signal comes: a short one keeps the test quick
srv = start_server(ServerConfig(port=0, metrics_port=None, compile_reducers=False, grace_seconds={grace}))
install_signal_handlers(srv)
# Wedged on purpose: the health lock is held for good, as grpc_health's was by
# a blocked send, so stop() waits forever in its first step.
srv.health._lock.acquire()
print("ready", flush=True)
srv.wait()
"""


def test_a_wedged_shutdown_is_ended_by_the_watchdog_with_a_reason():
    """Whatever is stuck, SIGTERM ends the process after --grace + the margin: exit 1, the step named."""
    SHUTDOWN_MARGIN = 4.0
    proc = subprocess.Popen([sys.executable, "-c", WEDGED_SERVER.format(grace=GRACE, margin=SHUTDOWN_MARGIN)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=TESTS_DIR)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", proc.stderr
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(GRACE + SHUTDOWN_MARGIN + EXIT_SLACK)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
    _, err = proc.communicate(timeout=10)
    assert code == 1, err
    assert GRACE + SHUTDOWN_MARGIN - 0.5 <= took, f"ended after {took:.1f}s: before the watchdog's deadline?"
    assert "shutdown did not finish within" in err and "stuck health NOT_SERVING" in err, err
