"""Counting the reductions a tap engine runs, whichever path a tensor takes (test support)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def count_reductions(monkeypatch: Any, record: Callable[[Any, torch.Tensor], object]) -> None:
    """Calls ``record(plan_or_None, tensor)`` for every tensor a tap reduces, by either path.

    A tensor reaches ``ReducerPlan.run``; or, small and read by basic reducers
    only, ``PassBatch.defer`` (``reducers.batched``); or, for a basic tap, the
    ``layertap::tap_stats`` call of its firing (``taps.firing``) with its flag
    on. The plan is None for the last two.
    """
    from layertap.server.reducers.batched import PassBatch
    from layertap.server.reducers.plan import ReducerPlan
    from layertap.server.taps import firing

    real_run, real_defer, real_op = ReducerPlan.run, PassBatch.defer, firing.tap_stats_op

    def run(plan: ReducerPlan, t: torch.Tensor) -> torch.Tensor:
        record(plan, t)
        return real_run(plan, t)

    def defer(batch: PassBatch, t: torch.Tensor) -> Any:
        row = real_defer(batch, t)
        if row is not None:
            record(None, t)
        return row

    def op(x: torch.Tensor, out: torch.Tensor, row: torch.Tensor, flag: torch.Tensor, mask: Any) -> None:
        if int(flag) != 0:
            record(None, x)
        real_op(x, out, row, flag, mask)

    monkeypatch.setattr(firing, "tap_stats_op", op)
    monkeypatch.setattr(ReducerPlan, "run", run)
    monkeypatch.setattr(PassBatch, "defer", defer)
