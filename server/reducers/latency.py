"""The ``latency`` reducer: how long a tapped module's forward took.

Unlike the other reducers it reads no tensor: its value is a time measured
around the module by a :class:`LayerTimer` that the tap installs (a forward
pre-hook, and a forward hook that runs before every other forward hook of the
module). The reducer itself writes no device slot; the engine attaches the
pass's :class:`Lap` to the summary and :func:`fill_latency` resolves it on the
host-transfer thread.

* CPU: ``time.perf_counter`` at both hooks; the module's own forward, and
  nothing of layertap's other hooks: pre-hooks run in registration order, so
  the start pre-hook is re-registered last whenever layertap adds a pre-hook
  to the module (an input tap added after the latency tap), and the stop is
  the first forward hook. A pre-hook the model itself adds after the tap
  would still run inside the span.
* CUDA: two timing events recorded on the current stream. They are read on
  the host-transfer thread after the pass's own copy event, which the stream
  records after both, so reading them never waits on the model thread.
  Untested here (no GPU in CI): written to the CUDA event API's contract.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np
import torch

from layertap.server.reducers.base import Reducer
from layertap.server.reducers.workspace import F64, Workspace
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["Lap", "LatencyReducer", "LayerTimer", "fill_latency"]


class LatencyReducer(Reducer):
    """Seconds of the module's forward; the value comes from the tap's :class:`LayerTimer`."""

    kind = pb.REDUCER_KIND_LATENCY

    def width(self, shape: Sequence[int]) -> int:
        return 0

    def compute(self, ws: Workspace) -> torch.Tensor:
        return ws.x.new_zeros((0,), dtype=F64)

    def decode(self, values: np.ndarray, shape: Sequence[int]) -> pb.ReducerResult:
        # NaN until fill_latency sets the measured time (a plan swapped in
        # without a timer, e.g. by a baseline, reports NaN rather than 0).
        return pb.ReducerResult(latency=pb.Latency(seconds=math.nan))


class Lap:
    """One timed forward call: host seconds, or a pair of CUDA events read later."""

    __slots__ = ("_seconds", "_start", "_end")

    def __init__(self, seconds: float = math.nan, start: torch.cuda.Event | None = None,
                 end: torch.cuda.Event | None = None) -> None:
        self._seconds = seconds
        self._start = start
        self._end = end

    def seconds(self) -> float:
        """The elapsed seconds; for events, call it off the model thread, after the pass's copy."""
        if self._start is not None and self._end is not None:
            # Normally already done: the pass's copy event follows it.
            if not self._end.query():  # type: ignore[no-untyped-call]  # unannotated in torch
                self._end.synchronize()
            self._seconds = self._start.elapsed_time(self._end) / 1000.0
            self._start = self._end = None
        return self._seconds


class LayerTimer:
    """Times the forward of each layer of one tap; callbacks run on the model thread.

    Args:
        device: The model's device; CUDA devices are timed with events.
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._pass = -1
        #: Open calls per layer (a stack: a module may run inside itself).
        self._open: dict[str, list[float | torch.cuda.Event]] = {}
        #: The latest finished call of each layer, taken by the tap's own hook.
        self._done: dict[str, Lap] = {}

    def _mark(self) -> float | torch.cuda.Event:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # unannotated in torch
            event.record()
            return event
        return time.perf_counter()

    def start(self, layer: str, pass_index: int) -> None:
        """Forward pre-hook: a call of ``layer`` begins."""
        if pass_index != self._pass:  # a forward that raised leaves open calls behind
            self._pass = pass_index
            self._open.clear()
            self._done.clear()
        self._open.setdefault(layer, []).append(self._mark())

    def stop(self, layer: str) -> None:
        """Forward hook (first of the module's): the call of ``layer`` ends."""
        end = self._mark()
        stack = self._open.get(layer)
        if not stack:
            return
        begin = stack.pop()
        if isinstance(begin, float) and isinstance(end, float):
            self._done[layer] = Lap(end - begin)
        elif isinstance(begin, torch.cuda.Event) and isinstance(end, torch.cuda.Event):
            self._done[layer] = Lap(start=begin, end=end)

    def take(self, layer: str) -> Lap | None:
        """The lap of the call of ``layer`` that just ended, once."""
        return self._done.pop(layer, None)


def fill_latency(results: list[pb.ReducerResult], lap: Lap) -> None:
    """Writes ``lap``'s seconds into the latency results of one summary (host-transfer thread)."""
    for r in results:
        if r.WhichOneof("value") == "latency":
            r.latency.seconds = lap.seconds()
