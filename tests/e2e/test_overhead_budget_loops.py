"""The overhead budget where passes are not Infer calls: Generate's decode steps, and a training agent's steps.

Issue 43's promise is the same there: with wide taps attached, the taps' share of pass time comes back under
``--tap-budget`` (or, where the floor alone is over it, every client tap runs at its sparsest), and the
thinned taps say so. Windows are 3 passes here (``budget.WINDOW_PASSES``), as in test_overhead_budget.
"""

from __future__ import annotations

import importlib.util
import os
import threading

import pytest
import torch
from support import hf_models
from support.e2e import wait_for
from support.generation import request, stub_of

import layertap
from layertap.server.host.demo_model import build_demo_model
from layertap.server.taps import budget
from layertap.server.taps.budget import MAX_STRIDE, Governor

if importlib.util.find_spec("transformers") is None and not os.environ.get("CI"):
    pytest.skip("transformers is not installed (pip install 'layertap[hf]')", allow_module_level=True)

pytestmark = pytest.mark.e2e

BUDGET = 0.05
WIDE = ["moments", "histogram", "per_channel", "minmax", "nonfinite"]


class Windows:
    """Each window's (share, share less its floor, every client tap at its sparsest), as the governor ends it."""

    def __init__(self, governor: Governor, taps: object) -> None:
        self.rows: list[tuple[float, float, bool]] = []
        real = governor.pass_ended

        def record(pass_seconds: float, hook_seconds: float, taps_of: object) -> bool:
            ended = real(pass_seconds, hook_seconds, taps_of)  # type: ignore[arg-type]
            if ended:
                live = [t for t in taps() if t.governed]  # type: ignore[operator]
                self.rows.append((governor.share, governor.share - governor.floor,
                                  bool(live) and all(t.throttle == MAX_STRIDE for t in live)))
            return ended

        governor.pass_ended = record  # type: ignore[method-assign]

    def over(self) -> bool:
        return any(share > BUDGET for share, _, _ in self.rows)

    def held(self) -> bool:
        """Three windows in a row under the budget (or at the sparsest, with what strides cut under it)."""
        last = self.rows[-3:]
        return len(last) == 3 and all(cut <= BUDGET and (share <= BUDGET or sparsest) for share, cut, sparsest in last)


def test_decode_steps_with_wide_taps_are_held_to_the_budget(make_server, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(budget, "WINDOW_PASSES", 3)
    path, _ = hf_models.save("llama", tmp_path, max_position_embeddings=1024, eos_token_id=None)
    srv = make_server(model=f"hf:{path}", tap_budget=BUDGET)
    engine = srv.state.taps
    windows = Windows(engine.governor, engine.all_taps)
    stop = threading.Event()

    def generate() -> None:
        stub = stub_of(srv)
        while not stop.is_set():
            for _ in stub.Generate(request([1, 2, 3, 4], max_new_tokens=48), timeout=120):
                pass

    with layertap.Client(f"127.0.0.1:{srv.port}") as c:
        taps = [c.create_tap("**", reducers=WIDE, phases=["decode"], ttl=300) for _ in range(10)]
        driver = threading.Thread(target=generate, daemon=True)
        driver.start()
        try:
            assert wait_for(windows.over, 180), windows.rows
            assert wait_for(windows.held, 180), windows.rows[-10:]
            thinned = [t for t in engine.all_taps() if t.throttle > 1]
            assert thinned and all("--tap-budget 0.05" in t.throttle_reason for t in thinned)
            # Thinned, never starved: every tap still gets sampled decode steps.
            assert wait_for(lambda: all(engine.get(t.id).hits > 0 for t in taps), 60)
        finally:
            stop.set()
            driver.join(120)


def test_a_training_agent_holds_its_steps_to_the_budget_by_default(monkeypatch) -> None:
    """``layertap.attach`` with no budget option: the default (5%) applies to training steps too."""
    monkeypatch.setattr(budget, "WINDOW_PASSES", 3)
    model = build_demo_model(0).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = layertap.attach(model, opt, metrics_port=None)
    try:
        engine = agent.server.state.taps
        assert engine.governor.budget == budget.DEFAULT_BUDGET == BUDGET
        windows = Windows(engine.governor, engine.all_taps)
        x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        y = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(1))
        with layertap.Client(agent.address) as c:
            for _ in range(10):
                c.create_tap("**", reducers=WIDE, ttl=300)

            def step() -> None:
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()

            def stepped_until(predicate) -> bool:  # type: ignore[no-untyped-def]
                for _ in range(2000):
                    step()
                    if predicate():
                        return True
                return False

            assert stepped_until(windows.over), windows.rows
            assert stepped_until(windows.held), windows.rows[-10:]
            assert any(t.throttle > 1 for t in engine.all_taps())
            # Thinned, never admitted by cost: a timing would run beside the caller's training step.
            assert all(t.cost.estimate == 0 for t in engine.all_taps())
            assert all(info.throttle >= 1 for info in c.taps())
            assert any(info.throttle > 1 and info.throttle_reason for info in c.taps())
    finally:
        agent.close()

