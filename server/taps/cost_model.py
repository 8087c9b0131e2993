"""What a tap's plan will cost a pass, before it is hooked: admission by cost for the overhead budget.

Why: the governor (``taps.budget``) can only thin a tap to 1 in
``MAX_STRIDE`` of its passes. A plan that costs more than a principal's share
of the budget even then would break the budget whatever the governor does,
so ``CreateTap`` and ``Subscribe`` refuse it up front (RESOURCE_EXHAUSTED,
naming the budget and the estimate).

How a plan is estimated:

- **Measured, per element and per firing.** The plan's reducers run on two
  random tensors of a hooked layer's trailing shape (about 2^12 and 2^16
  elements, on the host's device and dtype), timed. The two times give a
  cost per firing and a cost per element; a layer costs ``a + b * numel``.
  Each (plan, trailing shape, device, dtype) is measured once and kept (a
  bounded cache), so thirty identical subscribers measure once.
- **Kept up to date.** The layers' element counts come from the host's shape
  probe (``ModelHost.layer_shapes``), a batch-1 pass; live traffic differs
  (batches, caches, the GIL), so the governor keeps a scale: the taps'
  measured cost per sampled pass against their estimates, smoothed
  (``Governor.scale``). Estimates are multiplied by it.

Off the hot path: it runs when a tap is created, on the model thread between
passes (torch work elsewhere would start a second OpenMP team,
``host.model_thread``); its device syncs are there, never in a pass.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence

import torch

from layertap.server.errors import LimitExceeded
from layertap.server.host.model_host import ModelHost
from layertap.server.reducers.plan import ReducerPlan
from layertap.server.reducers.spec import SpecError
from layertap.server.taps.budget import MAX_STRIDE, Governor
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["CostModel", "PlanCost", "admit"]

#: The two calibration sizes (elements): small enough to cost microseconds, apart enough to split
#: a firing's fixed cost from its per-element cost.
SMALL, LARGE = 1 << 12, 1 << 16
#: Plans and shapes measured and kept.
MAX_KEPT = 256
#: Timed runs per size (the least is kept: the others met a busy core).
RUNS = 3


class PlanCost:
    """A plan's cost on one trailing shape: ``per_firing + per_element * numel`` seconds."""

    __slots__ = ("per_element", "per_firing")

    def __init__(self, per_firing: float, per_element: float) -> None:
        self.per_firing, self.per_element = per_firing, per_element

    def __call__(self, numel: int) -> float:
        return self.per_firing + self.per_element * numel


class CostModel:
    """Estimates a plan's seconds per sampled pass on one host's layers (see the module docstring)."""

    def __init__(self, host: ModelHost) -> None:
        self.host = host
        self._kept: OrderedDict[Hashable, PlanCost] = OrderedDict()
        #: Calibrations run (tests count them: one per plan and shape).
        self.measured = 0

    def estimate(self, plan: ReducerPlan, layers: Sequence[str], point: int) -> float:
        """Seconds one sampled pass of ``plan`` on ``layers`` costs, unscaled; layers whose shapes the
        probe has not seen (or that a reducer cannot read) add nothing."""
        total = 0.0
        for layer in layers:
            for shape in self._shapes(layer, point):
                cost = self.cost(plan, shape)
                if cost is not None:
                    total += cost(math.prod(shape))
        return total

    def admit(self, plan: ReducerPlan, layers: Sequence[str], point: int, *, governor: Governor, owner: str,
              owners: set[str], field: str) -> float:
        """:func:`admit` for ``plan`` on ``layers``; returns its estimate (0 when the budget is off: nothing
        is measured then)."""
        if not governor.on:
            return 0.0
        estimate = self.estimate(plan, layers, point)
        always = plan.nonfinite_only()
        admit(estimate, 0.0 if always is None else self.estimate(always, layers, point), governor=governor,
              owner=owner, owners=owners, field=field)
        return estimate

    def cost(self, plan: ReducerPlan, shape: Sequence[int]) -> PlanCost | None:
        """``plan``'s measured cost on tensors of ``shape``'s trailing dims; None when it cannot run there."""
        inner = tuple(int(d) for d in shape[1:])
        key = (plan.reuse_key or repr(plan), inner, self.host.device, self.host.dtype)
        kept = self._kept.get(key)
        if kept is not None:
            self._kept.move_to_end(key)
            return kept
        width = max(1, math.prod(inner))
        small, large = max(1, SMALL // width), max(1, LARGE // width)
        try:  # on the model thread: torch work on an RPC thread would start a second OpenMP team
            t_small, t_large = self.host.on_model_thread(self._time_both, plan, (small, *inner), (large, *inner))
        except (SpecError, TypeError, RuntimeError):
            return None  # a reducer that cannot read this shape never fires on it either
        n_small, n_large = small * width, large * width
        per_element = max(0.0, (t_large - t_small) / (n_large - n_small)) if n_large > n_small else \
            t_small / n_small
        cost = PlanCost(max(0.0, t_small - per_element * n_small), per_element)
        self._kept[key] = cost
        if len(self._kept) > MAX_KEPT:
            self._kept.popitem(last=False)
        return cost

    def _time_both(self, plan: ReducerPlan, small: tuple[int, ...], large: tuple[int, ...]) -> tuple[float, float]:
        t_small = self._time(plan, small)
        return t_small, self._time(plan, large) if large != small else t_small

    def _time(self, plan: ReducerPlan, shape: tuple[int, ...]) -> float:
        device, dtype = self.host.device, self.host.dtype
        if not dtype.is_floating_point:
            dtype = torch.float32
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(shape, generator=gen, device=device, dtype=dtype)
        self.measured += 1
        best = math.inf
        with torch.inference_mode():
            for _ in range(RUNS + 1):  # the first run warms caches and allocators
                _sync(device)
                start = time.perf_counter()
                plan.run(x)
                _sync(device)
                best = min(best, time.perf_counter() - start)
        return best

    def _shapes(self, layer: str, point: int) -> list[tuple[int, ...]]:
        """The shapes a firing of ``layer`` at ``point`` reduces, per the probe (each call's tensors)."""
        seen = self.host.layer_shapes.get(layer)
        if seen is None:
            return []
        tensors = seen.inputs if point in (pb.POINT_INPUT, pb.POINT_GRAD_INPUT) else seen.outputs
        return [tuple(s) for s in tensors if len(s) >= 1] * max(1, seen.calls)  # each call fires


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def admit(estimate: float, always: float, *, governor: Governor, owner: str, owners: set[str],
          field: str = "spec.reducers") -> None:
    """Refuses a plan that would exceed its principal's share of the budget at its slowest allowed rate.

    Args:
        estimate: The plan's seconds per sampled pass, unscaled (:meth:`CostModel.estimate`).
        always: Its always-on part's (``nonfinite`` on unsampled passes), unscaled.
        owner: The principal asking.
        owners: The principals whose taps the governor already shares the budget among.
        field: The request field the refusal names.

    Raises:
        LimitExceeded: RESOURCE_EXHAUSTED, naming the budget, the estimate and the share.
    """
    if not governor.on or governor.per_pass <= 0:
        return  # no budget, or no pass measured yet: nothing to hold the plan against
    principals = len(owners | {owner})
    share = governor.budget * governor.per_pass / principals
    slowest = governor.scale * (estimate + always) / MAX_STRIDE
    if slowest > share:
        raise LimitExceeded(
            f"{field}: the tap's reducers would cost about {governor.scale * estimate * 1e3:.3f} ms a sampled pass "
            f"(measured per element and per firing on its layers), {slowest * 1e6:.2f} us a pass even at its "
            f"slowest rate (1 in {MAX_STRIDE}); --tap-budget {governor.budget:g} of {governor.per_pass * 1e3:.3f} ms "
            f"passes gives each of {principals} principal(s) {share * 1e6:.2f} us: tap fewer layers or ask for "
            "cheaper reducers", metadata={"budget": f"{governor.budget:g}", "estimate_seconds": f"{slowest:.9f}",
                                          "share_seconds": f"{share:.9f}"}, field=field)
