"""Training hosts in process: steps as passes, gradient points, the in-place guard, names."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from support.training import batches, inplace_net, train_steps
from torch import nn

from layertap.server.host.model_host import ModelHost
from layertap.server.host.sources import LoadedModel
from layertap.server.stream.broker import Broker
from layertap.server.taps.engine import TapEngine
from layertap.server.taps.tap_files import reducer_spec
from layertap.server.train.labels import LabelledRegistry
from layertap.server.train.names import unwrap
from layertap.server.train.ranks import Rank
from layertap.server.train.steps import StepTracker
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit


class Rig:
    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer | None, start_step: int = 0) -> None:
        self.host = ModelHost(LoadedModel(model, "m", "training", []), training=True)
        self.broker = Broker(default_queue_size=100_000)
        self.engine = TapEngine(self.host, self.broker)
        self.steps = StepTracker(self.host, opt, start_step=start_step)
        self.sub = self.broker.subscribe(None, 100_000)

    def tap(self, name: str, selector: str, point: int, *reducers: str) -> None:
        self.engine.create(pb.TapSpec(name=name, selector=selector, point=point,
                                      reducers=[reducer_spec(r, "r") for r in reducers or ("norm",)]))

    def summaries(self) -> list[pb.Summary]:
        assert self.engine.flush(10)
        out = []
        while (b := self.sub.get(timeout=0)) is not None:
            out.extend(b.summaries)
        return out

    def close(self) -> None:
        self.steps.close()
        self.engine.close()


@pytest.fixture
def rigs():
    made: list[Rig] = []

    def make(model: nn.Module, opt: torch.optim.Optimizer | None = None, **kw: int) -> Rig:
        made.append(Rig(model, opt, **kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


def l2(s: pb.Summary) -> float:
    return next(r.norm.l2 for r in s.results if r.WhichOneof("value") == "norm")


def test_full_backward_hooks_break_this_model():
    # The premise of the guard: torch's full backward hook raises in the forward.
    model = inplace_net()
    model.bn1.register_full_backward_hook(lambda *_: None)
    with pytest.raises(RuntimeError, match="modified inplace"):
        model(torch.randn(2, 3, 8, 8))


def test_inplace_relu_model_trains_with_every_point_tapped(rigs):
    model = inplace_net()
    twin = copy.deepcopy(model)
    for m in (twin.relu1, twin.relu2):
        m.inplace = False
    refs: dict[tuple[str, str], list[float]] = {}

    def ref(key: tuple[str, str], grads: tuple[torch.Tensor, ...]) -> None:
        refs.setdefault(key, []).append(float(torch.linalg.vector_norm(grads[0].double())))

    twin.bn1.register_full_backward_hook(lambda _m, _gi, go: ref(("go", "bn1"), go))
    twin.conv2.register_full_backward_hook(lambda _m, _gi, go: ref(("go", "conv2"), go))
    twin.relu1.register_full_backward_hook(lambda _m, gi, _go: ref(("gi", "relu1"), gi))
    twin.conv2.register_full_backward_hook(lambda _m, gi, _go: ref(("gi", "conv2"), gi))
    twin.fc.register_full_backward_hook(lambda _m, gi, _go: ref(("gi", "fc"), gi))
    outs: list[float] = []
    twin.bn1.register_forward_hook(lambda _m, _a, out: outs.append(float(torch.linalg.vector_norm(out.detach().double()))))

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rig = rigs(model, opt)
    rig.tap("go", "bn1", pb.POINT_GRAD_OUTPUT)
    rig.tap("go2", "conv2", pb.POINT_GRAD_OUTPUT)
    rig.tap("gi", "re:relu1|conv2|fc", pb.POINT_GRAD_INPUT)
    rig.tap("out", "bn1", pb.POINT_OUTPUT)
    rig.tap("in", "relu2", pb.POINT_INPUT)
    rig.tap("pg", "*", pb.POINT_PARAM_GRAD)
    train_steps(model, opt, batches(1), 3)
    train_steps(twin, torch.optim.SGD(twin.parameters(), lr=0.05), batches(1), 3)
    got = rig.summaries()
    assert rig.host.hooks.errors == 0 and rig.steps.errors == 0
    by: dict[tuple[str, str], list[float]] = {}
    for s in sorted(got, key=lambda s: s.step):
        assert s.has_step
        by.setdefault((s.tap, s.layer), []).append(l2(s))
    assert {k for k in by if k[0] in ("go", "go2", "gi", "out", "in")} == {
        ("go", "bn1"), ("go2", "conv2"), ("gi", "relu1"), ("gi", "conv2"), ("gi", "fc"), ("out", "bn1"), ("in", "relu2")}
    np.testing.assert_allclose(by[("go", "bn1")], refs[("go", "bn1")], rtol=1e-6)
    np.testing.assert_allclose(by[("go2", "conv2")], refs[("go", "conv2")], rtol=1e-6)
    for layer in ("relu1", "conv2", "fc"):
        np.testing.assert_allclose(by[("gi", layer)], refs[("gi", layer)], rtol=1e-6, err_msg=layer)
    np.testing.assert_allclose(by[("out", "bn1")], outs, rtol=1e-6)
    assert len(by[("in", "relu2")]) == 3
    # The model trained: the same parameters as its out-of-place twin.
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


def test_total_param_grad_norm_is_clip_grad_norm_with_accumulation(rigs):
    model = inplace_net(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rig = rigs(model, opt, start_step=10)
    rig.tap("pg", "*", pb.POINT_PARAM_GRAD)
    rig.tap("go", "fc", pb.POINT_GRAD_OUTPUT)
    clipped: list[float] = []

    def clip(_i: int) -> None:
        clipped.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=math.inf)))

    want = train_steps(model, opt, batches(2), 4, micro=3, on_grads=clip)
    got = rig.summaries()
    pg = [s for s in got if s.tap == "pg"]
    keys = [(s.step, s.layer, s.output_index) for s in pg]
    assert len(keys) == len(set(keys))  # each parameter read once per step, accumulated
    assert {s.call_index for s in pg} == {0}  # one read of every parameter, not one "call" each
    totals = {}
    for s in pg:
        totals[s.step] = totals.get(s.step, 0.0) + l2(s) ** 2
    assert sorted(totals) == [10, 11, 12, 13]
    got_norms = [math.sqrt(totals[k]) for k in sorted(totals)]
    np.testing.assert_allclose(got_norms, want, rtol=1e-9)
    np.testing.assert_allclose(got_norms, clipped, rtol=1e-5)
    # Every parameter once per step: "*" partitions the model's parameters.
    assert len(pg) == 4 * len(list(model.parameters()))
    go_calls = sorted((s.step, s.call_index) for s in got if s.tap == "go")
    assert go_calls == [(st, c) for st in range(10, 14) for c in range(3)]


def test_evaluation_forwards_are_not_observed(rigs):
    model = inplace_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rig = rigs(model, opt)
    rig.tap("out", "fc", pb.POINT_OUTPUT)
    data = batches(4)
    for _ in range(2):
        x, y = next(data)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            model(x)  # inside the step, grad off
        opt.step()
        model.eval()
        model(x)  # between steps, eval mode
        model.train()
    got = rig.summaries()
    assert sorted((s.step, s.call_index) for s in got) == [(0, 0), (1, 0)]
    assert rig.host.passes == 2


def test_marked_steps_without_optimizer(rigs):
    model = inplace_net()
    rig = rigs(model)
    rig.tap("pg", "fc", pb.POINT_PARAM_GRAD)
    data = batches(5)
    x, y = next(data)
    model(x)  # outside any step: not observed
    for i in (7, 9):
        with rig.steps.step(i) as ctx:
            assert ctx.step == i
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            want = float(torch.linalg.vector_norm(model.fc.weight.grad.double()))
    with pytest.raises(RuntimeError, match="do not nest"):
        with rig.steps.step(1), rig.steps.step(2):
            pass
    got = [s for s in rig.summaries() if s.output_index == 0]
    assert [s.step for s in got] == [7, 9]
    assert l2(got[-1]) == pytest.approx(want, rel=1e-9)


def test_step_numbers_are_int64_integers(rigs):
    # Summaries, capture headers and incidents carry the step as int64: a
    # float or an overflow is refused where it is handed over, not later on
    # the capture path (a TypeError inside the RPC) or in the recorder.
    rig = rigs(inplace_net())
    for bad, error in ((3.0, TypeError), (np.float64(3.0), TypeError), ("3", TypeError),
                       (1 << 63, ValueError), (-(1 << 63) - 1, ValueError)):
        with pytest.raises(error, match="step"):
            with rig.steps.step(bad):  # type: ignore[arg-type]
                pass
    with rig.steps.step(np.int64(5)) as ctx:  # numpy and torch integers are integers
        assert ctx.step == 5 and type(ctx.step) is int
    with rig.steps.step((1 << 63) - 1) as ctx:
        assert ctx.step == (1 << 63) - 1
    with pytest.raises(TypeError, match="start_step must be an integer"):
        StepTracker(rig.host, None, start_step=2.5)  # type: ignore[arg-type]


def test_a_step_number_past_int64_opens_no_pass_instead_of_wrapping(rigs):
    model = inplace_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rig = rigs(model, opt, start_step=(1 << 63) - 1)
    rig.tap("out", "fc", pb.POINT_OUTPUT)
    train_steps(model, opt, batches(3), 2)
    assert [s.step for s in rig.summaries()] == [(1 << 63) - 1]  # never -2**63 on the wire
    assert rig.steps.errors >= 1 and rig.host.passes == 1
    with pytest.raises(TypeError, match="bool"):
        StepTracker(rig.host, None, start_step=True)  # an int to Python, never a step


def test_a_loop_running_inside_an_except_block_publishes_every_step(rigs):
    """A retry path (``except OutOfMemoryError:`` then train on) has an exception in
    flight on every step; only a forward that itself raised marks its step failed."""
    model = inplace_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rig = rigs(model, opt)
    rig.tap("out", "fc", pb.POINT_OUTPUT)
    data = batches(7)
    try:
        raise MemoryError("out of memory: retry with a smaller batch")
    except MemoryError:
        train_steps(model, opt, data, 2)
    assert sorted(s.step for s in rig.summaries()) == [0, 1]
    x, y = next(data)
    opt.zero_grad()
    with pytest.raises(RuntimeError):
        model(x[:, :1])  # the forward itself raises: step 2 publishes nothing
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    train_steps(model, opt, data, 1)
    assert sorted(s.step for s in rig.summaries()) == [3]


@pytest.mark.parametrize("whole", [False, True, "nested"], ids=["block", "whole-model", "nested"])
@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing_recompute_is_not_another_micro_batch(rigs, reentrant, whole):
    """Activation checkpointing re-runs forwards inside backward: each output is read once
    per micro-batch, as without checkpointing. Checkpointing the whole model, the
    reentrant first forward runs under no_grad (unobserved), so the recompute is the one
    read; the non-reentrant recompute ends early by raising through the forward, which
    must not fail the step."""
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
            self.head = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if whole == "nested":  # the block inside a checkpoint inside a checkpoint: recomputed twice
                inner = checkpoint(lambda y: checkpoint(self.block, y, use_reentrant=reentrant) * 1.0, x,
                                   use_reentrant=reentrant)
            else:
                inner = self.block(x) if whole else checkpoint(self.block, x, use_reentrant=reentrant)
            return self.head(inner)

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rig = rigs(model, opt)
    rig.tap("o", "block", pb.POINT_OUTPUT, "moments")
    rig.tap("go", "block", pb.POINT_GRAD_OUTPUT)
    xs = [torch.randn(4, 8, requires_grad=True) for _ in range(4)]
    with torch.no_grad():  # step 0's outputs, before any update (no step is open: nothing fires)
        means = [float(model.block(x).double().mean()) for x in xs[:2]]
    for step in range(2):
        opt.zero_grad()
        for x in xs[2 * step: 2 * step + 2]:  # two micro-batches a step
            out = checkpoint(model, x, use_reentrant=reentrant) if whole is True else model(x)
            out.sum().backward()
        opt.step()
    got = rig.summaries()
    want = [(st, c) for st in range(2) for c in range(2)]
    assert sorted((s.step, s.call_index) for s in got if s.tap == "o") == want
    assert sorted((s.step, s.call_index) for s in got if s.tap == "go") == want
    step0 = sorted((s for s in got if s.tap == "o" and s.step == 0), key=lambda s: s.call_index)
    assert [s.results[0].moments.mean for s in step0] == pytest.approx(means, rel=1e-6, abs=1e-7)
    assert rig.steps.errors == 0 and rig.host.hooks.errors == 0


def test_step_with_an_optimizer_is_refused(rigs):
    model = inplace_net()
    rig = rigs(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="optimizer="):
        with rig.steps.step(0):
            pass


def test_a_tap_added_mid_step_starts_with_the_next_step(rigs):
    model = inplace_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rig = rigs(model, opt)
    data = batches(6)
    x, y = next(data)
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)  # step 0 is open now
    rig.tap("go", "fc", pb.POINT_GRAD_OUTPUT)
    rig.tap("pg", "fc", pb.POINT_PARAM_GRAD)
    loss.backward()
    opt.step()
    train_steps(model, opt, data, 1)
    assert {s.step for s in rig.summaries()} == {1}


def test_a_failing_callback_never_reaches_the_loop(rigs):
    model = inplace_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rig = rigs(model, opt)

    def boom(_ctx: object, _value: object) -> None:
        raise ValueError("tap bug")

    handles = [rig.host.hooks.add("conv2", p, boom) for p in (pb.POINT_OUTPUT, pb.POINT_GRAD_OUTPUT,
                                                               pb.POINT_GRAD_INPUT, pb.POINT_PARAM_GRAD)]
    train_steps(model, opt, batches(7), 2)
    # Per step: output, grad_output, grad_input once each, param_grad once per parameter (weight, bias).
    assert rig.host.hooks.errors == 2 * (3 + 2)
    for h in handles:
        h.remove()
    assert rig.host.hooks.active == 0


def test_a_module_writing_its_input_in_place_is_detected():
    class Sneaky(nn.Module):  # no `inplace` attribute, writes its input anyway
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.mul_(2.0)

    model = nn.Sequential(nn.Linear(4, 4), Sneaky(), nn.Linear(4, 1))
    host = ModelHost(LoadedModel(model, "m", "training", []), training=True)
    seen: list[float] = []
    host.hooks.add("1", pb.POINT_GRAD_INPUT, lambda _c, v: seen.append(float(v.grad.norm())))
    for _ in range(2):
        ctx = host.begin_pass(step=0)
        model(torch.randn(3, 4)).sum().backward()
        host.end_pass(ctx)
    assert host.hooks.errors == 1  # reported once; the second step is read directly
    assert len(seen) == 1 and seen[0] == pytest.approx(2.0 * float(model[2].weight.detach().norm()) * math.sqrt(3), rel=1e-5)


def test_training_host_refuses_its_own_passes():
    from layertap.server.errors import Unsupported

    host = ModelHost(LoadedModel(inplace_net(), "m", "training", []), training=True)
    with pytest.raises(Unsupported, match="training agent") as info:
        host.run([torch.randn(1, 3, 8, 8)])
    assert info.value.reason == "TRAINING_AGENT"


def test_names_look_through_compile_and_ddp(tmp_path):
    import torch.distributed as dist

    model = inplace_net()
    assert unwrap(torch.compile(model)) is model  # compiles lazily: nothing runs here
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(model)
        assert unwrap(torch.compile(ddp)) is model
        host = ModelHost(LoadedModel(unwrap(ddp), "m", "training", []), training=True)
        assert host.layer_names == ["conv1", "bn1", "relu1", "conv2", "relu2", "fc"]
    finally:
        dist.destroy_process_group()


def test_rank_from_env():
    assert Rank.from_env({}) == Rank(0, 0, 1)
    r = Rank.from_env({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"})
    assert (r.port(9000), r.port(0), r.port(None)) == (9001, 0, None)
    with pytest.raises(ValueError, match="LOCAL_RANK='x'"):
        Rank.from_env({"LOCAL_RANK": "x"})
    with pytest.raises(ValueError, match="RANK=2 is not below WORLD_SIZE=2"):
        Rank.from_env({"RANK": "2", "WORLD_SIZE": "2"})


def test_labelled_registry_adds_rank_to_every_sample():
    from prometheus_client import Counter, Gauge

    reg = LabelledRegistry({"rank": "1"})
    Counter("c", "a counter", ["model"], registry=reg).labels("m").inc(2)
    Gauge("g", "a gauge", registry=reg).set(5)
    assert reg.get_sample_value("c_total", {"model": "m", "rank": "1"}) == 2
    assert reg.get_sample_value("g", {"rank": "1"}) == 5
    assert reg.get_sample_value("g", {}) is None
