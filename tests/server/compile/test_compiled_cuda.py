"""In-graph tap statistics on CUDA, with and without CUDA graphs (``--compile-mode reduce-overhead``).

Skipped without CUDA; ``benchmarks/gpu_checks.sh`` runs it on a lent GPU.
It passed on an H200 (torch 2.11.0+cu130, 2026-11-26) for reduce-overhead; the server refuses
CUDA-graph modes it has not verified (``compile.modes.CUDA_GRAPHS_VERIFIED``). Runs on torch 2.11+.

What it checks beyond the CPU tests: a CUDA graph's replay writes its
outputs into the same memory each time, so a pass's statistics must be
copied (as ``PassBuffer.finish`` does, in stream order) before the next
replay; and no pass syncs with the host or compiles on the caller's thread.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from layertap.server.compile.serving import CompiledServing, GraphPlan
from layertap.server.host.demo_model import build_demo_model
from layertap.server.reducers.stats_body import SHIFT_SAMPLE, basic_stats_body
from layertap.server.taps.graph import GraphFeed

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LAYERS = ("layer1", "layer2", "layer3", "layer4")


class _Taps:
    def __init__(self) -> None:
        self.statistics = GraphFeed.statistics
        self.copies: list[torch.Tensor] = []

    def graph_plan(self, ctx: Any) -> GraphPlan:
        return GraphPlan(LAYERS)

    def graph_feed(self, ctx: Any, key: tuple[str, ...], stats: torch.Tensor, shapes: list[tuple[int, ...]]) -> None:
        self.copies.append(torch.cat([stats.reshape(-1)]))  # what the pass buffer does at the pass's end


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_in_graph_statistics_on_cuda_equal_eager(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # cuDNN convolutions run in TF32 by default (10-bit mantissa): the graph's and the eager model's
    # algorithms then differ by ~1e-3 relative in the layer outputs themselves, before any statistic.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = build_demo_model(0).cuda().eval()
    serving = CompiledServing(model, {0: (0,)}, mode=mode, fallback="eager")
    serving.taps = taps = _Taps()
    gen = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(8, 3, 32, 32, device="cuda", generator=gen) for _ in range(4)]
    try:
        with torch.inference_mode():
            serving.serve((xs[0],), {}, None)  # queues the compile
            assert serving.wait_idle(600)
            for _ in range(2):  # cudagraph trees record on the first calls
                serving.serve((xs[0],), {}, None)
            taps.copies.clear()
            torch.cuda.set_sync_debug_mode("error")  # a host sync on the pass raises
            try:
                for x in xs:
                    served, _out = serving.serve((x,), {}, None)
                    assert served
            finally:
                torch.cuda.set_sync_debug_mode("default")
            seen: dict[str, torch.Tensor] = {}
            hooks = [model.get_submodule(n).register_forward_hook(
                lambda _m, _a, o, n=n: seen.__setitem__(n, o)) for n in LAYERS]
            rnd = torch.zeros(SHIFT_SAMPLE, dtype=torch.int64, device="cuda")
            on = torch.ones((1,), dtype=torch.float64, device="cuda")
            try:
                for x, got in zip(xs, taps.copies):
                    model(x)
                    want = torch.stack([basic_stats_body(seen[n].reshape(-1), rnd, on) for n in LAYERS])
                    torch.testing.assert_close(got.reshape(len(LAYERS), -1), want, rtol=1e-5, atol=1e-4)
            finally:
                for h in hooks:
                    h.remove()
    finally:
        serving.close()
    assert serving.request_thread_compiles == 0
    assert serving.compile_failures == 0
