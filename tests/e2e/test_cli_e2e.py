"""The CLI as a user runs it: `layertap serve` in one process, commands in others."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from support.e2e import batch, wait_for

import layertap
from layertap.server.host.demo_model import build_demo_model

pytestmark = pytest.mark.e2e

TESTS = Path(__file__).resolve().parent.parent


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "layertap.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "200"})


def test_serve_then_layers_capture_taps_stats(serve_process, tmp_path):
    taps = tmp_path / "taps.yaml"
    taps.write_text("taps:\n  - name: blocks\n    selector: 'layer*'\n    reducers: [moments, nonfinite]\n")
    srv = serve_process("--no-metrics", "--taps", str(taps))
    addr = srv.address

    out = cli("layers", addr)
    assert out.returncode == 0, out.stderr
    assert "layer4" in out.stdout and "BasicBlock" in out.stdout

    # Passive capture in one process while another sends traffic.
    x = batch(2, seed=3)
    target = tmp_path / "x.npy"
    proc = subprocess.Popen([sys.executable, "-m", "layertap.cli", "capture", addr, "layer4", "-o", str(target)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with layertap.Client(addr) as client:
        assert wait_for(lambda: client.stats().active_hooks == 4 + 1, 30)  # 4 tap hooks + the capture
        client.infer(x)
    got: dict = {}
    model = build_demo_model(0)
    model.layer4.register_forward_hook(lambda _m, _a, o: got.update(y=o.detach().numpy().copy()))
    with torch.inference_mode():
        model(torch.from_numpy(x))
    assert proc.wait(60) == 0, proc.stderr.read() if proc.stderr else ""
    np.testing.assert_array_equal(np.load(target), got["y"])

    inp = tmp_path / "in.npy"
    np.save(inp, x)
    both = tmp_path / "both.npz"
    out = cli("capture", addr, "layer4", "fc", "--input", str(inp), "-o", str(both))
    assert out.returncode == 0, out.stderr
    arrays = np.load(both)
    assert set(arrays.files) == {"layer4", "fc"} and arrays["fc"].shape == (2, 10)

    out = cli("taps", addr)
    assert out.returncode == 0 and "blocks" in out.stdout and "durable" in out.stdout
    assert "(server)" in out.stdout  # the owner column
    with layertap.Client(addr) as client:
        (tap,) = client.taps()
        assert tap.expires_at is None  # config-file taps live until deleted
        assert tap.owner == ""  # the server owns config-file taps
    out = cli("stats", addr)
    assert out.returncode == 0 and "active_hooks" in out.stdout


def test_watch_prints_a_table_row_per_layer(serve_process):
    srv = serve_process("--no-metrics")
    stop = threading.Event()

    def traffic() -> None:
        with layertap.Client(srv.address) as client:
            while not stop.is_set():
                client.infer(batch(1))

    t = threading.Thread(target=traffic)
    t.start()
    try:
        out = cli("watch", srv.address, "layer*", "--reducers", "moments,nonfinite", "--count", "8")
    finally:
        stop.set()
        t.join(30)
    assert out.returncode == 0, out.stderr
    for name in ("layer1", "layer2", "layer3", "layer4"):
        assert name in out.stdout


def test_cli_errors_are_one_line(serve_process):
    srv = serve_process("--no-metrics")
    out = cli("capture", srv.address, "layer5", "-o", "/tmp/never.npy", "--timeout", "10")
    assert out.returncode == 1
    assert "Traceback" not in out.stderr and "layer4" in out.stderr
    out = cli("layers", "127.0.0.1:1", "--timeout", "3")
    assert out.returncode == 1 and "Traceback" not in out.stderr


def test_busy_ports_are_one_line_errors(serve_process):
    srv = serve_process("--no-metrics")
    out = cli("serve", "--port", str(srv.port), "--no-metrics")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"--port {srv.port}: cannot bind" in out.stderr
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        out = cli("serve", "--port", "0", "--metrics-port", str(busy))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"--metrics-port {busy}: cannot bind" in out.stderr
