"""An explanation's internal batches: each its own pass on the model thread, under the model lock.

Captum runs all of an attribution's internal batches in one call. Under the
model lock that would hold every Infer back until the last batch; so an
explanation runs each batch as one call of :meth:`ExplainPasses.run`, a pass
of its own (``host.on_model_thread``, ``host.pass_context``), and gives the
model back in between: an Infer queued on the model thread runs before the
next batch. Each pass:

* is marked active (``EXPLAIN_OWNER``), so taps, baselines and passive
  captures skip it;
* runs the model in eval mode, as an explanation of a prediction should
  (BatchNorm uses, never updates, its running statistics, dropout is off),
  and puts each module's own ``training`` flag back before the lock goes;
* runs with gradients on. Captum differentiates with ``torch.autograd.grad``
  with respect to its inputs or a layer's output only, so no parameter's
  ``.grad`` changes.

Before each batch, on the model thread, the call's deadline and liveness
are checked: past the deadline no further batch starts, and the explanation
ends with DEADLINE_EXCEEDED; a cancelled call ends the same way (no one reads
the answer), and sets :attr:`ExplainPasses.cancelled` so that the metrics
count it as CANCELLED, not as a deadline the caller never set.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch

from layertap.server.errors import DeadlineExceeded, LimitExceeded
from layertap.server.explain.options import EXPLAIN_OWNER
from layertap.server.host.model_host import ModelHost

__all__ = ["ExplainPasses"]

_T = TypeVar("_T")
#: Seconds before the deadline within which an inactive call counts as past its deadline.
_DEADLINE_SLACK_S = 0.05


class ExplainPasses:
    """Runs one explanation's batches as passes, counts them and stops them at the deadline.

    Args:
        host: The model host.
        deadline: ``clock()`` value after which no batch starts; None: none.
        alive: False once the call is cancelled (``context.is_active``).
        clock: Seconds, monotonic (tests give their own).
    """

    def __init__(self, host: ModelHost, *, deadline: float | None = None, alive: Callable[[], bool] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.host = host
        self.deadline = deadline
        self.alive = alive
        self.clock = clock
        #: Passes run (begun) so far.
        self.batches = 0
        #: Passes the explanation plans, once known (for the deadline's message).
        self.planned = 0
        #: True once a check found the call cancelled.
        self.cancelled = False

    def _check(self) -> None:
        planned = f" of {self.planned}" if self.planned else ""
        # gRPC makes a call inactive when its deadline passes, too: within a moment of the
        # deadline an inactive call counts as past it, not as cancelled.
        now = self.clock()
        past = self.deadline is not None and now >= self.deadline - _DEADLINE_SLACK_S
        if self.alive is not None and not self.alive() and not past:
            self.cancelled = True
            raise DeadlineExceeded(f"Explain was cancelled after {self.batches}{planned} internal batches")
        if past or (self.alive is not None and not self.alive()):
            raise DeadlineExceeded(f"Explain passed its deadline after {self.batches}{planned} internal batches; "
                                   "give it more time, fewer n_steps or a larger internal_batch_size")

    def run(self, fn: Callable[..., _T], *args: object) -> _T:
        """``fn(*args)`` as one Explain pass on the model thread; see the module docstring.

        Raises:
            DeadlineExceeded: The deadline passed (or the call was cancelled) before the pass began.
            LimitExceeded: The device ran out of memory.
        """
        return self.host.on_model_thread(self._pass, fn, args)

    def _pass(self, fn: Callable[..., _T], args: tuple[object, ...]) -> _T:
        self._check()  # here, after any Infer queued ahead of this batch has run
        self.batches += 1
        model = self.host.module
        modes = [(m, m.training) for m in model.modules()]
        with self.host.pass_context(active_owner=EXPLAIN_OWNER), torch.enable_grad():
            try:
                model.eval()
                return fn(*args)
            except torch.OutOfMemoryError:
                raise LimitExceeded("the device ran out of memory for this pass; send a smaller batch or a smaller "
                                    "internal_batch_size") from None
            finally:
                for module, training in modes:
                    module.training = training
