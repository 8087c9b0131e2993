"""The plan path: a firing's tensors reduced by its tap's reducer plan into the pass's buffer.

Why its own module: it is what a firing that is not one ``layertap::tap_stats``
call does (distribution reducers, derived quantities, request cuts and
padding folds, tensors the op cannot read; ``taps.firing`` says which), and
the engine keeps the registry and the pass's end. It reuses a reduction an
equal plan ran on the very same tensor (``taps.reuse``), and defers small
tensors of basic plans to one reduction when the pass ends
(``reducers.batched``).

Model thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from layertap.server.compile.stats import CompiledStats
from layertap.server.host.hooks import CallArgs, ParamGrad
from layertap.server.host.model_host import PassContext, flatten_tensors
from layertap.server.reducers.batched import PassBatch, Row
from layertap.server.reducers.derive import derive
from layertap.server.reducers.transfer import PassBuffer
from layertap.server.stream.publisher import Piece
from layertap.server.taps.reuse import PassReuse, passthrough_parents
from layertap.server.taps.tap import Tap

__all__ = ["PlanPath"]


class PlanPath:
    """Reduces plan-path firings into the pass (see the module docstring).

    Args:
        modules: The hosted model's named modules (for ``taps.reuse``'s pass-through containers).
        stats: The compiled basic-statistics kernel of the small-tensor batch; None: eager.
        decide: Settles a tap's pass (``PassDecisions.decide``).
        pass_buffer: The current pass's buffer and pieces, made on first use.
        fail: Disables a tap whose reducer raised (a reducer must never fail inference).
    """

    def __init__(self, modules: Mapping[str, nn.Module], stats: CompiledStats | None,
                 decide: Callable[[Tap, PassContext], None],
                 pass_buffer: Callable[[], tuple[PassBuffer, list[Piece[Tap]]]],
                 fail: Callable[[Tap, str, BaseException], None]) -> None:
        #: Reductions of this pass a later firing may reuse.
        self.reuse = PassReuse(passthrough_parents(modules))
        #: Whether two firings of a pass can see one tensor (:meth:`PassReuse.possible`); the engine sets it.
        self.reuse_on = False
        #: The pass's small tensors, reduced together when it ends (``reducers.batched``).
        self.batch = PassBatch(kernel=stats)
        #: Whether small tensors are batched (benchmarks turn it off to compare).
        self.batch_small = True
        self._decide, self._pass_buffer, self._fail = decide, pass_buffer, fail

    def fire(self, tap: Tap, layer: str, ctx: PassContext, value: Any) -> None:
        """Reduces the tensors of ``value`` (a hook's value for ``tap`` at ``layer``) into the pass."""
        if ctx.active or tap.disabled:
            self.reuse.clear()  # whatever ran since the last firing is unknown
            return  # active-capture passes are never fed to taps
        if tap._pass != ctx.index:
            self._decide(tap, ctx)
        if not tap._on:
            return  # as if the tap had no hook: nothing reduced, nothing for reuse to forget
        t0 = time.perf_counter()
        tensors: Sequence[tuple[str, torch.Tensor]]
        if isinstance(value, torch.Tensor):  # the common case (a layer's output): nothing to unpack
            slot: str | tuple[str, int] = layer
            offset, keyword_from, tensors = 0, None, (("", value),)
        else:
            # A gradient arrives one tensor at a time: count calls per tensor position
            # (as captures do), so a module's parameters all belong to call 0.
            grad = isinstance(value, ParamGrad)
            slot = (layer, value.position) if grad else layer
            # A parameter gradient reports its position among the module's parameters.
            offset = value.position if grad else 0
            # Keyword tensors (after the positional ones) carry their path; nothing to build otherwise.
            keyword_from = value.positional if isinstance(value, CallArgs) else None
            tensors = flatten_tensors(value)
        calls = tap.calls
        call = calls.get(slot, 0)
        calls[slot] = call + 1
        reuse = self.reuse_on
        if reuse:
            self.reuse.at(layer, tap.spec.point, call)
        plan = tap.layer_plans.get(layer, tap.plan) if tap._sampled else tap.always
        lap = tap.timer.take(layer) if tap.timer is not None else None
        if plan is None:
            return
        buffer, pieces = self._pass_buffer()
        cut, padding = tap._cut, tap._padding
        try:
            key: Hashable | None = plan.reuse_key if reuse else None  # None: reduced afresh, nothing held
            derivation = tap.derive
            if derivation is not None and key is not None:
                key = (key, "derive", tap.spec.derive)  # the entropy's result is not the tensor's
            if cut is not None and key is not None:
                # Reused only for the same cut of the same tensor: never the whole tensor's result, nor another request's.
                key = (key, cut.key)
            for i, (name, tensor) in enumerate(tensors):
                # Derived before the cut and the fold: a (batch, tokens) result is cut and folded as any such tensor.
                read = tensor if derivation is None else derive(derivation, tensor)
                part = read if cut is None else cut(read)
                if part is None:
                    continue  # it mixes this request's rows with others': not this request's to see
                run, k, fold = plan, key, None
                # A 2-D (batch, tokens) tensor folds to 1-D: a per-channel reducer would have no axis left, so
                # such a tensor keeps its padding when the plan has one (the tap must not die on a padded pass).
                if padding is not None and padding.fits(part) and (part.dim() > 2 or plan.folded() is plan):
                    # Nor is a selection's result the whole tensor's.
                    run, k, fold = plan.folded(), (None if key is None else (key, padding.key)), padding
                vec = self.reuse.get(k, tensor) if k is not None else None
                if vec is None:
                    read = part if fold is None else fold(part)
                    # Small tensors of basic-only plans: a copy now, their statistics with the pass's others at its end.
                    vec = self.batch.defer(read) if run.basic_layout is not None and self.batch_small else None
                    if vec is None:
                        vec = run.run(read)
                    if k is not None:
                        self.reuse.put(k, tensor, vec)
                shape = tuple(part.shape) if fold is None else fold.shape(part)
                if isinstance(vec, Row):
                    vec.keys.append(len(pieces))
                else:
                    buffer.add(len(pieces), vec)
                pieces.append(Piece(tap, layer, offset + i, call, shape, run, tap._sampled,
                                    lap if plan.timed else None,
                                    name if keyword_from is not None and i >= keyword_from else "",
                                    None if cut is None else cut.rows))
        except Exception as exc:  # noqa: BLE001 - a reducer must never fail inference
            self._fail(tap, layer, exc)
        finally:
            tap._spent += time.perf_counter() - t0  # the pass's total is its layer hooks' (taps.layer_hooks)

