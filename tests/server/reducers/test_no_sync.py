"""No reducer (nor the host-transfer's model-thread half) forces a host sync.

On CPU the referee is :class:`NoSyncMode`; the first tests prove it catches
what it must, so a green run of the others means something. On a GPU,
``torch.cuda.set_sync_debug_mode("error")`` is the referee.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch
from support.sync_guard import NoSyncMode, SyncError, assert_no_sync

from layertap.server.reducers.plan import ReducerPlan, build_reducers
from layertap.server.reducers.transfer import HostTransfer, PassBuffer
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit

SAMPLE = 2048

# Every reducer, with the samplers set small so the big shapes below are sampled.
SPECS = [
    pb.ReducerSpec(kind=pb.REDUCER_KIND_MOMENTS),
    pb.ReducerSpec(kind=pb.REDUCER_KIND_MINMAX),
    pb.ReducerSpec(kind=pb.REDUCER_KIND_ABS_MAX),
    pb.ReducerSpec(kind=pb.REDUCER_KIND_ZERO_FRACTION),
    pb.ReducerSpec(kind=pb.REDUCER_KIND_NONFINITE),
    pb.ReducerSpec(kind=pb.REDUCER_KIND_NORM),
    pb.ReducerSpec(kind=pb.REDUCER_KIND_HISTOGRAM, histogram=pb.HistogramParams(sample_size=SAMPLE)),
    pb.ReducerSpec(kind=pb.REDUCER_KIND_HISTOGRAM, histogram=pb.HistogramParams(edges=[-1, 0, 1], sample_size=512)),
    pb.ReducerSpec(kind=pb.REDUCER_KIND_QUANTILES, quantiles=pb.QuantileParams(sample_size=SAMPLE)),
    pb.ReducerSpec(kind=pb.REDUCER_KIND_LOGITS),
    pb.ReducerSpec(kind=pb.REDUCER_KIND_PER_CHANNEL, per_channel=pb.PerChannelParams(max_channels=4)),
]
NO_PER_CHANNEL = SPECS[:-1]
#: A 0-d tensor has no classes axis for logits either.
SCALAR_SPECS = SPECS[:-2]

# name -> (base shape, view applied after NaN/Inf are planted in the base)
SHAPES: dict[str, tuple[tuple[int, ...], Callable[[torch.Tensor], torch.Tensor]]] = {
    "nchw_sampled": ((4, 8, 24, 24), lambda t: t),
    "channels_last_sampled": ((4, 8, 24, 24), lambda t: t.to(memory_format=torch.channels_last)),
    "transposed": ((64, 48), lambda t: t.t()),
    "sliced_sampled": ((6, 40, 50), lambda t: t[:, ::2, 3:]),
    "expanded": ((3, 1, 900), lambda t: t.expand(3, 4, 900)),
    "small": ((3, 5), lambda t: t),
    "empty": ((0, 4), lambda t: t),
    "scalar": ((), lambda t: t),
    "vector": ((100,), lambda t: t),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.uint8, torch.bool]


def make(shape: str, dtype: torch.dtype) -> torch.Tensor:
    base_shape, view = SHAPES[shape]
    base = (torch.randn(base_shape, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    if dtype.is_floating_point and base.numel() > 3:
        flat = base.view(-1)
        flat[0], flat[1], flat[2] = math.nan, math.inf, -math.inf
    return view(base)


# ---------------------------------------------------------- the guard works


@pytest.mark.parametrize(
    "name, fn",
    [
        ("item", lambda x: x.sum().item()),
        ("float", lambda x: float(x.max())),
        ("python_if", lambda x: 1 if x.sum() > 0 else 0),
        ("histc", lambda x: torch.histc(x, bins=4)),
        ("nonzero", lambda x: torch.nonzero(x)),
        ("where_one_arg", lambda x: torch.where(x > 0)),
        ("bincount", lambda x: torch.bincount((x > 0).long())),
        ("masked_select", lambda x: torch.masked_select(x, x > 0)),
        ("bool_index", lambda x: x[x > 0]),
        ("bool_index_put", lambda x: x.clone().index_put_((x > 0,), torch.tensor(0.0))),
        ("unique", lambda x: torch.unique(x)),
        ("equal", lambda x: torch.equal(x, x)),
    ],
)
def test_guard_catches_syncs(name: str, fn: Callable[[torch.Tensor], object]) -> None:
    x = torch.randn(50)
    with pytest.raises(SyncError):
        with NoSyncMode():
            fn(x)
    fn(x)  # and the mode is gone afterwards


def test_guard_sample_limit_catches_full_tensor_sort_and_scatter() -> None:
    x = torch.randn(1000)
    with pytest.raises(SyncError, match="sample limit"):
        with NoSyncMode(sample_op_limit=100):
            torch.sort(x)
    with pytest.raises(SyncError, match="sample limit"):
        with NoSyncMode(sample_op_limit=100):
            torch.zeros(8).scatter_add_(0, torch.zeros(1000, dtype=torch.long), x)
    with NoSyncMode(sample_op_limit=100):
        torch.sort(x[:100])  # a bounded sample is fine


def test_guard_allows_ordinary_ops_and_integer_indexing() -> None:
    x = torch.randn(10)
    out = assert_no_sync(lambda: x[torch.tensor([1, 2])] + torch.where(x > 0, x, 0.0).sum())
    assert out.shape == (2,)


# ------------------------------------------------------- reducers are clean


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_every_reducer_runs_without_sync(shape: str, dtype: torch.dtype) -> None:
    x = make(shape, dtype)
    specs = SPECS if x.dim() >= 2 else NO_PER_CHANNEL if x.dim() == 1 else SCALAR_SPECS
    plan = ReducerPlan(build_reducers(specs))
    # Twice: the first run also builds per-device caches (edges, generator).
    for _ in range(2):
        with NoSyncMode(sample_op_limit=SAMPLE):
            out = plan.run(x)
    assert out.shape == (plan.width(x.shape),)
    assert len(plan.decode(out.numpy(), x.shape)) == len(specs)


def test_nonfinite_only_plan_runs_without_sync() -> None:
    plan = ReducerPlan(build_reducers(SPECS)).nonfinite_only()
    assert plan is not None
    with NoSyncMode(sample_op_limit=0):  # not even a sample-sized sort
        plan.run(torch.randn(4, 8, 24, 24))


def test_pass_buffer_finish_runs_without_sync() -> None:
    plan = ReducerPlan(build_reducers(SPECS))
    buf = PassBuffer()
    with NoSyncMode(sample_op_limit=SAMPLE):
        for i in range(3):
            buf.add(i, plan.run(torch.randn(2, 8, 30, 30)))
        pending = buf.finish()
    assert len(pending.wait()) == 3 * plan.width((2, 8, 30, 30))


# ------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_plan_and_collector_under_sync_debug_error() -> None:
    plan = ReducerPlan(build_reducers(SPECS))
    xs = [make(name, dt).cuda() for name in ("nchw_sampled", "channels_last_sampled", "small", "empty")
          for dt in (torch.float32, torch.bfloat16, torch.float16)]
    expected = [plan.decode(plan.run(x.cpu()).numpy(), x.shape) for x in xs]
    got: list[dict[object, np.ndarray]] = []
    gate = threading.Event()
    with HostTransfer(maxsize=8) as transfer:
        # Park the host-transfer thread so that event.synchronize() (its job, off
        # the model thread) happens after the debug mode is reset.
        transfer.submit(PassBuffer().finish(), lambda values: gate.wait(30))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(2):  # the first pass also fills caches and the pinned pool
                buf = PassBuffer()
                for i, x in enumerate(xs):
                    buf.add(i, plan.run(x))
                transfer.submit(buf.finish(), got.append)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            gate.set()
        assert transfer.flush(60)
        assert transfer.errors == 0, transfer.last_error
    assert len(got) == 2
    for values in got:
        for i, x in enumerate(xs):
            res = plan.decode(values[i], x.shape)
            ref = expected[i]
            # Deterministic reducers agree with the CPU run; float64 sums may
            # differ in order only (see test_reducers for the tolerance).
            scale = max(abs(ref[1].minmax.min), abs(ref[1].minmax.max), 1.0) if x.numel() else 1.0
            assert res[0].moments.count == ref[0].moments.count
            if res[0].moments.count:
                assert abs(res[0].moments.mean - ref[0].moments.mean) <= 1e-9 * scale
                assert abs(res[0].moments.std - ref[0].moments.std) <= 1e-9 * scale
            assert res[1:5] == ref[1:5]  # minmax, abs_max, zero_fraction, nonfinite
            assert sum(res[6].histogram.counts) == res[6].histogram.sample_size
