"""Training steps as passes: where one step begins and ends, seen from the model.

A pass on a training agent is one training step: every training forward and
backward of the step, then the optimizer's step. Boundaries:

* With an optimizer, the step opens at its first training forward (or at the
  optimizer's pre-step if no forward came) and closes after ``optimizer.step()``
  (its post-step hook). Gradient accumulation is several forwards and
  backwards inside one step: each summary's ``call_index`` is the micro-batch.
* Without one, ``with agent.step(i):`` marks the step.
* Parameter gradients are read once per step, at the optimizer's pre-step (or
  the end of the ``step`` block): they are then what the optimizer uses, DDP's
  all-reduce and the accumulation included.
* A forward with grad disabled or the model in eval mode is an evaluation
  forward: taps ignore it, inside a step or between steps.

Every hook here runs on the training thread, takes no lock an RPC holds, and
never raises into the user's loop (a failure is logged and counted).
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from layertap.server.host.hooks import in_backward
from layertap.server.host.model_host import ModelHost, PassContext

log = logging.getLogger("layertap.server")


_INT64 = (-(1 << 63), (1 << 63) - 1)


def step_number(value: Any, name: str = "step") -> int:
    """``value`` as a step number: an integer (numpy and torch integers too) in int64.

    Summaries, capture headers and incidents all carry it as a protobuf
    int64; one check here, where the user hands it over, keeps them in
    agreement and turns a float or an overflow into a clear error at the call.

    Raises:
        TypeError: Not an integer (a float such as 3.0 included).
        ValueError: Outside int64.
    """
    if isinstance(value, bool):  # an int to Python, but never a step number
        raise TypeError(f"{name} must be an integer, got bool {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None
    if not _INT64[0] <= number <= _INT64[1]:
        raise ValueError(f"{name} {number} is outside int64, the range summaries and captures carry")
    return number


class StepTracker:
    """Opens and closes the host's passes at training-step boundaries.

    Args:
        host: A training host (``ModelHost(training=True)``).
        optimizer: Its step hooks delimit steps; None: ``step()`` does.
        start_step: The number of the first optimizer step.
    """

    def __init__(self, host: ModelHost, optimizer: torch.optim.Optimizer | None = None, *,
                 start_step: int = 0) -> None:
        self.host = host
        self.optimizer = optimizer
        #: The number the next optimizer-delimited step gets.
        self.next_step = step_number(start_step, "start_step")
        #: Hook failures swallowed so the training loop went on.
        self.errors = 0
        self._ctx: PassContext | None = None
        #: One entry per root forward in flight: [evaluation forward, completed].
        self._forwards: list[list[bool]] = []
        root = host.module
        self._handles: list[RemovableHandle] = [
            root.register_forward_pre_hook(self._guard(self._forward_begins)),
            root.register_forward_hook(self._guard(self._forward_completed)),
            root.register_forward_hook(self._guard(self._forward_ends), always_call=True),
        ]
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._guard(self._pre_step)))
            self._handles.append(optimizer.register_step_post_hook(self._guard(self._post_step)))

    @property
    def current(self) -> PassContext | None:
        """The step in progress, if any."""
        return self._ctx

    def _guard(self, hook: Callable[..., None]) -> Callable[..., None]:
        def run(*args: Any) -> None:
            try:
                hook(*args)
            except Exception:  # never into the user's loop
                self.errors += 1
                log.exception("layertap step hook failed; the training step went on")

        return run

    # -- the model's forwards ----------------------------------------------------
    def _forward_begins(self, module: torch.nn.Module, _args: Any) -> None:
        evaluation = not (torch.is_grad_enabled() and module.training)
        self._forwards.append([evaluation, False])
        if evaluation:
            self.host.quiet = True
        elif self._ctx is None and self.optimizer is not None:
            self._open(self.next_step)

    def _forward_completed(self, _module: torch.nn.Module, _args: Any, _out: Any) -> None:
        """An ordinary forward hook: torch runs it only when the forward returned."""
        if self._forwards:
            self._forwards[-1][1] = True

    def _forward_ends(self, _module: torch.nn.Module, _args: Any, _out: Any) -> None:
        evaluation, completed = self._forwards.pop() if self._forwards else (True, True)
        self.host.quiet = any(e for e, _ in self._forwards)
        # This always_call hook also runs when the forward raised (torch calls
        # it from its ``except``): that step's tensors are partial, so it
        # publishes nothing. ``sys.exc_info()`` cannot tell: a loop running
        # inside the user's own ``except`` block (a retry after an OOM) has an
        # exception in flight on every step.
        # A recompute in backward (activation checkpointing) may end early on
        # purpose: torch stops it by raising through the forward once it has
        # what backward needs. Only a forward the user ran can fail a step.
        if not evaluation and not completed and self._ctx is not None and not in_backward():
            self._ctx.failed = True

    # -- the optimizer's step ----------------------------------------------------
    def _pre_step(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        if self._ctx is None:
            self._open(self.next_step)
        self.host.read_param_grads()

    def _post_step(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        self._close()
        self.next_step += 1

    # -- marked steps ------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, index: int) -> Iterator[PassContext]:
        """Mark one training step (forwards, backwards, optimizer step) when no optimizer was given.

        Raises:
            RuntimeError: The agent has an optimizer (its hooks mark steps), or
                a step is already open.
            TypeError: ``index`` is not an integer.
            ValueError: ``index`` is outside int64.
        """
        if self.optimizer is not None:
            raise RuntimeError("this agent was attached with optimizer=; its step hooks mark the steps, "
                               "so agent.step() is not needed")
        index = step_number(index)
        if self._ctx is not None:
            raise RuntimeError(f"step {self._ctx.step} is still open; steps do not nest")
        ctx = self._open(index)
        try:
            yield ctx
        except BaseException:
            ctx.failed = True
            raise
        finally:
            if not ctx.failed:
                self._guard(self.host.read_param_grads)()
            self._guard(self._close)()

    def _open(self, step: int) -> PassContext:
        # next_step counts up from start_step: past int64 the step opens no
        # pass (the guard logs and counts it) rather than wrapping on the wire.
        self._ctx = self.host.begin_pass(step=step_number(step))
        return self._ctx

    def _close(self) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            self.host.end_pass(ctx)

    def close(self) -> None:
        """Remove the step hooks; a step still open ends (its summaries are published)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.host.quiet = False
        self._close()
