"""An explanation's internal batches: one pass each, on the model thread, eval mode inside, a deadline before each.

The clock here is the test's own: every forward of the model advances it by
one "second", so which batch meets the deadline is known exactly.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from support.e2e import batch
from torch import nn

from layertap.server.errors import DeadlineExceeded
from layertap.server.explain.explainer import explain
from layertap.server.explain.options import EXPLAIN_OWNER, ExplainOptions
from layertap.server.explain.passes import ExplainPasses
from layertap.server.host.demo_model import DEMO_INPUT_SHAPE, build_demo_model
from layertap.server.host.model_host import ModelHost
from layertap.server.host.sources import InputSpec, LoadedModel

pytestmark = pytest.mark.unit

IG = ExplainOptions("integrated_gradients", n_steps=64, batch_rows=1)  # one sample: one step a pass, 64 passes


class Clock:
    """Advances one second per forward of the model, and records when each forward began."""

    def __init__(self, host: ModelHost) -> None:
        self.now = 0.0
        self.starts: list[float] = []
        self.owners: list[object] = []
        self.host = host
        host.module.register_forward_pre_hook(self._tick)

    def _tick(self, module: nn.Module, args: object) -> None:
        self.starts.append(self.now)
        self.owners.append(self.host._current.active_owner if self.host._current else None)
        self.now += 1.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def host() -> Iterator[ModelHost]:
    h = ModelHost(LoadedModel(build_demo_model(0), "demo", "factory",
                              [InputSpec("input", torch.float32, DEMO_INPUT_SHAPE)]))
    yield h
    h.model_thread.close()


def inputs(host: ModelHost, n: int = 1):  # type: ignore[no-untyped-def]
    return host.validate_inputs([torch.from_numpy(batch(n, seed=51))])


def test_no_batch_starts_past_the_deadline(host: ModelHost) -> None:
    clock = Clock(host)
    passes = ExplainPasses(host, deadline=5.5, clock=clock)
    with pytest.raises(DeadlineExceeded, match="deadline after 6 of 66 internal batches"):
        explain(host, inputs(host), IG, passes)
    # Passes began at 0 (targets), 1, ..., 5; the seventh would begin at 6.0, past 5.5: it never ran.
    assert passes.batches == 6 and clock.starts == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert not passes.cancelled  # a deadline, not a cancel
    assert set(clock.owners) == {EXPLAIN_OWNER}
    host.run([torch.from_numpy(batch(1))])  # the model is free again
    assert clock.owners[-1] is None


def test_a_cancelled_call_stops_before_its_next_batch(host: ModelHost) -> None:
    clock = Clock(host)
    passes = ExplainPasses(host, alive=lambda: clock.now < 3, clock=clock)
    with pytest.raises(DeadlineExceeded, match="cancelled after 3"):
        explain(host, inputs(host), IG, passes)
    assert len(clock.starts) == 3 and passes.cancelled


def test_each_batch_is_its_own_call_on_the_model_thread(host: ModelHost) -> None:
    """A separate model-thread call per batch: the model lock is free between two, so a queued Infer runs."""
    before = host.model_thread.calls
    passes = ExplainPasses(host)
    found = explain(host, inputs(host), ExplainOptions("integrated_gradients", n_steps=8, batch_rows=2), passes)
    assert found.batches == passes.batches == 1 + 4 + 1 == host.model_thread.calls - before
    assert not host.pass_lock()._is_owned()  # type: ignore[attr-defined]


def test_eval_inside_every_pass_and_the_model_s_own_modes_between_them(host: ModelHost) -> None:
    model = host.module
    model.train()
    model.layer2.eval()
    modes = {n: m.training for n, m in model.named_modules()}
    inside: list[bool] = []
    between: list[dict[str, bool]] = []
    model.layer3.register_forward_hook(lambda m, a, o: inside.append(m.training or model.training))

    def clock() -> float:  # read at the start of each pass, before eval mode is set
        between.append({n: m.training for n, m in model.named_modules()})
        return 0.0

    bn = dict(model.named_buffers())
    before = {n: b.clone() for n, b in bn.items()}
    explain(host, inputs(host, 2), ExplainOptions("integrated_gradients", n_steps=4, batch_rows=2),
            ExplainPasses(host, deadline=1.0, clock=clock))
    assert inside and not any(inside)
    assert between and all(b == modes for b in between)
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert all(torch.equal(b, before[n]) for n, b in bn.items())  # BatchNorm statistics never moved


def test_parameters_keep_their_gradients(host: ModelHost) -> None:
    gen = torch.Generator().manual_seed(3)
    for p in host.module.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    grads = {n: p.grad.clone() for n, p in host.module.named_parameters() if p.grad is not None}
    for method, layer in (("integrated_gradients", ""), ("saliency", ""), ("layer_integrated_gradients", "layer2"),
                          ("grad_cam", "layer4")):
        explain(host, inputs(host, 2), ExplainOptions(method, layer, n_steps=4), ExplainPasses(host))
    for n, p in host.module.named_parameters():
        assert torch.equal(p.grad, grads[n]), n
    assert host.hooks.active == 0 and all(not m._forward_hooks for m in host.module.modules())
