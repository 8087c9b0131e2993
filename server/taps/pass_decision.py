"""What a tap does in a pass, settled once per pass: seen or not, sampled or not, which rows, which padding.

Why its own module: both paths of a firing read it, the plan path
(``taps.plan_path``) at a tap's first firing of the pass and the op path
(``taps.firing``) for every tap of its layout at the pass's first firing, so
that sampling reaches the op as a flag decided before any launch.

A tap sees a pass unless it is disabled, was made during it, the pass is of a phase it does not
name (``TapSpec.phases``), or, for a Generate request's inline tap, the pass
does not hold its request (``host.rows``). A pass it does not see takes no
sampling budget. Unless the tap keeps padding, a pass with an attention mask
has its padded positions left out (``host.padding``), after the request's cut.
"""

from __future__ import annotations

from layertap.server.host.model_host import PassContext
from layertap.server.host.padding import PaddingCut, PassPadding
from layertap.server.host.rows import RequestCut, find_request
from layertap.server.taps.tap import Tap

__all__ = ["PassDecisions"]


def thin(tap: Tap, picked: bool) -> tuple[bool, bool]:
    """Whether the tap samples this pass, and whether its always-on part runs, once the overhead budget
    (``taps.budget``) has thinned them: each runs 1 in its stride of the passes it would have run on."""
    cost = tap.cost
    before = (cost.thin, cost.thin_always)
    sampled = picked
    if picked:
        cost.picked += 1
        if tap.throttle > 1:
            cost.thin += 1
            sampled = cost.thin >= tap.throttle
            if sampled:
                cost.thin = 0
        cost.sampled_passes += sampled
    always = not sampled and tap.always is not None
    if always:
        cost.eligible += 1
        if cost.always_stride > 1:
            cost.thin_always += 1
            always = cost.thin_always >= cost.always_stride
            if always:
                cost.thin_always = 0
        cost.always_passes += always
    cost.last = (picked, sampled, not sampled and tap.always is not None, always, *before)
    return sampled, always


def refund(tap: Tap) -> None:
    """The pass decided for ``tap`` ran none of its layers (a branch the model skipped, a gradient tap
    on a pass with no backward): its sampling budget and the budget's counts are given back, so that a
    pass the tap does not see takes none of them, as when each tap was decided at its first firing."""
    if tap._skip:
        return  # nothing was spent
    tap.sampler.refund()
    tap.cost.refund()


class PassDecisions:
    """Decides each tap's pass; holds the current pass's padding, made at the first tap that leaves it out.

    Model thread only.
    """

    def __init__(self) -> None:
        self._padding: tuple[int, PassPadding | None] = (-1, None)

    def decide(self, tap: Tap, ctx: PassContext) -> None:
        """Settles what ``tap`` does in this pass, once, at its first firing (or its layout's)."""
        if tap._pass == ctx.index:
            return
        # Cleared before anything that may raise: a firing later in the pass never sees the last pass's state.
        tap.calls.clear()
        tap.settle()  # before _sampled changes
        tap._padding = tap._cut = None
        tap._skip, tap._sampled, tap._on = True, False, False
        tap._pass = ctx.index
        tap._skip = tap.disabled or tap.born == ctx.index or not self._feeds(tap, ctx)
        if not tap._skip:  # a pass the tap does not see takes no sampling budget
            sampled, always = thin(tap, tap.sampler.sample())
            tap._sampled, tap._on = sampled, sampled or always
            tap._padding = self._padding_of(tap, ctx)

    def pass_ended(self) -> None:
        self._padding = (-1, None)

    @staticmethod
    def _feeds(tap: Tap, ctx: PassContext) -> bool:
        """Whether this pass is one the tap sees; sets its request's cut for the pass."""
        tap._cut = None
        if tap.phases is not None and ctx.phase not in tap.phases:
            return False
        if tap.request_id is not None:
            rows = find_request(ctx, tap.request_id)
            if rows is None:
                return False
            tap._cut = RequestCut(ctx, rows)
        return True

    def _padding_of(self, tap: Tap, ctx: PassContext) -> PaddingCut | None:
        """What of this pass's tensors the tap leaves out as padding: None keeps them whole."""
        if ctx.attention_mask is None or tap.spec.keep_padding:
            return None
        index, padding = self._padding
        if index != ctx.index or padding is None:
            padding = PassPadding(ctx.attention_mask)
            self._padding = (ctx.index, padding)
        if tap._cut is None:
            return padding.cut()
        # The mask cut as the request's tensors are: its rows, less the padding they share.
        return padding.cut(tap._cut.rows.rows, tap._cut.pad)
