"""A training step is published whole or not at all (found by review).

* A tap created while the training thread sits in an evaluation forward
  inside a step must not see the rest of that step (it would report a step
  with only its later micro-batches, numbered from 0).
* A step whose training forward raised (the user caught it and went on)
  publishes nothing, as docs/training.md says.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

import layertap

pytestmark = pytest.mark.e2e


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)
        self.block = False
        self.boom = False
        self.in_eval = threading.Event()
        self.go = threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.block:
            self.in_eval.set()
            assert self.go.wait(10)
        h = self.a(x)
        if self.boom:
            raise RuntimeError("bad batch")
        return self.b(h)


def _collect(stream: object, into: list) -> threading.Thread:
    t = threading.Thread(target=lambda: [into.append(s) for s in stream], daemon=True)  # type: ignore[attr-defined]
    t.start()
    return t


def _wait_for(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_a_tap_created_during_an_evaluation_forward_skips_the_rest_of_that_step() -> None:
    torch.manual_seed(0)
    m = _Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with layertap.attach(m, opt) as agent, layertap.Client(agent.address) as client:
        def train() -> None:
            for step in range(3):
                opt.zero_grad()
                m(torch.randn(2, 4)).sum().backward()  # micro-batch 0
                if step == 0:
                    m.block = True
                    with torch.no_grad():
                        m(torch.randn(2, 4))  # evaluation forward; the tap arrives now
                    m.block = False
                m(torch.randn(2, 4)).sum().backward()  # micro-batch 1
                opt.step()

        trainer = threading.Thread(target=train)
        trainer.start()
        assert m.in_eval.wait(10)
        got: list = []
        stream = client.watch("a", point="output", reducers=["moments"])
        _collect(stream, got)
        assert _wait_for(lambda: agent.hooks > 0)  # installed while step 0 is in flight
        m.go.set()
        trainer.join(30)
        assert _wait_for(lambda: len(got) >= 4)
        stream.close()
    steps = sorted({s.step for s in got})
    assert 0 not in steps, [(s.step, s.call_index) for s in got]
    assert sorted((s.step, s.call_index) for s in got) == [(1, 0), (1, 1), (2, 0), (2, 1)]


def test_a_step_whose_forward_raised_publishes_nothing() -> None:
    torch.manual_seed(0)
    m = _Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with layertap.attach(m, opt) as agent, layertap.Client(agent.address) as client:
        got: list = []
        stream = client.watch("a", point="output", reducers=["moments"])
        _collect(stream, got)
        assert _wait_for(lambda: agent.hooks > 0)
        for step in range(2):
            opt.zero_grad()
            if step == 0:
                m.boom = True
                try:
                    m(torch.randn(2, 4))
                except RuntimeError:
                    pass  # the user skips the bad batch and goes on
                m.boom = False
            m(torch.randn(2, 4)).sum().backward()
            opt.step()
        assert _wait_for(lambda: len(got) >= 1)
        time.sleep(0.3)  # a late step-0 summary would arrive by now
        stream.close()
    assert [(s.step, s.call_index) for s in got] == [(1, 0)]


def test_a_tap_added_after_torch_compile_ran_still_fires() -> None:
    """Dynamo skips module-hook guards by default: without attach's switch, a tap
    created after the first compiled step never fired (found by review)."""
    import torch._dynamo.config as dynamo_config

    before = dynamo_config.skip_nnmodule_hook_guards
    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        cm = torch.compile(m, backend="eager")  # dynamo only: no inductor build in the test
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with layertap.attach(cm, opt) as agent, layertap.Client(agent.address) as client:
            def steps(n: int) -> None:
                for _ in range(n):
                    opt.zero_grad()
                    cm(torch.randn(2, 4)).sum().backward()
                    opt.step()

            steps(2)  # compiled before any tap exists
            got: list = []
            stream = client.watch("*", point="output", reducers=["moments"])
            _collect(stream, got)
            assert _wait_for(lambda: agent.hooks > 0)
            steps(3)
            assert _wait_for(lambda: {s.step for s in got} >= {3, 4})
            stream.close()
        assert {s.layer for s in got} == {"0", "1", "2"}  # the user's names, no _orig_mod.
    finally:
        dynamo_config.skip_nnmodule_hook_guards = before
        torch._dynamo.reset()
