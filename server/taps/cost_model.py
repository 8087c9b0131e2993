"""What a tap's plan will cost a pass, before it is hooked: admission by cost for the overhead budget.

Why: the governor (``taps.budget``) can only thin a tap to 1 in
``MAX_STRIDE`` of its passes. A plan that costs more than a principal's share
of the budget even then would break the budget whatever the governor does,
so ``CreateTap`` and ``Subscribe`` refuse it up front (RESOURCE_EXHAUSTED,
naming the budget and the estimate).

How a plan is estimated:

- **Measured, per element and per firing.** The plan's reducers run on two
  random tensors of a hooked layer's trailing shape, cut to about 2^12 and
  2^16 elements (:func:`_shrunk`: bounded memory and time whatever the
  layer), on the host's device and dtype, timed. The two times give a cost
  per firing and a cost per element; a layer costs ``a + b * numel``. Each
  (reducers, trailing shape, device, dtype) is measured once and kept (a
  bounded cache; a plan that cannot run on a shape is kept as such), so
  thirty identical subscribers measure once.
- **Kept up to date.** The layers' element counts come from the host's last
  shape probe (``ModelHost.layer_shapes``: the warm-up's batch-1 pass, then
  a live pass every second). Live passes still differ (compiled kernels,
  caches, the GIL), so the governor keeps a bounded scale: the taps'
  measured cost per sampled pass against their estimates, smoothed
  (``Governor.scale``). Estimates are multiplied by it.
- **Per plan.** Each plan alone is held against its principal's share at
  the sparsest stride, as issue 43 asks: the governor thins the sum, and
  identical taps share their reductions.

Off the hot path: it runs when a tap is created, on the model thread between
passes (torch work elsewhere would start a second OpenMP team,
``host.model_thread``); its device syncs are there, never in a pass.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

import torch

from layertap.server.errors import LimitExceeded
from layertap.server.host.model_host import ModelHost
from layertap.server.reducers.op import FLOAT_DTYPES, MAX_DIMS, new_rows, tap_stats_op
from layertap.server.reducers.plan import ReducerPlan
from layertap.server.taps.budget import MAX_STRIDE, Governor
from layertap.server.taps.tap import Tap
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["CostModel", "PlanCost", "admit"]

log = logging.getLogger("layertap.server")

#: The two calibration sizes (elements): small enough to cost microseconds, apart enough to split
#: a firing's fixed cost from its per-element cost.
SMALL, LARGE = 1 << 12, 1 << 16
#: Plans and shapes measured and kept.
MAX_KEPT = 256
#: Timed runs per size (the least is kept: the others met a busy core).
RUNS = 5
#: A plan that could not run on a shape (kept too, so a retry costs nothing).
_CANNOT: object = object()


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
        self._kept: OrderedDict[Hashable, object] = OrderedDict()  # PlanCost, or _CANNOT
        self._lock = threading.Lock()
        #: Calibrations run (tests count them: one per plan and shape).
        self.measured = 0

    def estimate(self, plan: ReducerPlan, layers: Sequence[str], point: int, op: bool = False) -> float:
        """Seconds one sampled pass of ``plan`` on ``layers`` costs, unscaled; layers whose shapes the
        probe has not seen (or that a reducer cannot read) add nothing. ``op``: the plan fires as one
        ``layertap::tap_stats`` call (``taps.firing``), which is what is timed then."""
        total = 0.0
        for layer in layers:
            for shape in self._shapes(layer, point):
                cost = self.cost(plan, shape, op)
                if cost is not None:
                    total += cost(math.prod(shape))
        return total

    def admit(self, plan: ReducerPlan, layers: Sequence[str], point: int, *, governor: Governor, owner: str,
              live: Sequence[Tap], field: str, op: bool = False) -> float:
        """:func:`admit` for ``plan`` on ``layers`` (``live``: the taps now, for the principals); returns its estimate
        per sampled pass, 0 where nothing is measured: the budget off; a training host,
        whose steps run on the caller's thread (a timing would run beside a step); parameter gradients,
        whose tensors the shape probe does not see."""
        if not governor.on or self.host.training or point == pb.POINT_PARAM_GRAD:
            return 0.0
        estimate = self.estimate(plan, layers, point, op)
        nonfinite = plan.nonfinite_only()
        always = 0.0 if nonfinite is None else self.estimate(nonfinite, layers, point, op)
        admit(estimate, always, governor=governor, owner=owner, owners={t.owner for t in live if t.governed},
              field=field)
        return estimate

    def cost(self, plan: ReducerPlan, shape: Sequence[int], op: bool = False) -> PlanCost | None:
        """``plan``'s measured cost on tensors of ``shape``'s trailing dims (as one op call with ``op``);
        None when it cannot run there."""
        inner = tuple(int(d) for d in shape[1:])
        op = op and self.host.dtype in FLOAT_DTYPES and len(shape) <= MAX_DIMS  # else the plan path serves it
        key = ("op" if op else tuple(r.key() for r in plan.reducers), inner, self.host.device, self.host.dtype)
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None:
                self._kept.move_to_end(key)
                return kept if isinstance(kept, PlanCost) else None
        base = (1, *inner) if inner else (LARGE,)  # a 1-d tensor: its one dim is the data
        small, large = _shrunk(base, SMALL), _shrunk(base, LARGE)
        # A plan of its own: timing the tap's would move its sampling generators and the kernel's counters.
        run = _op_call(self.host.device) if op else ReducerPlan(plan.reducers, plan.seed).run
        try:  # on the model thread: torch work on an RPC thread would start a second OpenMP team
            t_small, t_large = self.host.on_model_thread(self._time_both, run, small, large)
        except Exception as exc:  # noqa: BLE001  # a reducer that cannot read this shape never fires on it either
            log.info("cost model: %r cannot run on %s (%s); it adds nothing to estimates", plan, list(inner), exc)
            self._keep(key, _CANNOT)
            return None
        n_small, n_large = math.prod(small), math.prod(large)
        per_element = max(0.0, (t_large - t_small) / (n_large - n_small)) if n_large > n_small else \
            t_small / max(1, n_small)
        cost = PlanCost(max(0.0, t_small - per_element * n_small), per_element)
        self._keep(key, cost)
        return cost

    def _keep(self, key: Hashable, value: object) -> None:
        with self._lock:
            self._kept[key] = value
            if len(self._kept) > MAX_KEPT:
                self._kept.popitem(last=False)

    def _time_both(self, run: Callable[[torch.Tensor], object], small: tuple[int, ...], large: tuple[int, ...]
                   ) -> tuple[float, float]:
        """The least time of ``RUNS`` runs on each shape, interleaved (a busy moment slows both sizes, not
        one), after a run of each that warms caches, allocators and the kernels' first calls."""
        device, dtype = self.host.device, self.host.dtype
        if not dtype.is_floating_point:
            dtype = torch.float32
        gen = torch.Generator(device=device).manual_seed(0)
        xs = [torch.randn(shape, generator=gen, device=device, dtype=dtype) for shape in (small, large)]
        self.measured += 1
        best = [math.inf, math.inf]
        with torch.inference_mode():
            for x in xs:
                run(x)
            for _ in range(RUNS):
                for i, x in enumerate(xs):
                    _sync(device)
                    start = time.perf_counter()
                    run(x)
                    _sync(device)
                    best[i] = min(best[i], time.perf_counter() - start)
        return best[0], best[1]

    def _shapes(self, layer: str, point: int) -> list[tuple[int, ...]]:
        """The shapes a firing of ``layer`` at ``point`` reduces, per the probe (each call's tensors)."""
        seen = self.host.layer_shapes.get(layer)
        if seen is None:
            return []
        tensors = seen.inputs if point in (pb.POINT_INPUT, pb.POINT_GRAD_INPUT) else seen.outputs
        return [tuple(s) for s in tensors if len(s) >= 1] * max(1, seen.calls)  # each call fires


def _op_call(device: torch.device) -> Callable[[torch.Tensor], None]:
    """One ``layertap::tap_stats`` call into a row of its own, flag on: what a basic tap's firing costs.
    Its tensors are made at the first call (the warm-up, on the model thread), not here."""
    made: list[torch.Tensor] = []

    def call(x: torch.Tensor) -> None:
        if not made:
            made.extend((new_rows(1, device), torch.zeros(1, dtype=torch.int64, device=device),
                         torch.ones(1, dtype=torch.int32, device=device)))
        tap_stats_op(x, made[0], made[1], made[2], None)

    return call


def _shrunk(shape: tuple[int, ...], limit: int) -> tuple[int, ...]:
    """``shape`` with at most about ``limit`` elements and the same rank: as many rows (dim 0) as fit,
    then the next dims cut in turn, the last one last. The estimate extrapolates linearly, so a
    layer of any size is measured in bounded memory and time."""
    dims = list(shape)
    width = math.prod(dims[1:]) if len(dims) > 1 else 1
    dims[0] = max(1, limit // max(1, width)) if len(dims) > 1 else min(dims[0], limit) or 1
    for i in range(1, len(dims) - 1):
        if math.prod(dims) <= limit:
            break
        dims[i] = max(1, limit // (math.prod(dims) // dims[i]))
    if math.prod(dims) > limit:
        dims[-1] = max(1, limit // max(1, math.prod(dims[:-1])))
    return tuple(dims)


def _sync(device: torch.device) -> None:
    if device.type == "cpu":
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif hasattr(torch, "accelerator"):  # MPS, XPU...: without it a timing would see the launch only
        torch.accelerator.synchronize(device)


def admit(estimate: float, always: float, *, governor: Governor, owner: str, owners: set[str],
          field: str = "spec.reducers") -> None:
    """Refuses a plan that alone would exceed its principal's share of the budget even at the slowest
    allowed rate. Alone: the governor thins the sum of a principal's taps, and identical taps share their
    reductions, so thirty dashboards on one layer set are admitted as one would be.

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
            f"(measured per element and per firing on its layers): {slowest * 1e6:.2f} us a pass even at the "
            f"slowest rate (1 in {MAX_STRIDE}); --tap-budget {governor.budget:g} of {governor.per_pass * 1e3:.3f} ms "
            f"passes gives each of {principals} principal(s) {share * 1e6:.2f} us: tap fewer layers or ask for "
            "cheaper reducers", metadata={"budget": f"{governor.budget:g}", "estimate_seconds": f"{slowest:.9f}",
                                          "share_seconds": f"{share:.9f}"}, field=field)
