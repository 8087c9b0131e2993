"""A basic tap's firing as one op call: the tap set compiled into rows of one pass buffer.

Why: a firing used to run the reducer plan in Python between the model's
layers (workspace, shift, kernel call, piece), about 80 us each on the 2-core
CPU and 0.8 ms on a GPU, where the device idled meanwhile. Here a tap change
compiles the taps whose every plan is basic (``moments``, ``minmax``,
``nonfinite``, ...) into an :class:`OpLayout`: for each hooked module, the rows
of the pass buffer its calls write and the tap's flag. A firing then looks up
its :class:`Firing`, makes one ``layertap::tap_stats`` call and appends one
tuple; the pass's pieces are built from the layout when the pass ends.

Taps on one module share its rows: the op writes every basic statistic, and
hooks of one module call run back to back on the same output, so the first
firing of a call computes the row and the others only name it (30 basic
taps on a layer cost one call).

Sampling (``every``, ``probability``, ``max_rate``) and ``phases`` are decided
once per pass, at its first firing, for every tap of the layout (so a tap on
a layer that runs only in some passes, a vision encoder at prefill, spends
its sampling budget on every pass: unlike the plan path, where a pass that
never fires the tap takes none), and reach
the op as an int32 flag per module (on when one of its taps is): a sampled-out module's call returns at once,
so every pass makes the same calls in the same order (what a CUDA graph
needs to capture a pass once). On CUDA the flags go to the device in one
copy per pass from a small ring of pinned buffers.

What stays on the plan path (``taps.plan_path``), as ``TapInfo.serving``
says: integer, bool and fp8 tensors, tuples and gradients, plans with a
histogram, quantiles, per-channel or latency reducer, derived quantities,
request taps, and a module called more often
in a pass than its rows (the layout grows for the next pass).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from layertap.server.host.model_host import PassContext
from layertap.server.host.padding import PaddingCut
from layertap.server.reducers.op import FLOAT_DTYPES, IDENTITY, MAX_DIMS, new_rows, reset_rows, tap_stats_op
from layertap.server.reducers.plan import ReducerPlan
from layertap.server.reducers.transfer import PassBuffer
from layertap.server.stream.publisher import Piece
from layertap.server.taps.tap import Tap
from layertap.v1 import telemetry_pb2 as pb

#: The plan path a firing hands a value to: ``PlanPath.fire(tap, layer, ctx, value)`` (``taps.plan_path``).
PlanPath = Callable[[Tap, str, PassContext, Any], None]
#: Disables a tap whose reduction raised: ``TapEngine._fail(tap, layer, exc)``.
Fail = Callable[[Tap, str, BaseException], None]

__all__ = ["Firing", "OpLayout", "op_eligible"]

#: Pinned flag buffers a CUDA layout cycles through: a pass never rewrites one its copy may still read.
_FLAG_RING = 4


def op_eligible(tap: Tap) -> bool:
    """Whether every firing of ``tap`` on a float tensor can be one op call."""
    return plans_op_eligible([tap.plan, *tap.layer_plans.values()], derived=tap.derive is not None,
                             request=tap.request_id is not None, point=tap.spec.point)


def plans_op_eligible(plans: Sequence[ReducerPlan], *, derived: bool, request: bool, point: int) -> bool:
    """:func:`op_eligible` of a tap not made yet (``taps.cost_model`` estimates the path it will take)."""
    return (all(p.basic_layout is not None and not p.timed for p in plans) and not derived and not request
            and point == pb.POINT_OUTPUT)


class _Module:
    """The rows and flag one hooked module's firings share."""

    __slots__ = ("rows", "flag", "base", "taps", "pass_index", "done", "padding")

    def __init__(self) -> None:
        self.rows: tuple[torch.Tensor, ...] = ()
        self.flag: torch.Tensor | None = None
        self.base = 0
        self.taps: list[Tap] = []
        self.pass_index = -1
        #: Calls of the module this pass whose row is written.
        self.done = 0
        #: This pass's padding to leave out (its taps share it: one key), set with the flags.
        self.padding: PaddingCut | None = None


class Firing:
    """One hooked (tap, layer): the hook's callback.

    Made with the tap; :class:`OpLayout` binds it to its module's rows.
    Unbound, or for a value the op does not read, it hands the firing to the
    plan path.
    """

    __slots__ = ("tap", "layer", "plan_path", "fail", "layout", "module", "pass_index", "calls", "need", "hook")

    def __init__(self, tap: Tap, layer: str, plan_path: PlanPath, fail: Fail) -> None:
        self.tap, self.layer, self.plan_path, self.fail = tap, layer, plan_path, fail
        self.layout: OpLayout | None = None
        self.module: _Module | None = None
        self.pass_index = -1
        self.calls = 0
        #: The most calls seen in one pass: the layout's next rebuild gives the module as many rows.
        self.need = 1
        #: The layer hook that calls it (``taps.layer_hooks.LayerHook``; its ``fired`` says whether the layer ran).
        self.hook: Any = None

    def __call__(self, ctx: PassContext, value: Any) -> None:
        layout, module = self.layout, self.module
        if layout is None or module is None or ctx.active:
            self.plan_path(self.tap, self.layer, ctx, value)
            return
        if layout.pass_index != ctx.index:
            layout.start_pass(ctx)
        tap = self.tap
        if type(value) is not torch.Tensor or value.dtype not in FLOAT_DTYPES or value.device != layout.device \
                or value.layout != torch.strided or value.dim() > MAX_DIMS:
            if not tap._skip:
                self.plan_path(tap, self.layer, ctx, value)
            return
        if self.pass_index != ctx.index:
            self.pass_index, self.calls = ctx.index, 0
        call = self.calls
        self.calls = call + 1
        if call >= len(module.rows):
            # More calls than rows: the plan path takes this one, numbered as it comes.
            self.need = max(self.need, call + 1)
            layout.grow = True
            if not tap._skip:
                tap.calls[self.layer] = call
                self.plan_path(tap, self.layer, ctx, value)
            return
        if module.pass_index != ctx.index:
            module.pass_index, module.done = ctx.index, 0
        # Padding left out (the pass's mask, the module's: whichever tap makes the call): the op skips it.
        padding = module.padding
        if padding is not None and not padding.fits(value):
            padding = None
        if call >= module.done:  # the first of the module's firings for this call: the op call
            module.done = call + 1
            layout.dirty = True
            t0 = time.perf_counter()
            try:
                tap_stats_op(value.detach() if value.requires_grad else value, layout.out, module.rows[call],
                             module.flag, None if padding is None else padding.mask(layout.device))
            except Exception as exc:  # noqa: BLE001 - a reducer must never fail inference
                for other in module.taps:
                    if not other.disabled:
                        self.fail(other, self.layer, exc)
                return
            finally:
                layout.seconds += time.perf_counter() - t0
        if tap._on:
            layout.fired.append((self, call, value.shape if padding is None else padding.shape(value)))


class OpLayout:
    """The rows of one device's pass buffer, assigned to the hooked modules of the op-eligible taps.

    Built between passes (under the model lock) whenever taps change; read
    and written by the model thread only.
    """

    def __init__(self, firings: Iterable[Firing], device: torch.device,
                 decide: Callable[[Tap, PassContext], None], masked: bool = False) -> None:
        self.firings = tuple(firings)
        self.taps = tuple({id(f.tap): f.tap for f in self.firings}.values())
        if device.type == "cuda" and device.index is None:  # a tensor's device names its index
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._decide = decide
        modules: dict[tuple[str, int, bool], _Module] = {}
        need: dict[tuple[str, int, bool], int] = {}
        # Taps that leave padding out read a part of the tensor: never the whole tensor's row.
        keys = [(f.layer, int(f.tap.spec.point), masked and not f.tap.spec.keep_padding) for f in self.firings]
        for f, key in zip(self.firings, keys):
            module = modules.get(key)
            if module is None:
                module = modules[key] = _Module()
            module.taps.append(f.tap)
            need[key] = max(need.get(key, 1), f.need)
        self.modules = tuple(modules.values())
        rows = sum(need.values())
        self.out = new_rows(rows, device)
        self._identity = torch.tensor(IDENTITY, dtype=torch.float64, device=device)
        index = torch.arange(rows, dtype=torch.int64, device=device)
        flags = torch.zeros(len(self.modules), dtype=torch.int32, device=device)
        self._flags = flags
        self._ring = [torch.zeros(len(self.modules), dtype=torch.int32, pin_memory=True)
                      for _ in range(_FLAG_RING)] if device.type == "cuda" else [flags]
        #: Numpy views of the ring: a pass sets its flags with no torch op (``Tensor.numpy`` is four).
        self._ring_np = [t.numpy() for t in self._ring]
        self._events: list[torch.cuda.Event | None] = [None] * len(self._ring)
        self._turn = 0
        base = 0
        for i, (key, module) in enumerate(modules.items()):
            module.rows = tuple(index[base + c : base + c + 1] for c in range(need[key]))
            module.flag = flags[i : i + 1]
            module.base = base
            base += need[key]
        self.pass_index = -1
        #: This pass's firings whose tap is on: (firing, call, shape), in order.
        self.fired: list[tuple[Firing, int, tuple[int, ...]]] = []
        #: A firing had more calls than rows: rebuild with more after the pass.
        self.grow = False
        #: An op call was made this pass: the rows need their reset.
        self.dirty = False
        #: Model-thread seconds in the op calls this pass (the engine's hook time).
        self.seconds = 0.0
        #: The last pass's firings, piece offset and sampling, with the pieces and keys made for them.
        self._last: tuple[object, int, tuple[bool, ...], tuple[Piece[Tap], ...], list[list[int]]] = \
            (None, -1, (), (), [])
        # Bound last, once everything a firing reads exists (a training step may be running).
        for f, key in zip(self.firings, keys):
            f.module, f.pass_index, f.calls = modules[key], -1, 0
            f.layout = self

    def book(self) -> None:
        """Books this pass's seconds in op calls to the taps it sampled, for the budget; clears them."""
        seconds, self.seconds = self.seconds, 0.0
        sampled = [t for t in self.taps if t._sampled]
        for tap in sampled:  # the rest of it (flags 0 and 2) is the budget's fixed cost
            tap._spent += seconds / len(sampled)

    def unbind(self) -> None:
        """Hands every firing back to the plan path (a new layout replaces this one)."""
        for f in self.firings:
            if f.layout is self:
                f.layout, f.module = None, None

    def start_pass(self, ctx: PassContext) -> None:
        """Decides every tap's pass (sampling, phases) and sets the modules' flags: once per pass."""
        host = self._ring[self._turn]
        event = self._events[self._turn]
        if event is not None:
            event.synchronize()  # written four passes back: long done
        for tap in self.taps:
            self._decide(tap, ctx)
        flags = self._ring_np[self._turn]
        for i, module in enumerate(self.modules):
            # 1: a tap samples this pass; 2: only taps that keep nonfinite on every pass (the counts);
            # 0: none sees it. The call is made either way.
            taps = module.taps
            flags[i] = 1 if any(t._on and t._sampled for t in taps) else 2 if any(t._on for t in taps) else 0
            module.padding = next((t._padding for t in taps if not t._skip), None)
        if host is not self._flags:
            self._flags.copy_(host, non_blocking=True)
            recorded = self._events[self._turn] = torch.cuda.Event()  # type: ignore[no-untyped-call]
            recorded.record()
            self._turn = (self._turn + 1) % len(self._ring)
        self.pass_index = ctx.index  # last: a decision that raised is made again at the next firing

    def finish(self, ctx: PassContext, buffer: PassBuffer, pieces: list[Piece[Tap]]) -> None:
        """Adds this pass's rows to ``buffer`` as one block, with a piece per firing; resets the rows.

        Nothing is added for a pass that failed or that no tap of the layout saw.
        """
        fired, self.fired = self.fired, []
        if not self.dirty:
            return
        self.dirty = False
        # Rows are reset after any call, even one whose pieces are gone (a tap deleted mid-pass): the
        # next pass merges into the identity, never into this pass's values.
        block = self.out.clone() if fired and not ctx.failed and self.pass_index == ctx.index else None
        reset_rows(self.out, self._identity)
        if block is None:
            return
        offset = len(pieces)
        sampled = tuple(t._sampled for t in self.taps)
        # A steady server's passes fire alike: the pieces and keys of the last pass serve again.
        if fired == self._last[0] and offset == self._last[1] and sampled == self._last[2]:
            pieces.extend(self._last[3])
            buffer.add_rows(self._last[4], block)
            return
        keys: list[list[int]] = [[] for _ in range(self.out.shape[0])]
        made: list[Piece[Tap]] = []
        for firing, call, shape in fired:
            tap = firing.tap
            plan = tap.layer_plans.get(firing.layer, tap.plan) if tap._sampled else tap.always
            if plan is None or plan.basic_layout is None or firing.module is None:
                continue  # (a layer's plan replaced mid-pass by one the op cannot serve: the next pass has it)
            keys[firing.module.base + call].append(offset + len(made))
            made.append(Piece(tap, firing.layer, 0, call, tuple(shape), plan, tap._sampled))
        pieces.extend(made)
        buffer.add_rows(keys, block)
        self._last = (fired, offset, sampled, tuple(made), keys)
