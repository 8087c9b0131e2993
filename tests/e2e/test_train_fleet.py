"""Issue 11's done-when run: 2 gloo DDP ranks, an agent on each, one Fleet client, a real Prometheus.

The ranks train the demo model on synthetic data (each rank its own batches)
until the test tells them to stop. Against them, the test checks that a
``Fleet`` watch gets the gradient norms of both ranks at the same steps and
that the per-step total equals ``clip_grad_norm_`` on each rank, that a
Prometheus scraping both agents sees the ``rank`` label, that a Fleet capture
of parameter gradients returns each rank's gradient, and that a client
killed mid-stream leaves 0 hooks on both ranks while they train on.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from support.e2e import wait_for
from support.prom import PrometheusServer, prometheus_binary
from support.training import free_port, free_port_pair, rank_env

import layertap
from layertap.server.host.demo_model import build_demo_model

TESTS = Path(__file__).resolve().parents[1]
STEPS = 4
#: One param_grad summary per parameter of the demo model, per step and rank.
N_PARAMS = len(list(build_demo_model(0).parameters()))

pytestmark = [pytest.mark.slow, pytest.mark.prometheus]

KILLED = textwrap.dedent("""
    import sys, layertap
    with layertap.Fleet(sys.argv[1:]) as fleet:
        s = fleet.watch("**", point="grad_output", reducers="norm", queue_size=4)
        print("ready", flush=True)
        for _ in s:
            pass
""")


def _start_ranks(control: Path, port: int, metrics_port: int) -> list[subprocess.Popen[str]]:
    master = free_port()
    procs = []
    for rank in range(2):
        env = rank_env(rank, master, TESTS, LT_DIR=str(control), LT_PORT=str(port), LT_METRICS_PORT=str(metrics_port))
        procs.append(subprocess.Popen([sys.executable, str(TESTS / "support" / "ddp_fleet_worker.py")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def _hooks(fleet: layertap.Fleet) -> dict[int | None, int]:
    stats = fleet.stats(timeout=10)
    assert stats.ok, stats.errors
    return {item.rank: item.value.active_hooks for item in stats}


def test_fleet_and_prometheus_follow_both_ranks_of_a_ddp_run(tmp_path: Path) -> None:
    prometheus_binary()  # skip before starting anything when it is not installed
    control = tmp_path / "control"
    control.mkdir()
    port, metrics_port = free_port_pair(), free_port_pair()
    procs = _start_ranks(control, port, metrics_port)
    targets = [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]
    try:
        with layertap.Fleet(targets, timeout=10) as fleet:
            assert wait_for(lambda: fleet.metadata(timeout=2).ok, 120), "the agents did not come up"
            meta = fleet.metadata()
            assert sorted((m.rank, m.value.rank, m.value.world_size) for m in meta) == [(0, 0, 2), (1, 1, 2)]
            layers = fleet.layers().by_target()
            assert layers[targets[0]] == layers[targets[1]] and layers[targets[0]][0].name == "conv1"

            stream = fleet.watch("*", point="param_grad", reducers="norm", queue_size=10_000, timeout=180)
            assert wait_for(lambda: all(s.value.taps == 1 for s in fleet.stats()), 30)
            (control / "go").touch()
            sums: dict[tuple[int, int], list[float]] = {}
            for item in stream:
                s = item.value
                assert item.rank == s.rank and item.target == targets[s.rank] and s.point == "param_grad"
                if s.step < STEPS:
                    sums.setdefault((s.rank, s.step), []).append(s.results["norm"].l2)
                if len(sums) == 2 * STEPS and all(len(v) == N_PARAMS for v in sums.values()):
                    break
            stream.close()
            assert not stream.errors
            totals = {k: math.sqrt(sum(v * v for v in vs)) for k, vs in sums.items()}

            # Passive gradient capture on both ranks: the optimizer's (all-reduced) fc gradient.
            captured = fleet.capture("fc", point="param_grad", timeout=60)
            assert captured.ok, captured.errors
            grads = {item.rank: item.value for item in captured}
            assert sorted(grads) == [0, 1]
            for g in grads.values():
                assert sorted(g) == ["bias", "weight"] and g["weight"].shape == (10, 128)
                assert np.isfinite(g["weight"]).all() and np.abs(g["weight"]).max() > 0

            with PrometheusServer(tmp_path / "prom", [f"127.0.0.1:{metrics_port}",
                                                     f"127.0.0.1:{metrics_port + 1}"]) as prom:
                rows = prom.wait_for(lambda: (r := prom.query("count by (rank) (layertap_build_info)"))
                                     and len(r) == 2 and r, timeout=60, what="both ranks' series")
                assert sorted(r["metric"]["rank"] for r in rows) == ["0", "1"]

            assert wait_for(lambda: _hooks(fleet) == {0: 0, 1: 0}, 15)
            killed = subprocess.Popen([sys.executable, "-c", KILLED, *targets], stdout=subprocess.PIPE, text=True)
            try:
                assert killed.stdout is not None and killed.stdout.readline().strip() == "ready"
                assert wait_for(lambda: all(h > 0 for h in _hooks(fleet).values()), 30), "the client never hooked"
                killed.kill()
                killed.wait(10)
                assert wait_for(lambda: _hooks(fleet) == {0: 0, 1: 0}, 30), f"hooks left: {_hooks(fleet)}"
            finally:
                killed.kill()
            passes = {item.rank: item.value.passes for item in fleet.stats()}
            assert wait_for(lambda: all(s.value.passes > passes[s.rank] for s in fleet.stats()), 30)  # still training
        (control / "stop").touch()
        results = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        (control / "stop").touch()
        for p in procs:
            p.kill()
    r0, r1 = sorted(results, key=lambda r: r["rank"])
    for r in (r0, r1):
        assert r["hook_errors"] == 0 and r["step_errors"] == 0
        want = [r["clipped"][str(k)] for k in range(STEPS)]
        np.testing.assert_allclose([totals[r["rank"], k] for k in range(STEPS)], want, rtol=1e-5)
        # The captured fc gradient is that of one of this rank's steps (the next after the request).
        norm = float(np.linalg.norm(grads[r["rank"]]["weight"].astype(np.float64)))
        assert any(math.isclose(norm, v, rel_tol=1e-5) for v in r["fc"].values()), norm
    # After the all-reduce both ranks hold the same gradient, at the same steps.
    np.testing.assert_allclose([totals[0, k] for k in range(STEPS)], [totals[1, k] for k in range(STEPS)], rtol=1e-6)
