"""Replay: rerun a recorded input with captures on a tap's layers, and check it.

An eval-mode forward pass is a pure function of its input, so the replay
reproduces the tensors the live pass summarised; one replay serves every tap
that fired on the pass. The check proves it: each tap's own reducer plan runs
again on the replayed tensors and its deterministic results must equal the
summary that fired. Sampled reducers
(histogram, quantiles) are left out of the comparison. A tap that left the
live pass's padding out (``host.padding``) is checked on the same valid
positions, from the recorded input's attention mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from layertap.server.host.inputs import ModelInputs
from layertap.server.host.model_host import ModelHost, flatten_tensors
from layertap.server.host.padding import PassPadding, host_mask
from layertap.server.record.retention import as_inputs
from layertap.server.record.triggers import ABS_MAX, MEAN_SIGMA, NONFINITE
from layertap.server.taps.tap import Tap
from layertap.v1 import telemetry_pb2 as pb

#: (layer, point, call index, output index) of a replayed tensor.
Key = tuple[str, int, int, int]
#: Result kinds whose values a replay reproduces exactly (up to summation order).
DETERMINISTIC = ("moments", "minmax", "abs_max", "zero_fraction", "nonfinite")
#: Relative tolerance of the moments: the compiled and eager kernels may sum
#: in different orders, which moves the last float32 bits of a mean.
MOMENTS_RTOL = 1e-5


class _Owner:
    """Marks the replay pass as active: taps and passive captures skip it."""


@dataclass
class Share:
    """One firing tap's part in a replay that serves every tap that fired on the pass.

    Each tensor the tap's layers produce is checked against the summaries that
    fired as it passes; it is kept (a host copy) only while the tap's incident
    has ``budget`` bytes left, so the per-incident cap bounds memory too.
    """

    tap: Tap
    summaries: Sequence[pb.Summary]
    budget: int
    #: Anomalous batch rows of a replayed tensor (the recorder's triggers and baselines).
    rows_of: Callable[[str, torch.Tensor], list[int]]
    kept: list[Key] = field(default_factory=list)
    dropped: int = 0
    problems: list[str] = field(default_factory=list)
    rows: dict[str, set[int]] = field(default_factory=dict)
    _used: int = 0
    _reached: set[tuple[str, int, int]] = field(default_factory=set)

    @property
    def point(self) -> int:
        return self.tap.spec.point or pb.POINT_OUTPUT

    def wants(self, layer: str, point: int) -> bool:
        return point == self.point and layer in self.tap.layers

    def see(self, key: Key, tensor: torch.Tensor, padding: PassPadding | None = None) -> bool:
        """Check and take the rows of one replayed tensor; True when the incident keeps it.

        Args:
            padding: The replayed input's padding, which the tap left out of the live pass unless it keeps it.
        """
        layer, _point, call, index = key
        for s in self.summaries:
            if (s.layer, s.call_index, s.output_index) == (layer, call, index):
                self._reached.add((layer, call, index))
                self.problems.extend(_check_one(self.tap, s, tensor, padding))
        if layer in self.rows:
            self.rows[layer].update(self.rows_of(layer, tensor))
        if self._used + tensor.nbytes > self.budget:
            self.dropped += 1
            return False
        self._used += tensor.nbytes
        self.kept.append(key)
        return True

    def finish(self) -> None:
        """Note the fired summaries the replay never reached."""
        self.problems.extend(
            f"{s.layer}: the replay did not reach it (call {s.call_index}, output {s.output_index})"
            for s in self.summaries if (s.layer, s.call_index, s.output_index) not in self._reached)


def replay(host: ModelHost, shares: Sequence[Share],
           inputs: ModelInputs | Sequence[torch.Tensor]) -> dict[Key, torch.Tensor]:
    """Run a copy of ``inputs`` through the model once, with hooks on every share's layers.

    The model gets a copy: it may write to its input in place, and the caller
    stores the input as it was sent. Returns the tensors some share kept, on the host.

    Raises:
        Exception: Whatever the forward raises (the caller records it).
    """
    recorded = as_inputs(inputs)
    mask = host_mask(recorded, host.inputs) if host.masked else None
    padding = PassPadding(mask) if mask is not None else None
    captured: dict[Key, torch.Tensor] = {}
    calls: dict[tuple[str, int], int] = {}
    owner = _Owner()

    def grab(layer: str, point: int, ctx: object, value: object) -> None:
        if getattr(ctx, "active_owner", None) is not owner:
            return  # a live pass between hook install and ours
        call = calls.get((layer, point), 0)
        calls[(layer, point)] = call + 1
        for i, (_key, t) in enumerate(flatten_tensors(value)):
            key = (layer, point, call, i)
            host_copy = t.detach().to("cpu", copy=True)  # one at a time: dropped ones are freed at once
            keep = [share.see(key, host_copy, padding) for share in shares if share.wants(layer, point)]
            if any(keep):
                captured[key] = host_copy

    sites = sorted({(layer, s.point) for s in shares for layer in s.tap.layers})

    def run() -> None:
        with host.pass_lock():  # hooks go in and out between passes
            handles = [host.hooks.add(layer, point, lambda ctx, v, _l=layer, _p=point: grab(_l, _p, ctx, v))
                       for layer, point in sites]
            try:
                with host.pass_context(active_owner=owner), torch.inference_mode():
                    host.forward(host.to_device(recorded, copy=True))
            finally:
                for h in handles:
                    h.remove()

    host.on_model_thread(run)
    for share in shares:
        share.finish()
    return captured


def _same(a: float, b: float, rtol: float = 0.0) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or abs(a - b) <= rtol * max(abs(a), abs(b))


def _differs(live: pb.ReducerResult, again: pb.ReducerResult) -> str | None:
    kind = live.WhichOneof("value")
    if kind == "moments":
        a, b = live.moments, again.moments
        ok = a.count == b.count and _same(a.mean, b.mean, MOMENTS_RTOL) and _same(a.std, b.std, MOMENTS_RTOL)
    elif kind == "minmax":
        ok = _same(live.minmax.min, again.minmax.min) and _same(live.minmax.max, again.minmax.max)
    elif kind == "abs_max":
        ok = _same(live.abs_max.value, again.abs_max.value)
    elif kind == "zero_fraction":
        ok = live.zero_fraction.count == again.zero_fraction.count
    elif kind == "nonfinite":
        ok = (live.nonfinite.nan_count, live.nonfinite.inf_count) == (again.nonfinite.nan_count, again.nonfinite.inf_count)
    else:
        return None
    return None if ok else f"{kind}: live {_short(live)} vs replay {_short(again)}"


def _short(r: pb.ReducerResult) -> str:
    return str(getattr(r, r.WhichOneof("value") or "")).replace("\n", " ").strip()


def _check_one(tap: Tap, summary: pb.Summary, tensor: torch.Tensor, padding: PassPadding | None = None) -> list[str]:
    """Differences between a fired summary and the same reducers on its replayed tensor (its valid positions,
    when the tap left ``padding`` out)."""
    plan = tap.always if summary.unsampled else tap.layer_plans.get(summary.layer, tap.plan)
    if plan is None:
        return []
    cut = padding.cut() if padding is not None and not tap.spec.keep_padding else None
    if cut is not None and cut.fits(tensor):
        tensor, plan = cut(tensor), plan.folded()
    values = plan.run(tensor).numpy()
    return [f"{summary.layer}: {why}" for live, again in zip(summary.results, plan.decode(values, tuple(tensor.shape)))
            if (why := _differs(live, again))]


def anomalous_rows(tensor: torch.Tensor, triggers: pb.Triggers, names: Sequence[str],
                   baseline: tuple[float, float] | None) -> list[int]:
    """Batch rows (dim 0) of ``tensor`` that set off any of ``names``."""
    if tensor.dim() == 0 or tensor.shape[0] == 0 or not tensor.is_floating_point():
        return []
    rows = tensor.reshape(tensor.shape[0], -1).double()
    bad = torch.zeros(rows.shape[0], dtype=torch.bool)
    if NONFINITE in names:
        bad |= (~torch.isfinite(rows)).any(dim=1)
    if ABS_MAX in names:
        bad |= (rows.abs() > triggers.abs_max_above).any(dim=1) | rows.isnan().any(dim=1)
    if MEAN_SIGMA in names and baseline is not None and rows.shape[1] > 0:
        mean, std = baseline
        bad |= ((rows.mean(dim=1) - mean).abs() > triggers.mean_sigma * std) | rows.mean(dim=1).isnan()
    return [int(i) for i in np.flatnonzero(bad.numpy())]
