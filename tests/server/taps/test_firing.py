"""A basic tap's firing is one ``layertap::tap_stats`` call (``taps.firing``).

Each test runs real passes through a ``ModelHost`` and a ``TapEngine`` and
checks what the op path publishes against float64 numpy of the tensor the
layer returned, how many ops a pass dispatches, and what stays on the plan path.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from layertap.server.host.model_host import ModelHost
from layertap.server.host.sources import InputSpec, LoadedModel
from layertap.server.stream.broker import Broker
from layertap.server.taps import firing
from layertap.server.taps.engine import TapEngine
from layertap.server.taps.tap_files import reducer_spec
from layertap.v1 import telemetry_pb2 as pb
from tests.support.summaries import drain, results
from tests.support.tensors import gen

pytestmark = pytest.mark.unit

BASIC = ("moments", "minmax", "zero_fraction", "nonfinite")
WIDTH = 32


class Stack(nn.Module):
    """Four linear layers; ``twice`` is called two times a pass, ``relu`` writes ``a``'s output in place."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.relu = nn.ReLU(inplace=True)
        self.b = nn.Linear(WIDTH, WIDTH)
        self.twice = nn.Linear(WIDTH, WIDTH)
        self.c = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(self.relu(self.a(x)))
        return self.c(self.twice(self.twice(h)))


@pytest.fixture
def rig() -> tuple[ModelHost, Broker, TapEngine]:
    torch.manual_seed(0)
    host = ModelHost(LoadedModel(Stack().eval(), "stack", "test", [InputSpec("input", torch.float32, (-1, WIDTH))]))
    broker = Broker(default_queue_size=10_000)
    engine = TapEngine(host, broker, rng=random.Random(0))
    yield host, broker, engine
    engine.close()


def tap(engine: TapEngine, selector: str, *reducers: str, every: int = 0) -> object:
    return engine.create(pb.TapSpec(selector=selector, reducers=[reducer_spec(r, "r") for r in reducers],
                                    sampling=pb.Sampling(every_n=every)))


def outputs(host: ModelHost, x: torch.Tensor) -> dict[str, list[np.ndarray]]:
    """Each layer's outputs in call order, copied as the layer returned them (a plain torch hook)."""
    seen: dict[str, list[np.ndarray]] = {}
    handles = [host.modules[n].register_forward_hook(
        lambda _m, _a, o, n=n: seen.setdefault(n, []).append(o.detach().double().numpy().copy()))
        for n in ("a", "b", "twice", "c")]
    try:
        host.run([x])
    finally:
        for h in handles:
            h.remove()
    return seen


def check_basic(summary: pb.Summary, ref: np.ndarray) -> None:
    r = results(summary)
    fin = ref[np.isfinite(ref)]
    np.testing.assert_allclose(r["moments"].moments.mean, fin.mean(), rtol=1e-9)
    np.testing.assert_allclose(r["moments"].moments.std, fin.std(), rtol=1e-8)
    assert (r["minmax"].minmax.min, r["minmax"].minmax.max) == (fin.min(), fin.max())
    assert r["zero_fraction"].zero_fraction.fraction == (ref == 0).mean()
    nonfinite = r["nonfinite"].nonfinite
    assert (nonfinite.nan_count, nonfinite.inf_count) == (np.isnan(ref).sum(), np.isinf(ref).sum())


class Dispatched(TorchDispatchMode):
    """The ops dispatched while it is on, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def dispatched(host: ModelHost, x: torch.Tensor) -> list[str]:
    """The ops a pass dispatches inside the model's forward, on the model thread (a mode is per thread)."""
    mode = Dispatched()
    pre = host.module.register_forward_pre_hook(lambda _m, _a: mode.__enter__() and None)
    post = host.module.register_forward_hook(lambda _m, _a, _o: mode.__exit__(None, None, None) and None)
    try:
        host.run([x])
    finally:
        pre.remove()
        post.remove()
    return mode.ops


def test_every_call_of_every_layer_is_published_as_numpy_says(rig) -> None:
    host, broker, engine = rig
    t = tap(engine, "re:^(a|b|c|twice)$", *BASIC)
    sub = broker.subscribe([t.id])
    x = torch.randn(3, WIDTH, generator=gen(1))
    x[0, 0] = math.nan  # a NaN flows into every later layer's row 0
    host.run([x])
    engine.flush()
    drain(engine, sub)  # the first pass grew the layout for `twice`'s second call
    ref = outputs(host, x)
    got = {(s.layer, s.call_index): s for s in drain(engine, sub)}
    assert sorted(got) == [("a", 0), ("b", 0), ("c", 0), ("twice", 0), ("twice", 1)]
    assert np.nanmin(ref["a"][0]) < 0  # the in-place ReLU zeroes these after a's hook: a late read would say min 0
    for (layer, call), summary in got.items():
        check_basic(summary, ref[layer][call])


def test_a_firing_dispatches_one_op_and_a_pass_a_constant_more(rig) -> None:
    host, _broker, engine = rig
    x = torch.randn(2, WIDTH, generator=gen(2))
    host.run([x])
    base = dispatched(host, x)
    tap(engine, "a", *BASIC)
    host.run([x])
    one = dispatched(host, x)
    tap(engine, "[bc]", "moments")
    host.run([x])
    three = dispatched(host, x)
    # Inside the forward, each firing adds its op call and nothing else (the pass's constant, the
    # copy of the rows and their reset, comes after the forward).
    assert [op for op in one if op != "layertap.tap_stats.default"] == base
    assert one.count("layertap.tap_stats.default") == 1
    assert [op for op in three if op != "layertap.tap_stats.default"] == base
    assert three.count("layertap.tap_stats.default") == 3


def test_a_sampled_and_an_unsampled_pass_dispatch_the_same_ops(rig) -> None:
    host, broker, engine = rig
    t = tap(engine, "[ab]", "moments", "minmax", every=2)
    sub = broker.subscribe([t.id])
    x = torch.randn(2, WIDTH, generator=gen(3))
    seqs = [dispatched(host, x) for _ in range(4)]
    got = drain(engine, sub)
    assert len(got) == 4  # passes 0 and 2, two layers each
    assert seqs[0] == seqs[1] == seqs[2] == seqs[3]
    assert seqs[1].count("layertap.tap_stats.default") == 2


def test_taps_on_one_layer_share_one_call_and_each_gets_its_summary(rig, monkeypatch) -> None:
    host, broker, engine = rig
    taps = [tap(engine, "b", *BASIC) for _ in range(5)] + [tap(engine, "b", "moments", every=2)]
    sub = broker.subscribe([t.id for t in taps])
    calls: list[int] = []
    real = firing.tap_stats_op
    monkeypatch.setattr(firing, "tap_stats_op", lambda *a: (calls.append(1), real(*a)))
    x = torch.randn(4, WIDTH, generator=gen(4))
    ref = outputs(host, x)["b"][0]
    got = drain(engine, sub)
    assert len(calls) == 1 and len(got) == 6  # the every=2 tap's first pass is sampled
    for s in got:
        if s.tap != taps[-1].id:
            check_basic(s, ref)


def test_a_failing_op_disables_its_taps_and_inference_goes_on(rig, monkeypatch) -> None:
    host, broker, engine = rig
    basic, hist = tap(engine, "a", *BASIC), tap(engine, "c", "histogram")
    sub = broker.subscribe([basic.id, hist.id])

    def boom(*_a: object) -> None:
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(firing, "tap_stats_op", boom)
    out, _ctx = host.run([torch.randn(2, WIDTH, generator=gen(5))])
    assert out.shape == (2, WIDTH)
    assert basic.disabled and "kernel exploded" in basic.last_error and engine.reducer_errors == 1
    assert [s.tap for s in drain(engine, sub)] == [hist.id]
    host.run([torch.randn(2, WIDTH, generator=gen(6))])
    assert [s.tap for s in drain(engine, sub)] == [hist.id]


def test_what_the_op_cannot_serve_keeps_the_plan_path(rig, monkeypatch) -> None:
    host, broker, engine = rig
    basic, hist = tap(engine, "a", *BASIC), tap(engine, "b", "moments", "histogram")
    half = host.module.b.half()  # a float16 layer's output: still the op
    del half
    sub = broker.subscribe([basic.id, hist.id])
    ops: list[tuple[int, ...]] = []
    real = firing.tap_stats_op
    monkeypatch.setattr(firing, "tap_stats_op", lambda x, *a: (ops.append(tuple(x.shape)), real(x, *a)))
    layout = engine._layout
    assert layout is not None and {f.tap.id for f in layout.firings} == {basic.id}
    x = torch.randn(2, WIDTH, generator=gen(7))
    host.module.b.float()
    host.run([x])
    assert ops == [(2, WIDTH)] and sorted(s.tap for s in drain(engine, sub)) == sorted([basic.id, hist.id])
    engine.delete(basic.id)
    host.run([x])
    assert engine._layout is None and len(ops) == 1  # the pass after a delete rebuilt the layout without it
