"""Counting the reductions a tap engine runs, whichever path a tensor takes (test support)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def count_reductions(monkeypatch: Any, record: Callable[[Any, torch.Tensor], object]) -> None:
    """Calls ``record(plan_or_None, tensor)`` for every tensor a tap reduces, by either path.

    A tensor reaches ``ReducerPlan.run`` or, small and read by basic reducers
    only, ``PassBatch.defer`` (``reducers.batched``); the plan is None there.
    """
    from layertap.server.reducers.batched import PassBatch
    from layertap.server.reducers.plan import ReducerPlan

    real_run, real_defer = ReducerPlan.run, PassBatch.defer

    def run(plan: ReducerPlan, t: torch.Tensor) -> torch.Tensor:
        record(plan, t)
        return real_run(plan, t)

    def defer(batch: PassBatch, t: torch.Tensor) -> Any:
        row = real_defer(batch, t)
        if row is not None:
            record(None, t)
        return row

    monkeypatch.setattr(ReducerPlan, "run", run)
    monkeypatch.setattr(PassBatch, "defer", defer)
