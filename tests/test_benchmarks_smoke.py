"""The benchmarks run end to end on a tiny model: one that broke is found here, not on the day
someone needs its numbers. Each runs as its command line does, as a subprocess (it starts its own
``layertap serve``); the sizes are the smallest that still take every path.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]

needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None and not os.environ.get("CI"),
    reason="transformers is not installed (pip install 'layertap[hf]')")


@needs_transformers
def test_generate_benchmark_prints_every_row() -> None:
    tiny = ["--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "64", "--prompt", "4", "--new", "4",
            "--rounds", "1", "--clients", "2", "--threads", "1", "--no-compile"]
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "generate.py"), *tiny],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    lines = {line.split("  ")[0]: line for line in out.stdout.splitlines()}
    for row in ("model.generate, in process", "bare loop (forward + argmax), in process", "Generate, no taps",
                "Generate + durable tap (CreateTap), none inline", "2"):
        assert row in lines and "skipped" not in lines[row], out.stdout
    assert "skipped: pass --nnsight-python" in lines["nnsight generate + per-layer stats every step"]
    assert "Generate, no taps: server (GenerationFinished)" in out.stdout
    assert "skipped" not in lines["Generate + inline basic tap on 1 layer"], out.stdout
    assert "4 summaries per call (layers x steps = 4), 0 dropped" in out.stdout


def test_drift_power_benchmark_prints_every_row(tmp_path: Path) -> None:
    """benchmarks/drift_power.py at its smallest calibrated size (5 windows of 20); alibi-detect is not run."""
    import json

    tiny = ["--sections", "demo", "--passes", "100", "--window", "20", "--calm-windows", "2", "--batch", "2",
            "--out", str(tmp_path)]
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "drift_power.py"), *tiny],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "layer1 calibrated" in out.stdout and "calibrated alarm:" in out.stdout, out.stdout
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["shift"] for r in result["shifts"]] == ["+0.05σ", "+0.1σ", "+0.2σ", "×1.05", "×1.1"]
    assert (tmp_path / "calm_layer4.npy").exists() and (tmp_path / "shift_×1.1_layer1.npy").exists()


def test_firing_cost_benchmark_prints_its_figure() -> None:
    """benchmarks/firing_cost.py on a 4-block MLP of width 64: a tap on every block's Linear, 2 rounds."""
    tiny = ["--width", "64", "--blocks", "4", "--rounds", "2", "--requests", "5", "--no-compile"]
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "firing_cost.py"), *tiny],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    # Two rounds on each server (the op and the plan path), then a summary line each.
    assert out.stdout.count("per firing") == 6, out.stdout
    assert "round 1 plan path (--no-tap-op)" in out.stdout and "round 1 op:" in out.stdout, out.stdout
    assert "width 64, 4 blocks, batch 1, 2 rounds" in out.stdout, out.stdout


def test_overhead_budget_benchmark_prints_every_row() -> None:
    """benchmarks/overhead_budget.py with one subscriber, the budget on and off, one short round a row."""
    tiny = ["--rounds", "1", "--window", "0.3", "--settle", "0.5", "--counts", "1", "--budgets", "0.05,0"]
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "overhead_budget.py"), *tiny],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [line.split(" | ")[:3] for line in out.stdout.splitlines() if line.startswith("| 0")]
    assert rows == [["| 0.05", "1", "never"], ["| 0.05", "1", "read"], ["| 0", "1", "never"], ["| 0", "1", "read"]], \
        out.stdout
    read_off = next(line for line in out.stdout.splitlines() if line.startswith("| 0 | 1 | read"))
    assert "1: " in read_off.split(" | ")[-2], out.stdout  # budget off: every summary at stride 1
