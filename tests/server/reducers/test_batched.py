"""A pass's small tensors reduced together at its end (``reducers.batched``).

Each row of the batched kernel must be the per-tensor kernel's vector of that
row (same shift, same slots), eagerly and compiled; a tap whose tensors take
the batched path must publish what a float64 numpy reference of the tensor,
as the layer produced it, says; and a failure or a full batch must never
fail inference.
"""

from __future__ import annotations

import math
import os
import random

import numpy as np
import pytest
import torch
from torch import nn

from layertap.server.compile.kernel import BATCH, Signature
from layertap.server.host.model_host import ModelHost
from layertap.server.host.sources import InputSpec, LoadedModel
from layertap.server.reducers import batched
from layertap.server.reducers.batched import MAX_BATCH_NUMEL, PassBatch, batched_basic_stats
from layertap.server.reducers.stats_body import SHIFT_SAMPLE, basic_stats_body, batched_stats_body
from layertap.server.reducers.workspace import F64
from layertap.server.stream.broker import Broker
from layertap.server.taps.engine import TapEngine
from layertap.server.taps.tap_files import reducer_spec
from layertap.v1 import telemetry_pb2 as pb
from tests.support.reductions import count_reductions
from tests.support.summaries import drain, results
from tests.support.tensors import batch_rows as rows_of
from tests.support.tensors import gen

pytestmark = pytest.mark.unit

BASIC = ("moments", "minmax", "zero_fraction", "nonfinite")
ON = torch.ones((1,), dtype=F64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_each_row_is_the_per_tensor_kernels_vector(dtype: torch.dtype) -> None:
    x = rows_of(dtype)
    rnd = torch.randint(0, x.shape[1], (x.shape[0], SHIFT_SAMPLE), generator=gen(2))
    got = batched_stats_body(x, rnd, ON)
    for i in range(x.shape[0]):
        want = basic_stats_body(x[i].contiguous(), rnd[i], ON)
        torch.testing.assert_close(got[i], want, rtol=1e-12, atol=1e-9, equal_nan=True)


def test_rows_against_numpy_float64() -> None:
    x = rows_of(torch.float32)
    got = batched_basic_stats(x, gen(3)).numpy()
    for i, row in enumerate(x.double().numpy()):
        fin = row[np.isfinite(row)]
        zeros, nan, count, s1, s2, k, lo, hi = got[i]
        assert (zeros, nan, count) == ((row == 0).sum(), np.isnan(row).sum(), fin.size)
        if fin.size:
            np.testing.assert_allclose(k + s1 / count, fin.mean(), rtol=1e-12)
            np.testing.assert_allclose(math.sqrt(max(s2 / count - (s1 / count) ** 2, 0)), fin.std(), rtol=1e-9)
            assert (lo, hi) == (fin.min(), fin.max())
        else:
            assert (s1, s2, k, lo > hi) == (0, 0, 0, True)  # min > max: no finite element


# -- through the engine -----------------------------------------------------------------------------------
class Chain(nn.Module):
    """Two small layers; the second writes the first's output in place after its hook ran."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.ReLU(inplace=True)
        self.c = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


def rig(width: int = 64) -> tuple[ModelHost, Broker, TapEngine]:
    torch.manual_seed(0)
    module = Chain(width).eval()
    host = ModelHost(LoadedModel(module, "chain", "test", [InputSpec("input", torch.float32, (-1, width))]))
    broker = Broker(default_queue_size=10_000)
    engine = TapEngine(host, broker, rng=random.Random(0))
    engine.use_op = False  # the plan path's batch: basic taps fire as one op call otherwise (taps.firing)
    return host, broker, engine


def test_a_tensor_written_in_place_later_is_summarized_as_the_layer_returned_it(monkeypatch) -> None:
    host, broker, engine = rig()
    tap = engine.create(pb.TapSpec(selector="a", reducers=[reducer_spec(r, "r") for r in BASIC]))
    sub = broker.subscribe([tap.id])
    deferred: list[tuple[int, ...]] = []
    count_reductions(monkeypatch, lambda plan, t: plan is None and deferred.append(tuple(t.shape)))
    seen: list[np.ndarray] = []
    host.modules["a"].register_forward_hook(lambda _m, _a, o: seen.append(o.detach().double().numpy().copy()))
    x = torch.randn((3, 64), generator=gen(5))
    host.run([x])
    assert deferred == [(3, 64)]  # the batched path, not the per-tensor one
    (s,) = drain(engine, sub)
    ref = seen[0]
    assert ref.min() < 0  # the ReLU after it zeroes these in place: a summary read late would say min 0
    r = results(s)
    np.testing.assert_allclose(r["moments"].moments.mean, ref.mean(), rtol=1e-9)
    np.testing.assert_allclose(r["moments"].moments.std, ref.std(), rtol=1e-9)
    assert (r["minmax"].minmax.min, r["minmax"].minmax.max) == (ref.min(), ref.max())
    assert r["zero_fraction"].zero_fraction.fraction == (ref == 0).mean()


def test_a_failing_batch_disables_its_taps_and_inference_goes_on(monkeypatch) -> None:
    host, broker, engine = rig()
    small = engine.create(pb.TapSpec(selector="a", reducers=[reducer_spec(r, "r") for r in BASIC]))
    other = engine.create(pb.TapSpec(selector="c", reducers=[reducer_spec("histogram", "r")]))  # per tensor
    sub = broker.subscribe([small.id, other.id])

    def boom(x: torch.Tensor, g: torch.Generator, kernel: object = None) -> torch.Tensor:
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(batched, "batched_basic_stats", boom)
    out, _ctx = host.run([torch.randn((2, 64), generator=gen(6))])
    assert out.shape == (2, 64)
    got = drain(engine, sub)
    assert small.disabled and "kernel exploded" in (small.last_error or "") and engine.reducer_errors == 1
    assert host.hooks.active == 1  # unhooked (only other's layer is left): the next pass does not copy for it
    assert [s.tap for s in got] == [other.id]
    host.run([torch.randn((2, 64), generator=gen(7))])
    assert [s.tap for s in drain(engine, sub)] == [other.id]


def test_past_the_byte_bound_tensors_take_the_per_tensor_path(monkeypatch) -> None:
    monkeypatch.setattr(batched, "MAX_BATCH_BYTES", 3 * 64 * 4)  # room for one (3, 64) float32 copy
    host, broker, engine = rig()
    tap = engine.create(pb.TapSpec(selector="[ac]", reducers=[reducer_spec(r, "r") for r in BASIC]))
    sub = broker.subscribe([tap.id])
    paths: list[str] = []
    count_reductions(monkeypatch, lambda plan, _t: paths.append("per tensor" if plan is not None else "batched"))
    host.run([torch.randn((3, 64), generator=gen(8))])
    assert paths == ["batched", "per tensor"]
    assert sorted(s.layer for s in drain(engine, sub)) == ["a", "c"]


def test_what_is_never_batched() -> None:
    batch = PassBatch()
    assert batch.defer(torch.zeros(SHIFT_SAMPLE)) is None  # the shift samples all of it: per tensor
    assert batch.defer(torch.zeros(MAX_BATCH_NUMEL + 1)) is None  # big: the single-read kernel
    assert batch.defer(torch.zeros(100, dtype=torch.float64)) is None  # x - K may overflow
    assert batch.defer(torch.zeros(100, dtype=torch.int32)) is None
    assert batch.defer(torch.zeros(MAX_BATCH_NUMEL)) is not None and len(batch) == 1
    batch.discard()
    assert len(batch) == 0


# -- the review's cases (session 14) ------------------------------------------------------------------------


def test_the_eager_path_bounds_its_temporaries_by_chunks_and_agrees(monkeypatch) -> None:
    monkeypatch.setattr(batched, "_EAGER_ELEMENTS", 2 * 700)  # two rows per chunk
    x = rows_of(torch.float32, rows=5)
    rnd_gen, ref_gen = gen(11), gen(11)
    chunked = batched_basic_stats(x, rnd_gen)  # no kernel: eager
    rnd = torch.randint(0, 700, (5, SHIFT_SAMPLE), generator=ref_gen)
    torch.testing.assert_close(chunked, batched_stats_body(x, rnd, ON), rtol=0, atol=0, equal_nan=True)


def test_a_training_agents_warm_up_compiles_the_batch_kernel_too(monkeypatch) -> None:
    from layertap.server.train import agent

    asked: list[Signature] = []
    monkeypatch.setattr(agent.process_compilation().stats, "compile_now", lambda sig, timeout=None: asked.append(sig) or True)
    agent._compile_before_training(torch.device("cpu"), torch.bfloat16)
    assert sorted(s.form for s in asked) == ["batch", "dense"] and {s.dtype for s in asked} == {torch.bfloat16}
    asked.clear()
    agent._compile_before_training(torch.device("cpu"), torch.float64)  # never batched: no batch kernel
    assert [s.form for s in asked] == ["dense"]


def test_prune_keeps_every_form_of_the_loaded_dtype(tmp_path, monkeypatch) -> None:
    """A restart after STALE_DAYS idle loads the dense package first: the batch one must survive that prune."""
    from layertap.server.compile import aoti
    from layertap.server.compile.kernel import DENSE

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(aoti, "_pruned", set())
    sig = Signature(torch.device("cpu"), torch.float32, DENSE, grad=False, inference=True, autocast=None)
    paths = {f: aoti.package_path(sig._replace(form=f)) for f in (DENSE, BATCH)}
    stranger = paths[DENSE].with_name("basic_stats-float32-dense-000000000000000000000000.pt2")
    for p in (*paths.values(), stranger):
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x")
        os.utime(p, (1.0, 1.0))  # 1970: long past STALE_DAYS
    monkeypatch.setattr(aoti, "_load", lambda path: "kernel")
    assert aoti.load_or_compile(sig, (torch.zeros(1),) * 3) == ("kernel", False)
    assert all(p.exists() for p in paths.values()) and not stranger.exists()
