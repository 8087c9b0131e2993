"""A real 2-process gloo DDP run (CPU) with an agent on each rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.training import free_port, rank_env

pytestmark = pytest.mark.e2e

TESTS = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("model", ["demo", "inplace"])
def test_both_ranks_report_the_all_reduced_total_norm(model: str) -> None:
    """``inplace``: the in-place-ReLU model trains under DDP with every gradient point tapped."""
    master = free_port()
    procs = []
    for rank in range(2):
        env = rank_env(rank, master, TESTS, LT_MODEL=model)
        procs.append(subprocess.Popen([sys.executable, str(TESTS / "support" / "ddp_worker.py")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    r0, r1 = sorted(results, key=lambda r: r["rank"])
    for r in (r0, r1):
        assert r["steps"] == [0, 1, 2]
        assert r["source"] == f"training (rank {r['rank']} of 2)"
        # DDP's "module." is gone
        assert r["names"] == (["conv1", "bn1", "relu1"] if model == "inplace" else ["conv1", "bn1", "relu"])
        np.testing.assert_allclose(r["totals"], r["clipped"], rtol=1e-5)
        assert r["tap_errors"] == 0 and r["hook_errors"] == 0
        if model == "inplace":
            # Every step's gradient at every tapped layer, nonzero and finite.
            for point, layers in (("grad_output", ("bn1", "conv1", "conv2")), ("grad_input", ("bn1", "conv2"))):
                assert r["seen"][point] == sorted([s, layer] for s in range(3) for layer in layers), point
    # After the all-reduce both ranks hold the same gradient, though their local ones differed.
    np.testing.assert_allclose(r0["totals"], r1["totals"], rtol=1e-6)
    if model == "demo":
        assert all(abs(a - b) > 1e-3 * max(a, b) for a, b in zip(r0["local"], r1["local"]))
