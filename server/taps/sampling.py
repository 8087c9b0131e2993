"""Sampling policies: which live passes a tap runs its reducers on.

Every-N, probability p and a rate cap (token bucket) compose: a pass is
sampled only if all configured policies agree. The clock and the random
source are injectable so tests need no sleeps.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable

from layertap.server.errors import InvalidField
from layertap.v1 import telemetry_pb2 as pb

Clock = Callable[[], float]


class Sampler:
    """Decides, once per pass, whether a tap samples it."""

    def __init__(self, spec: pb.Sampling, *, clock: Clock = time.monotonic,
                 rng: random.Random | None = None, field: str = "sampling") -> None:
        # NaN compares false both ways, so it must be refused explicitly
        # (it used to slip through and mean "always").
        if not (0 <= spec.probability <= 1):
            raise InvalidField(f"{field}.probability", f"must be in [0, 1], got {spec.probability}")
        if not (0 <= spec.max_per_second < math.inf):
            raise InvalidField(f"{field}.max_per_second", f"must be finite and >= 0, got {spec.max_per_second}")
        self.every_n = max(1, spec.every_n)
        self.probability = spec.probability
        self.rate = spec.max_per_second
        self._clock = clock
        self._rng = rng or random.Random()
        self._seen = 0
        # Token bucket: burst of one second's worth (at least one token).
        self._capacity = max(1.0, self.rate)
        self._tokens = self._capacity
        self._last = clock()
        self._took = False  # the last sample() spent a token

    def sample(self) -> bool:
        """Called once per live pass; True when the reducers should run."""
        seen = self._seen
        self._seen += 1
        self._took = False
        if seen % self.every_n:
            return False
        if self.probability and self._rng.random() >= self.probability:
            return False
        if self.rate:
            now = self._clock()
            self._tokens = min(self._capacity, self._tokens + (now - self._last) * self.rate)
            self._last = now
            if self._tokens < 1.0:
                return False
            self._tokens -= 1.0
            self._took = True
        return True

    def refund(self) -> None:
        """Undoes the last :meth:`sample`: the pass turned out not to be the tap's (none of its layers ran),
        and a pass a tap does not see takes none of its sampling budget."""
        self._seen -= 1
        if self._took:
            self._tokens = min(self._capacity, self._tokens + 1.0)
            self._took = False
