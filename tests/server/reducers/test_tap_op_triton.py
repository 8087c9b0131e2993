"""The op's Triton kernel (its CUDA implementation) run on CPU under ``TRITON_INTERPRET=1``.

The variable is read when a kernel is decorated, so the kernel runs in a
subprocess; it reports each case's row from the Triton kernel and from the
CPU kernel, and the number of launches, and the test compares them here
against float64 numpy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.server.reducers.test_tap_op import DTYPES, check, expected, layouts

pytestmark = pytest.mark.unit

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]

_SCRIPT = r"""
import json, sys
import torch
from layertap.server.reducers.op import IDENTITY, new_rows
from layertap.server.reducers.op import triton_kernel
from tests.server.reducers.test_tap_op import DTYPES, layouts

launches = 0
real = triton_kernel._tap_stats

class Counting:
    def __getitem__(self, grid):
        global launches
        launches += 1
        return real[grid]

triton_kernel._tap_stats = Counting()
report = []
for dtype in DTYPES:
    for name, x in layouts(dtype).items():
        for masked in (False, True):
            mask = torch.tensor([i % 2 == 0 for i in range(x.shape[0])]) if masked and x.dim() else None
            if masked and mask is None:
                continue
            out = new_rows(2, "cpu")
            before = launches
            inner = x.numel() // mask.numel() if mask is not None and mask.numel() else 1
            assert triton_kernel.launch(x, out, torch.tensor([1]), torch.ones(1, dtype=torch.int32), mask, inner)
            once = launches - before
            off = new_rows(1, "cpu")
            triton_kernel.launch(x, off, torch.tensor([0]), torch.zeros(1, dtype=torch.int32), mask, inner)
            report.append({"dtype": str(dtype), "layout": name, "masked": masked, "row": out[1].tolist(),
                           "untouched": off[0].tolist() == list(IDENTITY) and out[0].tolist() == list(IDENTITY),
                           "launches": (once, launches - before)})
x = torch.tensor([[0.0, float("nan"), 1.5], [float("inf"), -2.0, 0.0]])
counts = new_rows(1, "cpu")
triton_kernel.launch(x, counts, torch.tensor([0]), torch.full((1,), 2, dtype=torch.int32), None, 1)
json.dump({"cases": report, "counts_only": counts[0].tolist()}, sys.stdout)
"""


@pytest.fixture(scope="module")
def reported() -> dict[str, object]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def report(reported) -> list[dict[str, object]]:
    return reported["cases"]


def test_flag_two_counts_only(reported) -> None:
    assert reported["counts_only"] == [2, 1, 4, 0, 0, 0, float("inf"), float("-inf")]


def test_every_case_ran(report) -> None:
    cases = {(r["dtype"], r["layout"], r["masked"]) for r in report}
    assert len(cases) == len(report) == len(DTYPES) * (2 * len(layouts(torch.float32)) - 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_triton_kernel_matches_float64_numpy(report, dtype: torch.dtype) -> None:
    cases = layouts(dtype)
    for r in (r for r in report if r["dtype"] == str(dtype)):
        x = cases[str(r["layout"])]
        mask = torch.tensor([i % 2 == 0 for i in range(x.shape[0])]) if r["masked"] else None
        check(np.array(r["row"]), expected(x, mask))


def test_one_launch_per_call_and_a_zero_flag_writes_nothing(report) -> None:
    assert {tuple(r["launches"]) for r in report} == {(1, 2)}  # one launch on, one off
    assert all(r["untouched"] for r in report)
