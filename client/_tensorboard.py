"""The TensorBoard bridge: a tap's summaries, drift scores and feature maps as event files.

It writes with TensorBoard's own ``EventFileWriter`` and summary protos
(``layertap[tensorboard]``), which need neither torch nor TensorFlow, so the
thin client stays thin. What it writes, per layer (``L``; ``L[i]`` for a
module's i-th output tensor, first call of the pass only):

* scalars ``L/mean``, ``L/std``, ``L/min``, ``L/max``, ``L/zero_fraction``,
  ``L/nan_count``, ``L/inf_count`` (and ``L/latency_seconds`` if tapped);
* ``L/histogram``: the histogram reducer's bins as a raw histogram. Its open
  end bins become the first bucket (limit ``e_0``) and the last (limit
  ``DBL_MAX``); TensorBoard's buckets are ``(previous limit, limit]``;
* ``drift/L/{psi,js,wasserstein,mean_shift}`` for layers with a ready baseline;
* ``L/feature_maps``: an image grid of the first sample's channels, each
  scaled to its own range, from a capture of an ``--images`` layer. The
  capture waits for the next live pass, after the pass's summaries are
  written; it is labelled with the step of the pass it came from (the
  summary of that pass, once it arrives). No pass within ``image_timeout``
  (traffic paused) skips the image, counted in ``images_skipped``.

Steps: the training step when the summary has one, else the pass index. They
never go backwards within one logdir: when the server's count restarts (a
restart, or another server) the bridge continues after the last step written,
which it reads back from the logdir's existing event files when it starts.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import _capture
from ._client import Client
from ._errors import DeadlineExceeded
from ._png import encode_png
from ._types import LayerDrift, Summary

try:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("the TensorBoard bridge needs TensorBoard: pip install 'layertap[tensorboard]'") from exc

__all__ = ["BRIDGE_REDUCERS", "TensorBoardBridge", "follow", "last_step"]

log = logging.getLogger(__name__)

#: What the bridge taps: everything it writes per layer.
BRIDGE_REDUCERS: tuple[str, ...] = ("moments", "minmax", "zero_fraction", "nonfinite", "histogram")
#: The upper limit of TensorBoard's last (open) bucket, as its own writers use.
_DBL_MAX = sys.float_info.max
#: Channels shown in a feature-map grid.
MAX_GRID_CHANNELS = 64
_SCALARS: dict[str, tuple[tuple[str, str], ...]] = {
    "moments": (("mean", "mean"), ("std", "std")),
    "minmax": (("min", "min"), ("max", "max")),
    "zero_fraction": (("zero_fraction", "fraction"),),
    "nonfinite": (("nan_count", "nan_count"), ("inf_count", "inf_count")),
    "latency": (("latency_seconds", "seconds"),),
}
_DRIFT = ("psi", "js", "wasserstein", "mean_shift")


def last_step(logdir: Path) -> int | None:
    """The largest step of any summary event already in ``logdir``'s event files."""
    best: int | None = None
    for path in sorted(Path(logdir).glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            if event.HasField("summary"):
                best = event.step if best is None else max(best, event.step)
    return best


def _histogram(edges: Sequence[float], counts: Sequence[int], lo: float | None, hi: float | None) -> Any:
    limits = [*edges, _DBL_MAX]
    c = np.asarray(counts, dtype=np.float64)
    # Bin centres for sum and sum of squares (TensorBoard shows neither); the
    # open end bins count at their inner edge.
    centres = np.array([edges[0], *((a + b) / 2 for a, b in zip(edges, edges[1:])), edges[-1]])
    return summary_pb2.HistogramProto(
        min=edges[0] if lo is None or not math.isfinite(lo) else lo,
        max=edges[-1] if hi is None or not math.isfinite(hi) else hi,
        num=float(c.sum()), sum=float((c * centres).sum()), sum_squares=float((c * centres**2).sum()),
        bucket_limit=limits, bucket=c.tolist(),
    )


def feature_grid(maps: np.ndarray[Any, Any], max_channels: int = MAX_GRID_CHANNELS) -> np.ndarray[Any, Any]:
    """A ``(C, H, W)`` (or ``(H, W)``) feature map as one grey ``(H', W', 3)`` uint8 grid, 1-pixel gaps."""
    a = np.nan_to_num(np.asarray(maps, dtype=np.float64))
    a = a[None] if a.ndim == 2 else a.reshape(a.shape[0], *a.shape[-2:]) if a.ndim == 3 else a.reshape(-1, 1, a.shape[-1])
    a = a[:max_channels]
    lo = a.min(axis=(1, 2), keepdims=True)
    span = a.max(axis=(1, 2), keepdims=True) - lo
    a = np.where(span > 0, (a - lo) / np.where(span > 0, span, 1), 0.0)
    n, h, w = a.shape
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    grid = np.zeros((rows * (h + 1) - 1, cols * (w + 1) - 1))
    for i in range(n):
        r, c = divmod(i, cols)
        grid[r * (h + 1) : r * (h + 1) + h, c * (w + 1) : c * (w + 1) + w] = a[i]
    return np.repeat(np.round(grid * 255).astype(np.uint8)[..., None], 3, axis=-1)


class TensorBoardBridge:
    """Writes summaries to one logdir with monotonic steps (see the module docstring).

    Args:
        logdir: The run's directory; created if missing, continued if it has events.
    """

    def __init__(self, logdir: str | Path) -> None:
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._last = last_step(self.logdir)
        self._writer = EventFileWriter(str(self.logdir))
        self._offset = 0
        self._raw: int | None = None
        #: Feature-map captures that saw no pass in time (see FollowOptions.image_timeout).
        self.images_skipped = 0

    @property
    def step(self) -> int | None:
        """The last step written (in this logdir, by anyone)."""
        return self._last

    def step_of(self, summary: Summary) -> int:
        """The logdir step of a summary's pass; a server count that went back is moved past the last step."""
        raw = summary.step if summary.step is not None else summary.pass_index
        if raw != self._raw:
            self._raw = raw
            if self._last is not None and raw + self._offset <= self._last:
                self._offset = self._last + 1 - raw
        return raw + self._offset

    def step_of_pass(self, pass_index: int, near: Summary) -> int:
        """The step of a pass that has no summary here, counted from a summary ``near`` it.

        Exact for a served model (its step is the pass index); in a training
        run it assumes one pass per step between the two.
        """
        return self.step_of(near) + pass_index - near.pass_index

    def _emit(self, step: int, values: list[Any], wall_time: float | None = None, *, advance: bool = True) -> None:
        if values:
            event = event_pb2.Event(wall_time=wall_time or time.time(), step=step,
                                    summary=summary_pb2.Summary(value=values))
            self._writer.add_event(event)
            if advance:
                self._last = step if self._last is None else max(self._last, step)

    def write_summary(self, s: Summary) -> int | None:
        """Writes one summary's scalars and histogram; returns its step (None: skipped, a repeated call)."""
        if s.call_index:
            return None
        step = self.step_of(s)
        tag = s.layer if s.output_index == 0 else f"{s.layer}[{s.output_index}]"
        values = []
        for kind, result in s.results.items():
            for name, attr in _SCALARS.get(kind, ()):
                values.append(summary_pb2.Summary.Value(tag=f"{tag}/{name}", simple_value=float(getattr(result, attr))))
        hist = s.results.get("histogram")
        if hist is not None and getattr(hist, "edges"):
            minmax = s.results.get("minmax")
            histo = _histogram(getattr(hist, "edges"), getattr(hist, "counts"),
                               getattr(minmax, "min", None), getattr(minmax, "max", None))
            values.append(summary_pb2.Summary.Value(tag=f"{tag}/histogram", histo=histo))
        self._emit(step, values, s.wall_time)
        return step

    def write_drift(self, drift: Iterable[LayerDrift], step: int) -> None:
        """Writes the scores of every layer whose baseline is frozen (saved or not: both score)."""
        values = [summary_pb2.Summary.Value(tag=f"drift/{d.layer}/{m}", simple_value=float(getattr(d, m)))
                  for d in drift if d.state in ("ready", "unsaved") for m in _DRIFT]
        self._emit(step, values)

    def write_image(self, layer: str, maps: np.ndarray[Any, Any], step: int) -> None:
        """Writes a feature-map grid of ``maps`` (one sample: ``(C, H, W)``).

        An image does not move the restart check's last step: one labelled
        ahead of the summaries (its pass's summary never came) must not shift
        the summaries of that pass when they do.
        """
        rgb = feature_grid(maps)
        image = summary_pb2.Summary.Image(height=rgb.shape[0], width=rgb.shape[1], colorspace=3,
                                          encoded_image_string=encode_png(rgb))
        self._emit(step, [summary_pb2.Summary.Value(tag=f"{layer}/feature_maps", image=image)], advance=False)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


@dataclass(frozen=True)
class FollowOptions:
    """What ``layertap tensorboard`` asked for."""

    selector: str
    every: int | None = None
    images: tuple[str, ...] = ()
    #: Capture the ``images`` layers every this many written passes.
    image_every: int = 10
    duration: float | None = None
    #: Stop after this many passes (None: until ``duration`` or the stream ends).
    passes: int | None = None
    #: Poll drift scores at most this often, in seconds.
    drift_interval: float = 5.0
    #: Wait this long for a pass to capture images from; none skips the image, not the run.
    image_timeout: float = 2.0


@dataclass(frozen=True)
class _Pending:
    """A feature map captured from ``pass_index``, waiting for that pass's step."""

    pass_index: int
    layer: str
    maps: np.ndarray[Any, Any]


def _capture_first(client: Client, layer: str, timeout: float) -> _capture.CapturedTensor:
    """``client.capture(layer, max_batch=1)``, keeping the header's pass index that ``capture`` drops."""
    req = _capture.capture_request([layer], input=None, passes=1, point="output", max_batch=1, dtype=None)
    assembler = _capture.CaptureAssembler(as_torch=False)
    with client._translating(layer_hint=True):
        _capture.receive(client._capture_rpc(req, timeout=client._deadline(timeout)), assembler)
    return assembler.finish()[0]


def _capture_images(client: Client, bridge: TensorBoardBridge, options: FollowOptions) -> list[_Pending]:
    """One first-sample capture of every ``images`` layer, from the next pass; none if no pass comes in time."""
    found: list[_Pending] = []
    for layer in options.images:
        try:
            first = _capture_first(client, layer, options.image_timeout)
        except DeadlineExceeded:
            bridge.images_skipped += 1
            log.warning("tensorboard: no pass within %.1fs to capture %r from; image skipped",
                        options.image_timeout, layer)
            continue
        maps = np.asarray(first.value)
        found.append(_Pending(first.pass_index, layer, maps[0] if maps.ndim > 2 else maps))
    return found


def follow(client: Client, bridge: TensorBoardBridge, options: FollowOptions,
           on_summary: Callable[[Summary, int], None] | None = None,
           on_image: Callable[[str, int, int], None] | None = None) -> int:
    """Follows a stream tap into ``bridge`` until the budget is spent; returns the passes written.

    Args:
        on_summary: Called with each written summary and its step (tests, progress).
        on_image: Called with each written image's layer, pass index and step.
    """
    deadline = None if options.duration is None else time.monotonic() + options.duration
    passes = 0
    last: Summary | None = None
    next_drift = 0.0
    pending: list[_Pending] = []

    def write_images(upto: Summary, *, all_left: bool = False) -> None:
        # A map from the pass of ``upto`` takes that summary's step; one from a
        # pass the tap skipped (``every``), or, at the end, one never summarized,
        # is counted from it.
        for p in [p for p in pending if all_left or p.pass_index <= upto.pass_index]:
            pending.remove(p)
            step = bridge.step_of(upto) if p.pass_index == upto.pass_index else bridge.step_of_pass(p.pass_index, upto)
            bridge.write_image(p.layer, p.maps, step)
            if on_image is not None:
                on_image(p.layer, p.pass_index, step)

    try:
        with client.watch(options.selector, reducers=list(BRIDGE_REDUCERS), every=options.every,
                          timeout=options.duration) as stream:
            for batch in stream.batches():
                capture_due = False
                for s in batch:
                    if last is None or s.pass_index != last.pass_index:
                        if options.passes is not None and passes == options.passes:
                            return passes
                        passes += 1
                        capture_due |= bool(options.images) and passes % options.image_every == 1 % options.image_every
                    last = s
                    step = bridge.write_summary(s)
                    write_images(s)
                    if step is not None and on_summary is not None:
                        on_summary(s, step)
                if batch and time.monotonic() >= next_drift:
                    next_drift = time.monotonic() + options.drift_interval
                    bridge.write_drift(client.drift(options.selector), bridge.step_of(batch[-1]))
                bridge.flush()  # the summaries are on disk before a capture waits for traffic
                if capture_due:
                    pending.extend(_capture_images(client, bridge, options))
                if deadline is not None and time.monotonic() >= deadline:
                    break
    finally:
        if last is not None:
            write_images(last, all_left=True)
            bridge.flush()
    return passes
