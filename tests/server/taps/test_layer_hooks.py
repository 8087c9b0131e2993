"""One hook per hooked layer for all taps (``taps.layer_hooks``): who fires, and when a tap starts.

The review cases of issue 43: a tap made during a training step (no model
lock) starts with the next pass and never goes silent, and a tap whose layer
does not run in a pass is given back that pass's sampling.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from layertap.server.host.model_host import ModelHost
from layertap.server.host.sources import load_model
from layertap.server.stream.broker import Broker, Subscription
from layertap.server.taps.engine import TapEngine
from layertap.server.taps.tap_files import reducer_spec
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit


def spec(selector: str, name: str, *reducers: str, every: int = 0) -> pb.TapSpec:
    return pb.TapSpec(name=name, selector=selector, reducers=[reducer_spec(r, "r") for r in reducers],
                      sampling=pb.Sampling(every_n=every))


def rig() -> tuple[ModelHost, Broker, TapEngine]:
    host = ModelHost(load_model("demo"))
    broker = Broker(default_queue_size=10_000)
    return host, broker, TapEngine(host, broker, rng=random.Random(0))


def training_steps(host: ModelHost, n: int) -> None:
    """Passes as a training loop runs them: no model lock, so taps may change mid-pass."""
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    for i in range(n):
        ctx = host.begin_pass(step=i)
        with torch.no_grad():
            host.module(x)
        host.end_pass(ctx)


def drained(engine: TapEngine, sub: Subscription) -> Counter[tuple[str, int, str]]:
    assert engine.flush(10)
    out: Counter[tuple[str, int, str]] = Counter()
    while (batch := sub.get(timeout=0)) is not None:
        out.update((s.tap, s.pass_index, s.layer) for s in batch.summaries if not s.unsampled)
    return out


def once(fn: Callable[[], None]) -> Callable[..., None]:
    done: list[bool] = []

    def hook(*_args: object) -> None:
        if not done:
            done.append(True)
            fn()
    return hook


def test_a_tap_made_mid_step_while_another_goes_starts_with_the_next_pass_and_stays() -> None:
    """Delete one tap and make another on the same layer during a step (a baseline replaced): the new one
    must fire from the next pass on, though the count of taps, and which are on, look the same."""
    host, broker, engine = rig()
    for name, layer in (("D", "conv1"), ("A", "layer4"), ("B", "layer4")):
        engine.create(spec(layer, name, "histogram"), owner="u")
    sub = broker.subscribe(["A", "B", "C", "D"])

    def swap() -> None:
        engine.delete("A")
        engine.create(spec("layer4", "C", "histogram"), owner="u")

    host.modules["layer1"].register_forward_hook(once(swap))
    training_steps(host, 5)
    got = drained(engine, sub)
    assert {p for (t, p, _l) in got if t == "C"} == {1, 2, 3, 4}
    assert {p for (t, p, _l) in got if t == "B"} == {0, 1, 2, 3, 4}
    engine.close()


def test_a_tap_made_mid_step_never_publishes_part_of_that_pass() -> None:
    host, broker, engine = rig()
    engine.create(spec("conv1", "D", "histogram"), owner="u")  # plan path: the pass starts at conv1
    engine.create(spec("re:layer4|fc", "B", "moments"), owner="u")  # the op layout, later in the pass
    sub = broker.subscribe(["C"])
    host.modules["bn1"].register_forward_hook(once(
        lambda: engine.create(spec("re:conv1|layer4|fc", "C", "moments"), owner="u")))
    training_steps(host, 3)
    got = drained(engine, sub)
    assert sorted(got) == [("C", p, layer) for p in (1, 2) for layer in ("conv1", "fc", "layer4")]
    engine.close()


def test_a_pass_that_skips_a_taps_layer_takes_none_of_its_sampling() -> None:
    """every_n=2 on a branch that runs on odd passes only: the tap samples every other pass it sees
    (1, 5, 9), not never, as when each tap was decided at its own first firing."""
    host, broker, engine = rig()
    seq = host.module.layer1
    calls = {"i": 0}

    def forward(x: torch.Tensor) -> torch.Tensor:
        x = seq[0](x)
        return seq[1](x) if calls["i"] % 2 == 1 else x

    seq.forward = forward
    engine.create(spec("conv1", "A", "histogram"), owner="u")
    engine.create(spec("layer1.1", "B", "histogram", every=2), owner="u")
    sub = broker.subscribe(["A", "B"])
    for i in range(10):
        calls["i"] = i
        host.run([torch.randn(2, 3, 32, 32)])
    got = drained(engine, sub)
    assert sorted(p for (t, p, _l) in got if t == "B") == [1, 5, 9]
    assert len([k for k in got if k[0] == "A"]) == 10
    engine.close()


def test_the_pass_end_reduction_of_small_tensors_is_charged_to_their_taps(monkeypatch) -> None:
    """Small tensors of basic plans are reduced together when the pass ends (``reducers.batched``): that
    time is the taps' (the overhead budget thins it), not the floor no stride can cut."""
    from layertap.server.reducers.batched import PassBatch

    host, broker, engine = rig()
    engine.use_op = False  # the plan path, where small tensors wait for the pass's end
    real = PassBatch.finish

    def slow_finish(batch: PassBatch, *args: object) -> list[int]:
        time.sleep(0.05)  # a batch that costs at least 50 ms
        return real(batch, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(PassBatch, "finish", slow_finish)
    tap = engine.create(spec("layer4", "A", "moments"), owner="u")  # (2, 128, 2, 2): a small tensor
    training_steps(host, 1)
    tap.settle()
    assert tap.cost.sampled_seconds >= 0.05
    engine.close()
