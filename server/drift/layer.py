"""One layer of a baseline tap: its entry (collecting, frozen, saved or not) and the reducers its tap runs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from layertap.server.drift.baseline import Baseline
from layertap.server.drift.builder import BaselineBuilder
from layertap.server.drift.scores import DriftScore
from layertap.server.drift.thresholds import DriftThresholds
from layertap.server.drift.window import SlidingWindow
from layertap.server.taps.tap import Tap
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["COLLECT_PROBABILITIES", "SAVE_RETRY_FIRST_SECONDS", "SAVE_RETRY_MAX_SECONDS", "LayerEntry",
           "layer_reducers"]

#: Percentiles reported per pass while a baseline collects.
COLLECT_PROBABILITIES = tuple(round(i / 100, 2) for i in range(1, 100))
#: Backoff of the retries of a baseline file that could not be written: the
#: first retry after the first delay, doubling up to the cap (a full disk is
#: usually freed in minutes, and each try costs a write of the whole document).
SAVE_RETRY_FIRST_SECONDS = 1.0
SAVE_RETRY_MAX_SECONDS = 60.0


def layer_reducers(*, per_channel: bool, edges: np.ndarray | None) -> list[pb.ReducerSpec]:
    specs = [pb.ReducerSpec(kind=pb.REDUCER_KIND_MOMENTS), pb.ReducerSpec(kind=pb.REDUCER_KIND_MINMAX),
             pb.ReducerSpec(kind=pb.REDUCER_KIND_NONFINITE)]
    if edges is None:
        specs.append(pb.ReducerSpec(kind=pb.REDUCER_KIND_QUANTILES,
                                    quantiles=pb.QuantileParams(probabilities=COLLECT_PROBABILITIES)))
    else:
        specs.append(pb.ReducerSpec(kind=pb.REDUCER_KIND_HISTOGRAM,
                                    histogram=pb.HistogramParams(edges=[float(e) for e in edges])))
    if per_channel:
        # No dim: the model's feature axis (hidden units of a token model, channels of a map).
        specs.append(pb.ReducerSpec(kind=pb.REDUCER_KIND_PER_CHANNEL, per_channel=pb.PerChannelParams()))
    return specs


@dataclass
class LayerEntry:
    """One layer of a baseline tap: collecting, then frozen and scored; its file saved or not."""

    tap: str
    layer: str
    point: str
    passes: int
    window_len: int
    thresholds: DriftThresholds
    builder: BaselineBuilder | None = None
    baseline: Baseline | None = None
    window: SlidingWindow | None = None
    score: DriftScore | None = None
    #: The tap this entry was made for: a replacement under the same id is another tap.
    handle: Tap | None = None
    #: Collect ``passes`` and wait for :meth:`DriftMonitor.install` instead of freezing.
    hold: bool = False
    #: Why the frozen baseline's file could not be written ("" when saved, or
    #: when there is no ``--baseline-dir``): the layer is UNSAVED until a retry works.
    save_error: str = ""
    #: Monotonic time of the next save retry, and the delay after that one.
    retry_at: float = 0.0
    retry_delay: float = SAVE_RETRY_FIRST_SECONDS

    @property
    def state(self) -> pb.BaselineState.ValueType:
        if self.baseline is None:
            return pb.BASELINE_STATE_COLLECTING
        return pb.BASELINE_STATE_UNSAVED if self.save_error else pb.BASELINE_STATE_READY
