"""The tap engine in process: sampling, lifetimes, failure isolation, gradients, no sync."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from support.sync_guard import NoSyncMode, SyncError

from layertap.server.errors import InvalidField, NotFound
from layertap.server.host.model_host import ModelHost
from layertap.server.host.sources import load_model
from layertap.server.stream.broker import Broker
from layertap.server.taps.engine import TapEngine
from layertap.server.taps.tap_files import load_tap_config, reducer_spec
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def spec(selector: str, *reducers: str, point: int = pb.POINT_OUTPUT, every: int = 0,
         probability: float = 0.0, rate: float = 0.0, name: str = "") -> pb.TapSpec:
    return pb.TapSpec(name=name, selector=selector, point=point,
                      reducers=[reducer_spec(r, "r") for r in reducers],
                      sampling=pb.Sampling(every_n=every, probability=probability, max_per_second=rate))


@pytest.fixture
def rig():
    host = ModelHost(load_model("demo"))
    broker = Broker(default_queue_size=10_000)
    clock = FakeClock()
    engine = TapEngine(host, broker, clock=clock, rng=random.Random(0))
    yield host, broker, engine, clock
    engine.close()


def run(host: ModelHost, n: int = 1, seed: int = 0, batch: int = 2) -> list[torch.Tensor]:
    xs = []
    for i in range(n):
        x = torch.from_numpy(np.random.default_rng(seed + i).standard_normal((batch, 3, 32, 32)).astype(np.float32))
        host.run([x])
        xs.append(x)
    return xs


def drain(sub) -> list[pb.Summary]:
    out = []
    while (b := sub.get(timeout=0)) is not None:
        out.extend(b.summaries)
    return out


def test_moments_match_float64_reference(rig):
    host, broker, engine, _ = rig
    tap = engine.create(spec("layer*", "moments", "minmax", "zero_fraction", "nonfinite"))
    assert tap.layers == ["layer1", "layer2", "layer3", "layer4"]
    sub = broker.subscribe([tap.id])
    captured = {}
    handles = [host.modules[n].register_forward_hook(
        lambda _m, _a, o, _n=n: captured.__setitem__(_n, o.detach().double().numpy().copy())) for n in tap.layers]
    run(host, 1)
    for h in handles:
        h.remove()
    assert engine.flush(5)
    summaries = drain(sub)
    assert {s.layer for s in summaries} == set(tap.layers)
    for s in summaries:
        ref = captured[s.layer]
        res = {r.WhichOneof("value"): r for r in s.results}
        assert res["moments"].moments.count == ref.size
        np.testing.assert_allclose(res["moments"].moments.mean, ref.mean(), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(res["moments"].moments.std, ref.std(), rtol=1e-9)
        assert res["minmax"].minmax.min == ref.min() and res["minmax"].minmax.max == ref.max()
        np.testing.assert_allclose(res["zero_fraction"].zero_fraction.fraction, (ref == 0).mean(), rtol=0, atol=1e-15)
        assert res["nonfinite"].nonfinite.nan_count == 0


def test_every_n_is_exact_and_nonfinite_runs_on_every_pass(rig):
    host, broker, engine, _ = rig
    tap = engine.create(spec("fc", "moments", "nonfinite", every=3))
    sub = broker.subscribe([tap.id])
    run(host, 10)
    engine.flush(5)
    summaries = drain(sub)
    assert len(summaries) == 10  # nonfinite on every live pass
    sampled = [s for s in summaries if not s.unsampled]
    assert len(sampled) == 4  # passes 0, 3, 6, 9 of the tap
    assert all(len(s.results) == 1 and s.results[0].HasField("nonfinite") for s in summaries if s.unsampled)
    assert engine.get(tap.id).hits == 4


def test_probability_within_binomial_bounds(rig):
    host, _broker, engine, _ = rig
    tap = engine.create(spec("fc", "moments", probability=0.3))
    n = 400
    hits = sum(tap.sampler.sample() for _ in range(n))
    sd = (n * 0.3 * 0.7) ** 0.5
    assert abs(hits - n * 0.3) < 5 * sd


def test_rate_cap_holds_with_injected_clock(rig):
    host, _broker, engine, clock = rig
    tap = engine.create(spec("fc", "moments", rate=2.0))
    sampled = 0
    for _ in range(100):  # 100 passes over 10 simulated seconds
        clock.now += 0.1
        sampled += tap.sampler.sample()
    # Burst of 2 plus 2/s for 10 s.
    assert 18 <= sampled <= 22


def test_ttl_expiry_removes_hooks(rig):
    host, _broker, engine, clock = rig
    engine.create(spec("layer1", "moments", name="short"), ttl=5)
    engine.create(spec("layer2", "moments", name="keep"), forever=True)
    assert host.hooks.active == 2
    clock.now += 4.9
    assert engine.expire() == []
    clock.now += 0.2
    assert engine.expire() == ["short"]
    assert host.hooks.active == 1
    assert [t.id for t in engine.all_taps()] == ["keep"]


def test_default_ttl_is_ten_minutes(rig):
    _host, _broker, engine, clock = rig
    tap = engine.create(spec("fc", "moments"))
    assert tap.expires_at == pytest.approx(clock.now + 600)


def test_active_capture_passes_are_not_fed_to_taps(rig):
    host, broker, engine, _ = rig
    tap = engine.create(spec("fc", "moments"))
    sub = broker.subscribe([tap.id])
    x = torch.zeros(1, 3, 32, 32)
    host.run([x], active_owner=object())
    engine.flush(5)
    assert drain(sub) == []
    run(host, 1)
    engine.flush(5)
    assert len(drain(sub)) == 1


def test_throwing_reducer_disables_tap_not_inference(rig):
    host, broker, engine, _ = rig
    bad = engine.create(spec("layer4", "moments", name="ok"))
    engine.create(pb.TapSpec(name="broken", selector="layer4", reducers=[
        pb.ReducerSpec(kind=pb.REDUCER_KIND_PER_CHANNEL, per_channel=pb.PerChannelParams(dim=7))]))
    sub = broker.subscribe(["ok", "broken"])
    run(host, 2)  # inference still succeeds
    engine.flush(5)
    info = engine.get("broken")
    assert info.disabled and info.errors == 1 and "layer4" in info.last_error
    assert engine.reducer_errors == 1
    assert engine.get(bad.id).hits == 2
    events = []
    while (b := sub.get(timeout=0)) is not None:
        events.extend(b.events)
    assert [(e.tap, e.kind) for e in events] == [("broken", "disabled")]
    assert host.hooks.active == 1  # the broken tap's hook is gone


def test_bad_specs_name_the_field(rig):
    _host, _broker, engine, _ = rig
    with pytest.raises(NotFound, match="layer4"):
        engine.create(spec("layer9", "moments"))
    with pytest.raises(InvalidField) as info:
        engine.create(pb.TapSpec(selector="fc", reducers=[pb.ReducerSpec(
            kind=pb.REDUCER_KIND_HISTOGRAM, histogram=pb.HistogramParams(bins=10, min=1, max=0))]))
    assert info.value.field.startswith("spec.reducers[0].histogram")
    with pytest.raises(InvalidField, match="spec.sampling.probability"):
        engine.create(spec("fc", "moments", probability=2))
    with pytest.raises(InvalidField, match="spec.reducers"):
        engine.create(pb.TapSpec(selector="fc"))


def test_subscriber_that_never_reads_drops_exactly_n_minus_queue(rig):
    host, broker, engine, _ = rig
    tap = engine.create(spec("fc", "moments"))
    slow = broker.subscribe([tap.id], queue_size=4)
    fast = broker.subscribe([tap.id], queue_size=1000)
    n = 25
    run(host, n)
    engine.flush(5)
    assert slow.dropped == n - 4
    assert slow.pending() == 4
    assert len(drain(fast)) == n and fast.dropped == 0
    assert broker.dropped_total == n - 4


def test_gradient_points_match_autograd(rig):
    host, broker, engine, _ = rig
    taps = {
        "go": engine.create(spec("layer4", "moments", "norm", point=pb.POINT_GRAD_OUTPUT, name="go")),
        "gi": engine.create(spec("fc", "moments", point=pb.POINT_GRAD_INPUT, name="gi")),
        "pg": engine.create(spec("fc", "moments", "norm", point=pb.POINT_PARAM_GRAD, name="pg")),
    }
    sub = broker.subscribe(list(taps))
    model = host.module
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    target = torch.tensor([1, 2, 3, 4])
    refs = {}
    h = model.layer4.register_full_backward_hook(lambda _m, _gi, go: refs.__setitem__("go", go[0].detach().double().clone()))
    h2 = model.fc.register_full_backward_hook(lambda _m, gi, _go: refs.__setitem__("gi", gi[0].detach().double().clone()))
    model.zero_grad()
    with host.pass_context(step=7):
        loss = torch.nn.functional.cross_entropy(model(x), target)
        loss.backward()
    h.remove()
    h2.remove()
    engine.flush(5)
    got = drain(sub)
    assert all(s.step == 7 and s.has_step for s in got)
    by = {(s.tap, s.output_index): {r.WhichOneof("value"): r for r in s.results} for s in got}
    go = refs["go"].numpy()
    np.testing.assert_allclose(by[("go", 0)]["moments"].moments.mean, go.mean(), rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(by[("go", 0)]["norm"].norm.l2, np.linalg.norm(go.ravel()), rtol=1e-9)
    np.testing.assert_allclose(by[("gi", 0)]["moments"].moments.std, refs["gi"].numpy().std(), rtol=1e-9)
    names = [n for n, _ in model.fc.named_parameters()]
    for i, pname in enumerate(names):
        grad = getattr(model.fc, pname).grad.double().numpy()
        np.testing.assert_allclose(by[("pg", i)]["norm"].norm.l2, np.linalg.norm(grad.ravel()), rtol=1e-9)
    assert sorted(k[1] for k in by if k[0] == "pg") == list(range(len(names)))


ALL_REDUCERS = ["moments", "minmax", "abs_max", "zero_fraction", "nonfinite", "norm",
                "histogram", "quantiles", "per_channel"]


def test_tapped_forward_with_every_reducer_never_syncs(rig):
    host, broker, engine, _ = rig
    tap = engine.create(spec("**", *ALL_REDUCERS))  # every module
    sub = broker.subscribe([tap.id])
    x = torch.randn(2, 3, 32, 32)
    host.validate_inputs([x])
    with NoSyncMode(), host.pass_context(), torch.inference_mode():
        host.module(x)
    # A SyncError inside a hook is caught like any reducer error (inference
    # must not fail), so prove none happened: no error, and every call summarized.
    engine.flush(5)
    assert engine.reducer_errors == 0 and not tap.disabled, tap.last_error
    calls = sum(1 for _ in drain(sub))
    assert calls >= len(tap.layers)
    with pytest.raises(SyncError), NoSyncMode():
        torch.ones(3).sum().item()


def test_tap_config_yaml(tmp_path, rig):
    _host, _broker, engine, _ = rig
    path = tmp_path / "taps.yaml"
    path.write_text(
        "taps:\n"
        "  - name: blocks\n"
        "    selector: 'layer*.*'\n"
        "    point: output\n"
        "    reducers: [moments, nonfinite, {histogram: {bins: 16, min: -4, max: 4}}]\n"
        "    sampling: {every_n: 10}\n"
    )
    (only,) = load_tap_config(path)
    assert only.sampling.every_n == 10 and only.reducers[2].histogram.bins == 16
    tap = engine.create(only, forever=True)
    assert tap.layers == ["layer1.0", "layer1.1", "layer2.0", "layer2.1", "layer3.0", "layer3.1", "layer4.0", "layer4.1"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("taps:\n  - selector: fc\n    reducers: [momentz]\n")
    with pytest.raises(InvalidField, match=r"taps\[0\]\.reducers\[0\].*momentz"):
        load_tap_config(bad)


def test_collector_overflow_counts_one_drop_per_tap_per_lost_pass():
    import threading

    from layertap.server.stream.sinks import Sink, Sinks

    gate = threading.Event()
    entered = threading.Event()

    class SlowSink(Sink):
        def on_summaries(self, ctx, summaries):
            entered.set()
            gate.wait(10)

    sinks = Sinks()
    sinks.add(SlowSink())
    host = ModelHost(load_model("demo"))
    engine = TapEngine(host, Broker(), transfer_queue=1, sinks=sinks)
    tap = engine.create(spec("layer*", "moments"))  # 4 layers, one tap
    try:
        run(host, 1)
        assert entered.wait(5)  # pass 0 is in the sink, blocked
        run(host, 3)  # pass 1 queued, then pushed out by 2, which is pushed out by 3
        assert tap.drops == 2
        gate.set()
        engine.flush(5)
        assert tap.hits == 2  # passes 0 and 3
    finally:
        gate.set()
        engine.close()


def test_module_called_twice_per_pass_gets_call_indices(rig):
    host, broker, engine, _ = rig
    tap = engine.create(spec("layer1.0.relu", "moments"))
    sub = broker.subscribe([tap.id])
    seen = []
    h = host.modules["layer1.0.relu"].register_forward_hook(
        lambda _m, _a, o: seen.append(o.detach().double().numpy().copy()))
    run(host, 1)
    h.remove()
    engine.flush(5)
    got = sorted(drain(sub), key=lambda s: s.call_index)
    assert [s.call_index for s in got] == [0, 1] and len(seen) == 2
    for s, ref in zip(got, seen):
        np.testing.assert_allclose(s.results[0].moments.mean, ref.mean(), rtol=1e-9)


def test_failed_forward_publishes_nothing(rig):
    host, broker, engine, _ = rig
    tap = engine.create(spec("layer1", "moments"))
    sub = broker.subscribe([tap.id])
    with pytest.raises(RuntimeError, match="boom"):
        with host.pass_context(), torch.inference_mode():
            host.module(torch.zeros(1, 3, 32, 32))
            raise RuntimeError("boom")
    engine.flush(5)
    assert drain(sub) == []
    run(host, 1)
    engine.flush(5)
    assert len(drain(sub)) == 1


def test_expiry_tells_subscribers_at_once_and_ends_their_streams(rig):
    host, broker, engine, clock = rig
    engine.create(spec("fc", "moments", name="t1"), ttl=5)
    everyone = broker.subscribe(None)  # all durable taps
    only = broker.subscribe(["t1"])
    clock.now += 6
    assert engine.expire() == ["t1"]
    for sub in (everyone, only):
        batch = sub.get(timeout=0)
        assert batch is not None and [(e.tap, e.kind) for e in batch.events] == [("t1", "expired")]
    assert only.closed and only.get(timeout=0) is None
    assert not everyone.closed
