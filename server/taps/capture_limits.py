"""What captures may hold at once: slots (calls in flight) and the shared byte budget.

Both hand out tokens that give back what they took exactly once, whichever
thread gets there first: the RPC thread at the end of a stream, the model
thread when a pass is dropped, or gRPC's callback thread when a client
vanishes. The counters change only through those tokens, so a release that
runs twice cannot push them below zero or let extra captures in.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from layertap.server.errors import LimitExceeded

__all__ = ["CaptureBudget", "CaptureLimits", "CaptureSlot", "CaptureSlots", "Reservation"]


@dataclass
class CaptureLimits:
    max_bytes: int = 256 << 20
    max_passes: int = 16
    max_concurrent: int = 8
    #: Bytes all captures' live clones may hold together (``--capture-budget-bytes``).
    budget_bytes: int = 1 << 30
    #: Seconds a passive capture waits for a live pass (``--max-capture-wait``).
    max_wait: float = 60.0


class CaptureSlot:
    """One admitted capture; :meth:`release` frees the slot once, from any thread."""

    __slots__ = ("_slots", "_released")

    def __init__(self, slots: CaptureSlots) -> None:
        self._slots = slots
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> bool:
        """Give the slot back; True for the one call that did, False for any later one."""
        return self._slots._release(self)


class CaptureSlots:
    """Counts concurrent captures against the server limit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._active = 0

    @property
    def active(self) -> int:
        """Captures holding a slot now (never negative: see :class:`CaptureSlot`)."""
        return self._active

    def acquire(self) -> CaptureSlot:
        """A slot, or RESOURCE_EXHAUSTED when ``limit`` captures already run."""
        with self._lock:
            if self._active >= self.limit:
                raise LimitExceeded(
                    f"{self._active} captures already running, the server limit is {self.limit}; retry later"
                )
            self._active += 1
            return CaptureSlot(self)

    def _release(self, slot: CaptureSlot) -> bool:
        if slot._slots is not self:
            raise ValueError("this slot belongs to another CaptureSlots")
        # Flag and counter change under one lock: the test-and-set that makes
        # a racing second release a no-op instead of a second decrement.
        with self._lock:
            if slot._released:
                return False
            slot._released = True
            self._active -= 1
            return True


class Reservation:
    """Bytes one captured pass holds of the :class:`CaptureBudget`.

    It grows as the pass's hooks clone tensors and is returned whole by
    :meth:`release`; after that it can neither grow nor release again.
    """

    __slots__ = ("_budget", "nbytes", "_released")

    def __init__(self, budget: CaptureBudget) -> None:
        self._budget = budget
        self.nbytes = 0
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def grow(self, nbytes: int) -> bool:
        """Take ``nbytes`` more if the budget has them (all or nothing)."""
        return self._budget._grow(self, nbytes)

    def release(self) -> int:
        """Return everything held; the bytes returned (0 after the first call)."""
        return self._budget._release(self)


class CaptureBudget:
    """Device bytes that every capture's live clones count against, server-wide.

    A clone is reserved in the hook before it is made and returned when its
    pass has been sent, dropped, or its capture ended. What happens past the
    budget is the capture's policy (see ``CaptureSession``): a passive capture
    skips the pass and :meth:`count_skipped` records it.

    Args:
        limit: ``--capture-budget-bytes``.
        on_skip: Called once per skipped pass (the Prometheus counter).
    """

    def __init__(self, limit: int, on_skip: Callable[[], None] | None = None) -> None:
        self.limit = limit
        self._on_skip = on_skip
        self._lock = threading.Lock()
        self._held = 0
        self._skipped = 0

    @property
    def held(self) -> int:
        """Bytes reserved by live clones now."""
        return self._held

    @property
    def skipped(self) -> int:
        """Passes that passive captures skipped over the budget, since start."""
        return self._skipped

    def reservation(self) -> Reservation:
        return Reservation(self)

    def count_skipped(self) -> None:
        with self._lock:
            self._skipped += 1
        if self._on_skip is not None:
            self._on_skip()

    def _grow(self, res: Reservation, nbytes: int) -> bool:
        if res._budget is not self:
            raise ValueError("this reservation belongs to another CaptureBudget")
        with self._lock:
            if res._released or self._held + nbytes > self.limit:
                return False
            self._held += nbytes
            res.nbytes += nbytes
            return True

    def _release(self, res: Reservation) -> int:
        # Swap to zero under the lock: whichever thread comes first returns
        # the bytes, the others return nothing.
        with self._lock:
            res._released = True
            nbytes, res.nbytes = res.nbytes, 0
            self._held -= nbytes
            return nbytes
