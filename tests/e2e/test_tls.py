"""TLS and mTLS for gRPC and /metrics with throwaway ``trustme`` certificates; protected mode."""

from __future__ import annotations

import hashlib
import http.client
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

import layertap

pytestmark = pytest.mark.e2e

trustme = pytest.importorskip("trustme")

TOKEN = "scrape-token-0123456789"
INFER_TOKEN = "infer-token-0123456789"


class Pki:
    """A CA and a server certificate for 127.0.0.1/localhost, written as PEM files."""

    def __init__(self, root: Path, name: str = "a") -> None:
        self.ca = trustme.CA()
        self.dir = root / name
        self.dir.mkdir()
        self.ca_path = self.dir / "ca.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_path))
        self.server = self.ca.issue_cert("127.0.0.1", "localhost")

    def write_server(self, cert: Path, key: Path) -> None:
        cert.write_bytes(b"".join(blob.bytes() for blob in self.server.cert_chain_pems))
        key.write_bytes(self.server.private_key_pem.bytes())

    def client_credentials(self, with_cert: bool) -> grpc.ChannelCredentials:
        if not with_cert:
            return grpc.ssl_channel_credentials(self.ca_path.read_bytes())
        client = self.ca.issue_cert("client@example")
        return grpc.ssl_channel_credentials(
            self.ca_path.read_bytes(), client.private_key_pem.bytes(),
            b"".join(b.bytes() for b in client.cert_chain_pems))


@pytest.fixture
def pki(tmp_path):
    p = Pki(tmp_path)
    p.cert, p.key = tmp_path / "server.pem", tmp_path / "server.key"
    p.write_server(p.cert, p.key)
    return p


def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text(
        f"prom sha256:{hashlib.sha256(TOKEN.encode()).hexdigest()} read\n"
        f"app sha256:{hashlib.sha256(INFER_TOKEN.encode()).hexdigest()} infer\n")
    return path


def test_tls_with_ca_path_works_and_plaintext_fails(make_server, pki):
    srv = make_server(tls_cert=str(pki.cert), tls_key=str(pki.key))
    with layertap.Client(f"127.0.0.1:{srv.port}", tls=str(pki.ca_path)) as c:
        assert c.metadata().model_name
    with layertap.Client(f"127.0.0.1:{srv.port}", tls=pki.client_credentials(False)) as c:
        assert c.layers()
    with layertap.Client(f"127.0.0.1:{srv.port}", timeout=3) as c, pytest.raises(layertap.LayertapError):
        c.metadata()


def test_tls_with_an_untrusted_ca_fails(make_server, pki, tmp_path):
    srv = make_server(tls_cert=str(pki.cert), tls_key=str(pki.key))
    other = Pki(tmp_path, "other")
    with layertap.Client(f"127.0.0.1:{srv.port}", tls=str(other.ca_path), timeout=3) as c, \
            pytest.raises(layertap.ServerUnavailable):
        c.metadata()


def test_mtls_refuses_a_client_without_a_certificate(make_server, pki):
    srv = make_server(tls_cert=str(pki.cert), tls_key=str(pki.key), tls_client_ca=str(pki.ca_path))
    with layertap.Client(f"127.0.0.1:{srv.port}", tls=pki.client_credentials(True)) as c:
        assert c.metadata().model_name
    with layertap.Client(f"127.0.0.1:{srv.port}", tls=str(pki.ca_path), timeout=3) as c, \
            pytest.raises(layertap.ServerUnavailable):
        c.metadata()


def test_tls_and_token_together(make_server, pki, tmp_path):
    srv = make_server(tls_cert=str(pki.cert), tls_key=str(pki.key), auth_tokens=str(tokens_file(tmp_path)))
    with layertap.Client(f"127.0.0.1:{srv.port}", tls=str(pki.ca_path), token=INFER_TOKEN) as c:
        assert c.metadata().model_name
        with pytest.raises(layertap.PermissionDenied):
            c.layers()


def fetch(port: int, ca: Path, token: str | None) -> tuple[int, str]:
    ctx = ssl.create_default_context(cafile=str(ca))
    req = urllib.request.Request(f"https://127.0.0.1:{port}/metrics")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_metrics_over_https_with_a_bearer_token(make_server, pki, tmp_path):
    srv = make_server(tls_cert=str(pki.cert), tls_key=str(pki.key), auth_tokens=str(tokens_file(tmp_path)),
                      metrics_port=0)
    status, body = fetch(srv.metrics_port, pki.ca_path, TOKEN)
    assert status == 200 and "layertap_auth_failures_total" in body
    assert fetch(srv.metrics_port, pki.ca_path, None)[0] == 401
    assert fetch(srv.metrics_port, pki.ca_path, "wrong")[0] == 401
    assert fetch(srv.metrics_port, pki.ca_path, INFER_TOKEN)[0] == 401  # no read scope
    failures = srv.state.registry.get_sample_value("layertap_auth_failures_total", {"reason": "UNAUTHENTICATED"})
    assert failures == 2
    with pytest.raises((urllib.error.URLError, OSError, http.client.HTTPException)):  # plain HTTP is not served
        urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=5).read()


def test_reload_serves_the_new_certificate(make_server, pki, tmp_path):
    srv = make_server(tls_cert=str(pki.cert), tls_key=str(pki.key), metrics_port=0)
    with layertap.Client(f"127.0.0.1:{srv.port}", tls=str(pki.ca_path)) as c:
        assert c.metadata().model_name
    assert fetch(srv.metrics_port, pki.ca_path, None)[0] == 200
    new = Pki(tmp_path, "b")
    new.write_server(pki.cert, pki.key)
    srv.reload()
    with layertap.Client(f"127.0.0.1:{srv.port}", tls=str(new.ca_path)) as c:
        assert c.metadata().model_name
    assert fetch(srv.metrics_port, new.ca_path, None)[0] == 200
    with pytest.raises(urllib.error.URLError):
        fetch(srv.metrics_port, pki.ca_path, None)
    # A broken pair keeps the old (new) certificate.
    pki.key.write_text("not a key")
    assert srv.tls.reload() is False
    assert fetch(srv.metrics_port, new.ca_path, None)[0] == 200


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "layertap.cli", "serve", "--port", "0", "--no-metrics", *args],
                          capture_output=True, text=True, timeout=120)


def test_protected_mode_refuses_exposed_host_without_auth_and_tls(pki, tmp_path):
    proc = serve("--host", "0.0.0.0")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("layertap serve: error: --host 0.0.0.0 exposes")
    assert "--auth-tokens and --tls-cert/--tls-key" in proc.stderr and "--insecure" in proc.stderr
    proc = serve("--host", "0.0.0.0", "--auth-tokens", str(tokens_file(tmp_path)))
    assert proc.returncode == 2 and "without --tls-cert/--tls-key" in proc.stderr
    assert serve("--tls-cert", str(pki.cert)).returncode == 2  # a cert needs its key


def test_protected_mode_insecure_starts(serve_process):
    srv = serve_process("--host", "0.0.0.0", "--insecure", "--no-metrics")
    with layertap.Client(srv.address) as c:
        assert c.metadata().model_name


def test_exposed_host_with_auth_and_tls_starts(serve_process, pki, tmp_path):
    srv = serve_process("--host", "0.0.0.0", "--no-metrics", "--auth-tokens", str(tokens_file(tmp_path)),
                        "--tls-cert", str(pki.cert), "--tls-key", str(pki.key))
    with layertap.Client(srv.address, tls=str(pki.ca_path), token=INFER_TOKEN) as c:
        assert c.metadata().model_name


@pytest.mark.prometheus
def test_real_prometheus_scrapes_over_tls_with_a_bearer_token(make_server, pki, tmp_path):
    from support.prom import PrometheusServer

    srv = make_server(tls_cert=str(pki.cert), tls_key=str(pki.key), auth_tokens=str(tokens_file(tmp_path)),
                      metrics_port=0)
    (tmp_path / "scrape.token").write_text(TOKEN)
    (tmp_path / "wrong.token").write_text("not-the-token")

    def extra(token_file: str) -> str:
        return ("    scheme: https\n"
                f"    authorization: {{credentials_file: {tmp_path / token_file}}}\n"
                f"    tls_config: {{ca_file: {pki.ca_path}}}\n")

    target = f"127.0.0.1:{srv.metrics_port}"
    with PrometheusServer(tmp_path / "prom", target, scrape_extra=extra("scrape.token")) as prom, \
            PrometheusServer(tmp_path / "prom-wrong", target, scrape_extra=extra("wrong.token")) as wrong:
        rows = prom.wait_for(lambda: prom.query('layertap_auth_failures_total{reason="UNAUTHENTICATED"} >= 1'),
                             what="a scrape over TLS with the token, counting the refused one")
        assert rows
        assert wrong.wait_for(lambda: wrong.query("up == 0"), what="the wrong token's scrape refused")
        assert prom.query("up == 1")


def test_the_printed_first_command_runs_as_printed_on_a_tls_server_with_tokens(make_server, pki, tmp_path):
    """`layertap serve` prints a command to try; on a server with TLS and tokens it names
    the CA flag and the token variable, and run that way it works."""
    import os
    import shlex

    from layertap.server.cli.serve import hint

    srv = make_server(tls_cert=str(pki.cert), tls_key=str(pki.key), auth_tokens=str(tokens_file(tmp_path)))
    line = hint(srv, None)
    assert line.endswith("with $LAYERTAP_TOKEN set")
    command = shlex.split(line.split("`")[1])
    assert command[:2] == ["layertap", "layers"] and command[-2:] == ["--tls-ca", "CA.pem"]
    command[-1] = str(pki.ca_path)
    done = subprocess.run([sys.executable, "-m", "layertap.cli", *command[1:]], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "LAYERTAP_TOKEN": TOKEN})
    assert done.returncode == 0 and "layer4" in done.stdout, done.stderr
