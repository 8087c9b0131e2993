"""Stream taps that subscribers share: identical unnamed specs of one principal are one tap.

Why: thirty subscribers asking for the same statistics of the same layers made
thirty taps, and although the engine reduced each tensor once for them
(``taps.reuse``), each tap still had its own pieces, summaries and messages:
a sampled pass of 67 wide layers wrote 2,010 summaries, about 150 ms of the
host-transfer thread's and the streams' time on the GIL the model needs. A
shared tap writes one set, and the broker hands each subscriber the same
summaries' bytes (the fan-out, off the model thread).

What is shared: a stream tap whose spec is unnamed and draws nothing of its
own (no ``probability``, no ``max_per_second``: each subscriber of those
expects its own draws), for the same principal (the overhead budget's
fairness and the ``tap`` scope's ownership stay per principal). Each
subscriber still gets every summary and event of the tap, and the tap goes
when its last subscriber does.
"""

from __future__ import annotations

import threading

from layertap.v1 import telemetry_pb2 as pb

__all__ = ["SharedStreams"]


class SharedStreams:
    """Who subscribes to which shared stream tap: tap ids by spec, and subscribers by tap id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_spec: dict[tuple[str, bytes], str] = {}
        self._spec_of: dict[str, tuple[str, bytes]] = {}
        self._subscribers: dict[str, int] = {}

    @staticmethod
    def key(spec: pb.TapSpec, owner: str) -> tuple[str, bytes] | None:
        """What makes two subscribers' stream taps one; None for a spec that is never shared."""
        sampling = spec.sampling
        if spec.name or sampling.probability or sampling.max_per_second:
            return None
        return owner, spec.SerializeToString(deterministic=True)

    def join(self, spec: pb.TapSpec, owner: str) -> str | None:
        """The id of a live shared tap for this spec, counted as one more subscriber; None: make one."""
        key = self.key(spec, owner)
        if key is None:
            return None
        with self._lock:
            tap_id = self._by_spec.get(key)
            if tap_id is not None:
                self._subscribers[tap_id] += 1
            return tap_id

    def add(self, tap_id: str, spec: pb.TapSpec, owner: str) -> None:
        """A stream tap just made for ``spec``, with its first subscriber; shared from now on if it can be."""
        key = self.key(spec, owner)
        with self._lock:
            self._subscribers[tap_id] = 1
            if key is not None and key not in self._by_spec:  # two made at once: the second stays its own
                self._by_spec[key] = tap_id
                self._spec_of[tap_id] = key

    def leave(self, tap_id: str) -> bool:
        """One subscriber fewer; True when it was the last (the caller deletes the tap)."""
        with self._lock:
            left = self._subscribers.get(tap_id, 1) - 1
            if left > 0:
                self._subscribers[tap_id] = left
                return False
            self._forget(tap_id)
            return True

    def unshare(self, tap_id: str) -> None:
        """No one joins this tap any more (it failed); those who follow it keep their places."""
        with self._lock:
            key = self._spec_of.pop(tap_id, None)
            if key is not None and self._by_spec.get(key) == tap_id:
                del self._by_spec[key]

    def forget(self, tap_id: str) -> None:
        """The tap is gone (ended, failed, deleted): no subscriber joins it again."""
        with self._lock:
            self._forget(tap_id)

    def subscribers(self, tap_id: str) -> int:
        with self._lock:
            return self._subscribers.get(tap_id, 0)

    def _forget(self, tap_id: str) -> None:
        self._subscribers.pop(tap_id, None)
        key = self._spec_of.pop(tap_id, None)
        if key is not None and self._by_spec.get(key) == tap_id:
            del self._by_spec[key]
