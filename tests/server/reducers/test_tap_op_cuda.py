"""``layertap::tap_stats`` on CUDA (the Triton kernel): float64 numpy, no host sync, one launch in a CUDA graph.

Runs only where CUDA is (``benchmarks/gpu_checks.sh``'s tests step); the same kernel runs on CPU
tensors under ``TRITON_INTERPRET=1`` in ``test_tap_op_triton.py`` on every CI run.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from layertap.server.reducers.op import IDENTITY, new_rows, reset_rows, tap_stats
from tests.server.reducers.test_tap_op import DTYPES, check, expected, layouts

pytestmark = [pytest.mark.unit, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_cuda_kernel_matches_float64_numpy_without_a_sync(dtype: torch.dtype) -> None:
    for name, x in layouts(dtype).items():
        for mask in (None, torch.arange(x.shape[0]) % 2 == 0) if x.dim() else (None,):
            out = new_rows(2, "cuda")
            xc, mc = x.cuda(), None if mask is None else mask.cuda()
            row, flag = torch.tensor([1], device="cuda"), torch.ones(1, dtype=torch.int32, device="cuda")
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                tap_stats(xc, out, row, flag, mc)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            check(out[1].cpu().numpy(), expected(x, mask))


def test_a_cuda_graph_captures_the_call_and_the_flag_steers_each_replay() -> None:
    x = torch.randn(64, 512, device="cuda")
    out = new_rows(1, "cuda")
    row, flag = torch.tensor([0], device="cuda"), torch.ones(1, dtype=torch.int32, device="cuda")
    tap_stats(x, out, row, flag)  # compiles the kernel before the capture
    reset_rows(out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tap_stats(x, out, row, flag)
    reset_rows(out)
    graph.replay()
    check(out[0].cpu().numpy(), expected(x.cpu()))
    reset_rows(out)
    flag.zero_()  # the tap off: the same graph, no work
    graph.replay()
    assert (out[0].cpu().numpy() == np.array(IDENTITY)).all()
