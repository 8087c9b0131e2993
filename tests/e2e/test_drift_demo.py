"""``layertap demo drift`` as users run it: a subprocess through the CLI."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import pytest

import layertap
from layertap.server.cli.drift_demo import main as demo_main

pytestmark = pytest.mark.slow

# The demo's clock runs from its first pass, and the shift waits for the baseline to freeze: on a busy
# machine both come late, so each run leaves the shifted traffic several seconds to fill a window.
TINY = ["--duration", "10", "--shift-after", "3", "--baseline-passes", "5", "--rate", "20"]


def demo(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "layertap.cli", "demo", "drift", *args],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def drift_rows_after_shift(out: str) -> dict[str, str]:
    """``{layer: flag}`` from the tables printed after the shift (the last row per layer wins)."""
    shift = out.find("switching to shifted inputs")
    assert shift >= 0, out
    rows = {}
    for m in re.finditer(r"^  (layer\d)\s+ready\s+\d+\s.*\s(DRIFT|ok)$", out[shift:], re.M):
        rows[m.group(1)] = m.group(2)
    return rows


def test_demo_serves_baselines_and_shows_drift_after_the_shift() -> None:
    res = demo("--metrics-port", "0", *TINY)
    out = res.stdout
    assert res.returncode == 0, out + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    grpc_port = re.search(r"serving the demo model on 127\.0\.0\.1:(\d+)", out)
    metrics_port = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", out)
    assert grpc_port and metrics_port, out
    assert int(metrics_port.group(1)) not in (0, 9466)  # --metrics-port 0 picked a free port
    assert re.search(r"baseline baseline-\w+ over 4 layer\(s\) \(layer1, layer2, layer3, layer4\), 5 passes", out), out
    rows = drift_rows_after_shift(out)
    assert set(rows) == {"layer1", "layer2", "layer3", "layer4"}, out
    assert "DRIFT" in rows.values(), out
    final = re.search(r"done after (\d+) passes; drifting layers: (.+)$", out, re.M)
    assert final and final.group(2) != "none", out
    drifting = final.group(2).split(", ")
    assert set(drifting) <= set(rows) and all(rows[lay] == "DRIFT" for lay in drifting), out


def test_demo_drives_an_existing_server(make_server) -> None:
    srv = make_server()  # the demo model, no metrics
    res = demo("--target", f"127.0.0.1:{srv.port}", "--duration", "9", "--shift-after", "2",
               "--baseline-passes", "5", "--rate", "20", "--shift", "2", "--selector", "layer3")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "serving the demo model" not in res.stdout  # it started no server of its own
    assert drift_rows_after_shift(res.stdout) == {"layer3": "DRIFT"}, res.stdout
    # The drift is on the target server itself, where its baseline tap stays.
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        [d] = client.drift()
        assert (d.layer, d.state, d.drifted) == ("layer3", "ready", True)
        assert [t.id for t in client.taps()] == [d.tap]


def test_demo_exits_cleanly_on_ctrl_c() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "layertap.cli", "demo", "drift", "--metrics-port", "0", "--duration", "0",
         "--baseline-passes", "5", "--rate", "20", "--print-every", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    killer = threading.Timer(180, proc.kill)  # never hang the suite
    killer.start()
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("t="):  # traffic is flowing and a table was printed
                break
        else:
            pytest.fail("demo ended before printing a table:\n" + "".join(lines) + proc.stderr.read())
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    finally:
        killer.cancel()
    out = "".join(lines) + rest
    assert proc.returncode == 0, out + err
    assert "Traceback" not in err, err
    assert re.search(r"stopped after \d+ passes; drifting layers:", out), out


@pytest.mark.parametrize("bad", [["--rate", "0"], ["--baseline-passes", "0"], ["--duration", "-1"], ["--shift-after", "nan"]])
def test_demo_rejects_bad_options(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        demo_main(bad)
    assert exc.value.code == 2
    assert bad[0] in capsys.readouterr().err
