"""The compiled batch kernel (``compile.stats``, the ``batch`` form) against the eager body it compiles.

Each row must be the per-tensor kernel's vector of that row, compiled as eagerly
(``tests/server/reducers/test_batched.py`` has the eager and engine-level cases).
These compile, so they are their own slow module.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from layertap.server.compile.kernel import BATCH, Signature
from layertap.server.compile.stats import CompiledStats
from layertap.server.reducers.batched import batched_basic_stats
from layertap.server.reducers.stats_body import SHIFT_SAMPLE, batched_stats_body
from layertap.server.reducers.workspace import F64
from tests.support.tensors import batch_rows as rows_of
from tests.support.tensors import gen

pytestmark = pytest.mark.slow

ON = torch.ones((1,), dtype=F64)


def test_the_compiled_batch_kernel_equals_the_eager_body() -> None:
    stats = CompiledStats(enabled=True)
    try:
        sig = Signature(torch.device("cpu"), torch.float32, BATCH, grad=False, inference=True, autocast=None)
        assert stats.compile_now(sig, timeout=600)
        x = rows_of(torch.float32, rows=5, n=517)
        rnd = torch.randint(0, 517, (5, SHIFT_SAMPLE), generator=gen(4))
        with torch.inference_mode():
            got = stats.batch_stats(x, rnd)
        assert got is not None and stats.compiled_calls == 1
        torch.testing.assert_close(got, batched_stats_body(x, rnd, ON), rtol=1e-12, atol=1e-9, equal_nan=True)
    finally:
        stats.close()


def test_one_row_groups_take_the_per_tensor_kernel_and_never_stale_the_dynamo_one() -> None:
    """Dynamo's batch kernel (CUDA's path) guards on rows >= 2: lone tensors must not count as misses."""
    cs = CompiledStats(enabled=True, aoti=False)
    try:
        sig = Signature(torch.device("cpu"), torch.float32, BATCH, grad=False, inference=True, autocast=None)
        assert cs.compile_now(sig, timeout=600), cs.states()
        g = gen(9)
        with torch.inference_mode():
            for rows in (5, 1, 1, 1, 1, 5):
                x = torch.randn(rows, 300, generator=g)
                got = cs.batch_stats(x, torch.randint(0, 300, (rows, SHIFT_SAMPLE), generator=g))
                assert (got is None) == (rows == 1)
        assert cs.guard_misses == 0 and cs.states()[sig] == "ready", (cs.counters(), cs.states())
    finally:
        cs.close()
    x = rows_of(torch.float32)[:1]
    got = batched_basic_stats(x, gen(10))[0]
    mean, count = got[5] + got[3] / got[2], got[2]
    assert got.shape == (8,)
    np.testing.assert_allclose(float(mean), x.double().mean().item(), rtol=1e-12)
    assert float(count) == x.numel()
