"""Reuse of a reduction within a pass: only where the tensor is provably the one already reduced.

Every summary is compared with a float64 numpy reference of the tensor the
layer really produced, so a wrong reuse (stale values) fails here.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from layertap.server.host.model_host import ModelHost
from layertap.server.host.sources import InputSpec, LoadedModel, load_model
from layertap.server.stream.broker import Broker
from layertap.server.taps.engine import TapEngine
from layertap.server.taps.reuse import passthrough_parents
from layertap.server.taps.tap_files import reducer_spec
from layertap.v1 import telemetry_pb2 as pb
from tests.support.reductions import count_reductions

pytestmark = pytest.mark.unit

BASIC = ("moments", "minmax", "nonfinite")


def spec(selector: str, *reducers: str) -> pb.TapSpec:
    return pb.TapSpec(selector=selector, reducers=[reducer_spec(r, "r") for r in reducers])


def rig(module: nn.Module, shape: tuple[int, ...]) -> tuple[ModelHost, Broker, TapEngine]:
    host = ModelHost(LoadedModel(module.eval(), "m", "test", [InputSpec("input", torch.float32, shape)]))
    broker = Broker(default_queue_size=10_000)
    engine = TapEngine(host, broker, rng=random.Random(0))
    engine.use_op = False  # the plan path's reuse; tests/server/taps/test_firing.py covers the op path's sharing
    return host, broker, engine


def outputs_of(host: ModelHost, layers: list[str]) -> tuple[dict[tuple[str, int], np.ndarray], list]:
    """Registers reference hooks (after the taps'): each call's output as float64, read when it fires."""
    seen: dict[tuple[str, int], np.ndarray] = {}
    calls: dict[str, int] = {}

    def keep(name: str, out: torch.Tensor) -> None:
        n = calls.get(name, 0)
        calls[name] = n + 1
        seen[(name, n)] = out.detach().double().numpy().copy()

    handles = [host.modules[n].register_forward_hook(lambda _m, _a, o, _n=n: keep(_n, o)) for n in layers]
    return seen, handles


def summaries(engine: TapEngine, sub) -> list[pb.Summary]:
    assert engine.flush(10)
    out = []
    while (b := sub.get(timeout=0)) is not None:
        out.extend(b.summaries)
    return out


def check(s: pb.Summary, ref: np.ndarray) -> None:
    res = {r.WhichOneof("value"): r for r in s.results}
    np.testing.assert_allclose(res["moments"].moments.mean, ref.mean(), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(res["moments"].moments.std, ref.std(), rtol=1e-9, atol=1e-12)
    assert res["minmax"].minmax.min == ref.min() and res["minmax"].minmax.max == ref.max()


def test_passthrough_parents_are_plain_sequentials_only() -> None:
    class Doubled(nn.Sequential):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    patched = nn.Sequential(nn.Linear(2, 2))
    patched.forward = lambda x: nn.Sequential.forward(patched, x).neg_()  # type: ignore[method-assign]
    compiled = nn.Sequential(nn.Linear(2, 2))
    compiled.compile()  # compiles at its first call, which never comes here
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), Doubled(nn.Linear(2, 2)), nn.Sequential(),
                          patched, compiled)
    assert passthrough_parents(dict(model.named_modules())) == {"0": "0.1"}  # "" (the root) is never hooked
    demo = dict(load_model("demo").module.named_modules())
    assert passthrough_parents(demo) == {
        "layer1": "layer1.1", "layer2": "layer2.1", "layer3": "layer3.1", "layer4": "layer4.1",
        **{f"layer{i}.0.downsample": f"layer{i}.0.downsample.1" for i in (2, 3, 4)}}


def test_a_stage_and_its_last_block_and_two_equal_taps_share_reductions(monkeypatch) -> None:
    host, broker, engine = rig(load_model("demo").module, (-1, 3, 32, 32))
    taps = [engine.create(spec(sel, *BASIC)) for sel in ("layer1.1", "layer1", "layer2", "layer2")]
    other = engine.create(spec("layer2", "moments", "minmax", "nonfinite", "zero_fraction"))  # another plan
    sub = broker.subscribe([t.id for t in [*taps, other]])
    runs: list[str] = []
    count_reductions(monkeypatch, lambda plan, _t: runs.append(repr(plan)))
    seen, handles = outputs_of(host, ["layer1.1", "layer1", "layer2"])
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((4, 3, 32, 32)).astype(np.float32))
    host.run([x])
    host.run([x * 3])
    for h in handles:
        h.remove()
    got = summaries(engine, sub)
    assert len(got) == 10
    passes = sorted({s.pass_index for s in got})
    for s in got:  # the reference hooks count both passes as calls 0 and 1
        check(s, seen[(s.layer, passes.index(s.pass_index))])
    # Per pass: layer1.1, layer2 and the other plan ran; layer1 and the second layer2 tap reused.
    assert len(runs) == 6 and engine.plans.reuse.reused == 4


def test_reuse_follows_each_pass_not_the_first() -> None:
    host, broker, engine = rig(load_model("demo").module, (-1, 3, 32, 32))
    taps = [engine.create(spec(sel, *BASIC)) for sel in ("layer4.1", "layer4")]
    sub = broker.subscribe([t.id for t in taps])
    refs = []
    for scale in (1.0, -5.0):
        seen, handles = outputs_of(host, ["layer4"])
        x = torch.from_numpy(np.random.default_rng(1).standard_normal((2, 3, 32, 32)).astype(np.float32) * scale)
        host.run([x])
        for h in handles:
            h.remove()
        refs.append(seen[("layer4", 0)])
    got = summaries(engine, sub)
    by_pass = sorted({s.pass_index for s in got})
    for s in got:
        check(s, refs[by_pass.index(s.pass_index)])


def test_a_container_that_writes_its_output_in_place_is_reduced_afresh() -> None:
    class Negated(nn.Sequential):  # not a plain Sequential: its forward writes the child's output in place
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x).neg_()

    host, broker, engine = rig(nn.Sequential(Negated(nn.Linear(8, 8))), (-1, 8))
    taps = [engine.create(spec(sel, *BASIC)) for sel in ("0.0", "0")]
    sub = broker.subscribe([t.id for t in taps])
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((16, 8)).astype(np.float32))
    with torch.inference_mode():
        child = host.module[0][0](x).double().numpy()
    host.run([x])  # inference mode: no version counter to catch the write
    got = {s.layer: s for s in summaries(engine, sub)}
    check(got["0.0"], child)
    check(got["0"], -child)
    assert engine.plans.reuse.reused == 0


def test_an_in_place_write_between_firings_is_caught_by_the_version() -> None:
    host, broker, engine = rig(nn.Sequential(nn.Sequential(nn.Linear(8, 8))), (-1, 8))
    taps = [engine.create(spec(sel, *BASIC)) for sel in ("0.0", "0")]
    sub = broker.subscribe([t.id for t in taps])
    # Someone else's hook on the child, after the tap's, doubles the output in place.
    def double(_m: nn.Module, _a: object, out: torch.Tensor) -> None:
        out.mul_(2)

    host.modules["0.0"].register_forward_hook(double)
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((16, 8)).astype(np.float32))
    with torch.no_grad():
        child = host.module[0][0](x).double().numpy() / 2  # the reference ran the doubling hook too
        with host.pass_context():  # grad mode off, not inference mode: tensors carry versions
            host.module(x)
    got = {s.layer: s for s in summaries(engine, sub)}
    check(got["0.0"], child)
    check(got["0"], 2 * child)
    assert engine.plans.reuse.reused == 0


@pytest.mark.parametrize("inference", [True, False])
def test_a_module_called_twice_on_one_object_is_reduced_per_call(inference: bool) -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act = nn.ReLU(inplace=True)  # returns its input object

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.act(x + 1)
            y.sub_(10)
            return self.act(y)  # the same object again, now all zeros

    host, broker, engine = rig(Twice(), (-1, 8))
    taps = [engine.create(spec("act", *BASIC)) for _ in range(2)]
    sub = broker.subscribe([t.id for t in taps])
    x = torch.from_numpy(np.random.default_rng(4).uniform(-1, 1, (16, 8)).astype(np.float32))
    first = np.maximum(x.numpy() + np.float32(1), 0)  # float32, as the model computes
    with torch.inference_mode(inference), host.pass_context():
        host.module(x)
    got = summaries(engine, sub)
    assert sorted(s.call_index for s in got) == [0, 0, 1, 1]
    for s in got:
        check(s, (first if s.call_index == 0 else np.maximum(first - np.float32(10), 0)).astype(np.float64))
    assert engine.plans.reuse.reused == 2  # the second tap, once per call
