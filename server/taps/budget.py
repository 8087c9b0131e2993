"""The overhead budget: taps may cost at most a fraction of the model's pass time.

Why: any client with the ``read`` scope can attach taps, and each costs host
time on every pass it samples. Continuous profilers keep to a budget by
adapting their sampling; so does this governor (``serve --tap-budget``,
default 5%).

What counts: the model thread's time in tap hooks, the host-transfer
thread's time publishing the taps' pieces (``Tap.published_seconds``), and
the subscribers' stream threads' time building and serializing their
batches (``Tap.delivered_seconds``). The last two run beside the model, but
they hold the same GIL: with thirty wide subscribers publishing was most of
what slowed Infer once the hooks were thinned.

How it works, once per window (``WINDOW_SECONDS`` and ``WINDOW_PASSES``):

- **Measure.** That time in the window against the window's pass time gives
  the share. Each tap's hook time is split by the engine into its sampled
  passes' (``Tap.settle``) and the rest, and its publishing goes with its
  sampled passes, so the full-rate demand of a tap is *its cost per sampled
  pass* times *the share of passes its own sampling picks*: a figure that
  does not depend on the stride the governor set, so the control is stable.
- **Allocate.** What the budget leaves after the costs no stride can cut
  (per-pass work, the server's own taps: ``--taps`` files and drift
  baselines, never thinned) is shared max-min fairly: first
  across principals (``Tap.owner``), then across each principal's taps. A
  tap that needs less than its share keeps every pass and leaves the rest to
  the others; the most expensive taps are the ones thinned.
- **Thin.** A tap whose demand exceeds its share samples one in ``stride``
  of the passes its own sampling picks (``Tap.throttle``), with the reason
  in ``Tap.throttle_reason``. Thinned passes are unsampled passes: a tap with
  ``nonfinite`` still counts non-finite values on them, and a sampled pass is
  still reduced exactly. Those always-on parts get the room first; only when
  they alone exceed it are they thinned too (``TapCost.always_stride``).
- **Share.** Taps that ask for the same reductions of the same tensors
  (:func:`share_key`: plan, layers, point, sampling...) share them within a
  pass (``taps.reuse``), so such a group is costed and thinned as one tap
  with its members' shares pooled, and its members count in step: thirty
  identical subscribers sample the same passes and cost what one costs.
- **Correct.** A gain follows the measured share (down 20% a window while
  over the budget, back up slowly below 80% of it), so costs the model does
  not see (caches, the publisher's hold on the GIL) are still bounded. A
  scale follows what taps cost against their plans' estimates
  (``taps.cost_model``), for admission by cost.

Model thread only, apart from the figures it publishes (plain attributes).
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

from layertap.server.taps.tap import Tap, TapCost

__all__ = ["DEFAULT_BUDGET", "MAX_STRIDE", "Governor", "fair_shares", "share_key"]

#: ``serve --tap-budget``'s default: hooks may take 5% of the model thread's pass time.
DEFAULT_BUDGET = 0.05
#: The sparsest thinning: one in this many of a tap's sampled passes.
MAX_STRIDE = 1000
#: A window ends after this many seconds and passes, both.
WINDOW_SECONDS = 0.5
WINDOW_PASSES = 8
#: The gain's floor, its step down while over the budget and its step up well under it.
_GAIN_MIN, _GAIN_DOWN, _GAIN_UP = 0.02, 0.8, 1.1
#: How far a tap's cost per pass falls toward a lower window's figure (it rises at once): :func:`_follow`.
_COST_FALL = 0.25
#: How far each window moves :attr:`Governor.scale` toward its measured ratio.
_SCALE_RATE = 0.3
#: :attr:`Governor.scale` stays within [1 / this, this].
_SCALE_MAX = 4.0


def fair_shares(total: float, demands: Sequence[float]) -> list[float]:
    """Max-min fair split of ``total``: who asks for less than an equal share gets it, the rest share the remainder."""
    shares = [0.0] * len(demands)
    left, todo = max(total, 0.0), sorted(range(len(demands)), key=lambda i: demands[i])
    while todo:
        equal = left / len(todo)
        i = todo[0]
        if demands[i] <= equal:
            shares[i] = demands[i]
            left -= demands[i]
            todo.pop(0)
        else:
            for j in todo:
                shares[j] = equal
            break
    return shares


@dataclass
class _Window:
    started: float
    passes: int = 0
    pass_seconds: float = 0.0
    hook_seconds: float = 0.0


class Governor:
    """Thins the taps' sampling to keep hook time under ``budget`` of pass time (0: off).

    Args:
        budget: The fraction of pass time hooks may take, in [0, 1).
        clock: Monotonic seconds (tests pass a fake).
    """

    def __init__(self, budget: float = DEFAULT_BUDGET, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0.0 <= budget < 1.0:
            raise ValueError(f"tap budget must be in [0, 1), got {budget}")
        self.budget = budget
        self._clock = clock
        self._window = _Window(clock())
        self.gain = 1.0
        #: The last window's share of pass time the taps took, the part of it no stride can cut (the
        #: floor: hooks of layers whose taps are all off, deciding each pass), and the taps thinned.
        self.share = 0.0
        self.floor = 0.0
        self.throttled = 0
        #: The last window's pass time (seconds a pass; 0 before the first window), and what taps cost
        #: against their plans' estimates (``taps.cost_model``), smoothed: admission scales by it.
        self.per_pass = 0.0
        self.scale = 1.0

    @property
    def on(self) -> bool:
        return self.budget > 0.0

    def pass_ended(self, pass_seconds: float, hook_seconds: float, taps: Callable[[], Iterable[Tap]]) -> bool:
        """Counts one pass; at a window's end, sets every tap's stride. True when it did."""
        w = self._window
        w.passes += 1
        w.pass_seconds += pass_seconds
        w.hook_seconds += hook_seconds
        now = self._clock()
        if w.passes < WINDOW_PASSES or now - w.started < WINDOW_SECONDS:
            return False
        self._window = _Window(now)
        self._allocate(list(taps()), w)
        return True

    def _allocate(self, taps: list[Tap], w: _Window) -> None:
        for tap in taps:
            tap.settle()  # the window's last pass too
            # Its publishing (host-transfer thread, the same GIL) is part of what its passes cost.
            # Publishing (host-transfer thread) and delivery (the subscribers' stream threads): same GIL.
            cost = tap.cost
            sampled = tap.published_seconds + tap.delivered_seconds
            always = tap.published_always_seconds + tap.delivered_always_seconds
            cost.sampled_seconds += sampled - cost.published_seen
            cost.always_seconds += always - cost.published_always_seen
            w.hook_seconds += sampled - cost.published_seen + always - cost.published_always_seen
            cost.published_seen, cost.published_always_seen = sampled, always
        self.share = w.hook_seconds / w.pass_seconds if w.pass_seconds > 0 else 0.0
        # The server's own taps (--taps files, drift baselines: an operator's standing monitors, whose
        # windows and readiness count their passes) are never thinned: their cost is part of the floor.
        mine = [t for t in taps if not t.governed]
        taps = [t for t in taps if t.governed]
        fixed = max(0.0, w.hook_seconds - sum(t.cost.sampled_seconds + t.cost.always_seconds for t in taps))
        self.floor = fixed / w.pass_seconds if w.pass_seconds > 0 else 0.0
        demands = [_account(tap.cost, w.passes) for tap in taps]
        for tap in mine:
            _account(tap.cost, w.passes)
            _unthrottle(tap)
        self.per_pass = w.pass_seconds / w.passes
        # Taps that ask for the same reductions of the same tensors share them (``taps.reuse``): a group
        # pays once, so it is costed and thinned as one, at one phase; its members' demands split evenly.
        groups = _groups(taps)
        self._rescale(taps, groups)
        for group in groups:
            pooled = (sum(demands[i][0] for i in group) / len(group), sum(demands[i][1] for i in group) / len(group))
            for i in group:
                demands[i] = pooled
        self.throttled = 0
        if not self.on:
            for tap in taps:
                _unthrottle(tap)
            return
        # Over the budget, less room next time; but only for a part strides can cut: a floor over the
        # budget leaves every tap at its sparsest, and a gain driven down by it would be slow to come back.
        if self.share > self.budget and self.share - self.floor > 0.2 * self.budget:
            self.gain = max(_GAIN_MIN, self.gain * _GAIN_DOWN)
        elif self.share < 0.8 * self.budget:
            self.gain = min(1.0, self.gain * _GAIN_UP)
        per_pass = self.per_pass
        room = max(0.0, self.gain * self.budget * per_pass - fixed / w.passes)
        # The always-on parts (nonfinite on every pass) first; what they leave, to the sampled passes.
        always_shares = self._shares(taps, [d[1] for d in demands], room)
        left = room - sum(min(d[1], a) for d, a in zip(demands, always_shares))
        shares = self._shares(taps, [d[0] for d in demands], left)
        for group in groups:
            n = len(group)
            demand, always_demand = demands[group[0]][0] * n, demands[group[0]][1] * n
            share, always_share = sum(shares[i] for i in group), sum(always_shares[i] for i in group)
            stride, always_stride = _stride(demand, share), _stride(always_demand, always_share)
            lead = taps[group[0]]
            cost = lead.cost
            # Each group at its own phase (taps thinned alike would all sample one pass, a burst); a new
            # stride keeps the count so far, so a stride revised every window never starves a tap.
            if stride > 1:
                cost.thin = _phase(lead, stride) if lead.throttle == 1 else min(cost.thin, stride - 1)
            if always_stride > 1:
                cost.thin_always = _phase(lead, always_stride) if cost.always_stride == 1 else \
                    min(cost.thin_always, always_stride - 1)
            reason = "" if stride == always_stride == 1 else (
                f"overhead budget: --tap-budget {self.budget:g} leaves taps {room * 1e3:.3f} ms a pass (passes "
                f"take {per_pass * 1e3:.3f} ms; taps took {self.share:.1%}). At every pass its sampling picks "
                f"this tap would cost {demand * 1e3:.3f} ms a pass"
                + ("" if n == 1 else f" (shared by {n} taps asking for the same reductions of the same layers)")
                + f", and its fair share is {share * 1e3:.3f} ms, so it samples 1 in {stride} of its passes"
                + ("" if always_stride == 1 else
                   f"; its always-on part (nonfinite on unsampled passes) would cost {always_demand * 1e3:.3f} ms "
                   f"of a {always_share * 1e3:.3f} ms share, so it runs on 1 in {always_stride} of them"))
            for i in group:
                tap = taps[i]
                # The members count as the lead does, so they sample the same passes and share them.
                tap.cost.thin, tap.cost.thin_always = cost.thin, cost.thin_always
                tap.throttle, tap.cost.always_stride, tap.throttle_reason = stride, always_stride, reason
                self.throttled += stride > 1 or always_stride > 1

    def _rescale(self, taps: list[Tap], groups: list[list[int]]) -> None:
        """Moves :attr:`scale` toward the groups' measured cost per sampled pass over their estimates."""
        measured = estimated = 0.0
        for group in groups:
            fresh = [taps[i].cost.per_sampled for i in group if taps[i].cost.fresh]
            if fresh and taps[group[0]].cost.estimate > 0:
                # The most any member paid: the one that reduced, when the others reused its results.
                measured += max(fresh)
                estimated += taps[group[0]].cost.estimate
        if estimated > 0:
            # Bounded: a tap that reuses another's reduction measures ~0, and estimates made at one batch
            # size meet passes of another; neither may make admission refuse or admit everything.
            ratio = min(_SCALE_MAX, max(1 / _SCALE_MAX, measured / estimated))
            self.scale += _SCALE_RATE * (ratio - self.scale)

    @staticmethod
    def _shares(taps: list[Tap], demands: list[float], room: float) -> list[float]:
        """Max-min fair shares of ``room``: across principals (``Tap.owner``), then across each one's taps."""
        owners: dict[str, list[int]] = {}
        for i, tap in enumerate(taps):
            owners.setdefault(tap.owner, []).append(i)
        groups = list(owners.values())
        shares = [0.0] * len(taps)
        for group, owner_share in zip(groups, fair_shares(room, [sum(demands[i] for i in g) for g in groups])):
            for i, share in zip(group, fair_shares(owner_share, [demands[i] for i in group])):
                shares[i] = share
        return shares


def _unthrottle(tap: Tap) -> None:
    tap.throttle, tap.cost.always_stride, tap.throttle_reason = 1, 1, ""


def _stride(demand: float, share: float) -> int:
    """1 in how many runs fit ``demand`` into ``share``."""
    if demand <= share * (1 + 1e-9):
        return 1
    return MAX_STRIDE if share <= 0 else min(MAX_STRIDE, math.ceil(demand / share))


def share_key(tap: Tap) -> Hashable:
    """Equal for taps whose sampled passes reduce the same tensors the same way (``taps.reuse``): the same
    plan, layers, point, phases, request and padding, each sampling every pass it sees. A timed plan
    (latency) shares nothing."""
    spec = tap.spec
    sampling = spec.sampling
    # Only taps that sample every pass they see are in step: every_n counts from each tap's birth, and
    # probability and max_per_second draw and meter per tap.
    if tap.plan.reuse_key is None or tap.layer_plans or sampling.every_n > 1 or sampling.probability \
            or sampling.max_per_second:
        return id(tap)
    return (spec.point, tuple(tap.layers), tap.plan.reuse_key, tap.phases, tap.request_id, spec.keep_padding,
            spec.derive)


def _groups(taps: list[Tap]) -> list[list[int]]:
    """Indices of ``taps`` grouped by :func:`share_key`, each group in the taps' order (its lead first)."""
    groups: dict[Hashable, list[int]] = {}
    for i, tap in enumerate(taps):
        groups.setdefault(share_key(tap), []).append(i)
    return list(groups.values())


def _phase(tap: Tap, stride: int) -> int:
    return zlib.crc32(tap.id.encode()) % stride


def _follow(kept: float, measured: float) -> float:
    """A cost per pass that rises at once and falls by :data:`_COST_FALL` of the gap a window.

    Why: a sampled pass's publishing and delivery land after it, often in a later window, so the window
    that holds a thinned tap's sampled pass sees its hook time alone; taken as the whole cost, the stride
    fell to 3 for thirty wide subscribers, and the next windows paid for it.
    """
    return measured if measured >= kept else kept + _COST_FALL * (measured - kept)


def _account(cost: TapCost, passes: int) -> tuple[float, float]:
    """A tap's full-rate demands (seconds a pass: its sampled passes', its always-on part's) from its
    window's figures, which it then clears. A cost per pass is kept from an earlier window when this
    one measured none."""
    cost.fresh = cost.sampled_passes > 0
    if cost.sampled_passes:
        cost.per_sampled = _follow(cost.per_sampled, cost.sampled_seconds / cost.sampled_passes)
        cost.sampled_seconds = 0.0
    if cost.always_passes:
        cost.per_always = _follow(cost.per_always, cost.always_seconds / cost.always_passes)
        cost.always_seconds = 0.0
    # Seconds with no pass to divide by are kept for the next window: publishing lands after its pass,
    # often in the next window, and a thinned tap's window may hold none of its sampled passes.
    demands = cost.per_sampled * cost.picked / passes, cost.per_always * cost.eligible / passes
    cost.sampled_passes = cost.picked = cost.always_passes = cost.eligible = 0
    return demands
