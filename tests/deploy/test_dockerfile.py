"""The Dockerfile, checked statically (no Docker engine on these machines)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def instructions() -> list[tuple[str, str]]:
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_builds_the_server_image():
    ins = instructions()
    words = [w for w, _ in ins]
    assert words[0] == "ARG" and ins[0][1].startswith("BASE=python:")  # CPU base by default
    assert ("FROM", "${BASE}") in ins  # CUDA via --build-arg BASE=...
    runs = " ".join(rest for w, rest in ins if w == "RUN")
    assert re.search(r"--index-url \$\{TORCH_INDEX\} \"torch==\$\{TORCH_VERSION\}\"", runs)
    assert 'pip install ".[server]"' in runs
    assert re.search(r"apt-get install -y --no-install-recommends g\+\+", runs)  # inductor's C++ backend
    assert any(w == "ENV" and rest.startswith("TORCHINDUCTOR_CACHE_DIR=") for w, rest in ins)
    copied = [rest.split()[0] for w, rest in ins if w == "COPY"]
    for path in ("pyproject.toml", "setup.py", "proto", "client", "server"):
        assert path in copied and (REPO / path).exists()
    assert ("USER", "layertap") in ins
    entry = json.loads(dict(ins)["ENTRYPOINT"])
    assert entry[:2] == ["layertap", "serve"] and "--host" in entry and "0.0.0.0" in entry
    assert "HEALTHCHECK" in words and "EXPOSE" in words


def healthcheck_code() -> str:
    """The Python program the HEALTHCHECK runs."""
    check = dict(instructions())["HEALTHCHECK"]
    words = shlex.split(check[check.index(" CMD ") + 5:])
    assert words[:2] == ["python", "-c"], words
    return words[2]


def test_healthcheck_dials_the_plaintext_health_listener():
    """The main port may speak TLS; the probe must use --health-address, on the container's loopback."""
    from layertap.server.cli.serve import build_parser

    entry = json.loads(dict(instructions())["ENTRYPOINT"])
    args = build_parser().parse_args(entry[2:])
    assert args.health_address and args.health_address.startswith("127.0.0.1:")
    code = healthcheck_code()
    assert f"insecure_channel('{args.health_address}')" in code
    assert f":{args.port}'" not in code  # never the (possibly TLS) serving port


def test_healthcheck_passes_against_a_tls_server(make_server, tmp_path):
    """The HEALTHCHECK program, run as Docker would, against a server whose main port speaks TLS."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert_path, key_path = tmp_path / "server.pem", tmp_path / "server.key"
    cert_path.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    key_path.write_bytes(cert.private_key_pem.bytes())
    entry = json.loads(dict(instructions())["ENTRYPOINT"])
    listener = entry[entry.index("--health-address") + 1]
    srv = make_server(tls_cert=str(cert_path), tls_key=str(key_path), health_address="127.0.0.1:0")
    code = healthcheck_code().replace(listener, f"127.0.0.1:{srv.health_port}")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    srv.health.enter_graceful_shutdown()  # NOT_SERVING: the check fails, as Docker should see it
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1, run.stderr
