"""Replay: rerun a recorded input with captures on a tap's layers, and check it.

An eval-mode forward pass is a pure function of its input, so the replay
reproduces the tensors the live pass summarised. The check proves it: the
tap's own reducer plan runs again on the replayed tensors and its
deterministic results must equal the summary that fired. Sampled reducers
(histogram, quantiles) are left out of the comparison.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from layertap.server.host.model_host import ModelHost, flatten_tensors
from layertap.server.record.triggers import ABS_MAX, MEAN_SIGMA, NONFINITE
from layertap.server.taps.tap import Tap
from layertap.v1 import telemetry_pb2 as pb

#: (layer, call index, output index) -> the replayed tensor, on the host.
Captured = dict[tuple[str, int, int], torch.Tensor]
#: Result kinds whose values a replay reproduces exactly (up to summation order).
DETERMINISTIC = ("moments", "minmax", "abs_max", "zero_fraction", "nonfinite")
#: Relative tolerance of the moments: the compiled and eager kernels may sum
#: in different orders, which moves the last float32 bits of a mean.
MOMENTS_RTOL = 1e-5


class _Owner:
    """Marks the replay pass as active: taps and passive captures skip it."""


@dataclass
class Replay:
    captured: Captured
    #: The replayed model inputs, on the host.
    inputs: list[torch.Tensor]


def replay(host: ModelHost, tap: Tap, inputs: Sequence[torch.Tensor]) -> Replay:
    """Run ``inputs`` through the model once, cloning the tap's layers to the host.

    Raises:
        Exception: Whatever the forward raises (the caller records it).
    """
    captured: Captured = {}
    calls: dict[str, int] = {}
    owner = _Owner()

    def grab(layer: str, ctx: object, value: object) -> None:
        if getattr(ctx, "active_owner", None) is not owner:
            return  # a live pass between hook install and ours
        call = calls.get(layer, 0)
        calls[layer] = call + 1
        for i, (_key, t) in enumerate(flatten_tensors(value)):
            captured[(layer, call, i)] = t.detach().to("cpu", copy=True)

    point = tap.spec.point or pb.POINT_OUTPUT
    with host.pass_lock():  # hooks go in and out between passes
        handles = [host.hooks.add(layer, point, lambda ctx, v, _l=layer: grab(_l, ctx, v)) for layer in tap.layers]
        try:
            with host.pass_context(active_owner=owner), torch.inference_mode():
                host.module(*[t.to(host.device) for t in inputs])
        finally:
            for h in handles:
                h.remove()
    return Replay(captured, [t.detach().to("cpu") for t in inputs])


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


def check(tap: Tap, summaries: Sequence[pb.Summary], captured: Captured) -> list[str]:
    """Differences between each fired summary and the same reducers on the replay; [] when equal."""
    problems = []
    for s in summaries:
        tensor = captured.get((s.layer, s.call_index, s.output_index))
        if tensor is None:
            problems.append(f"{s.layer}: the replay did not reach it (call {s.call_index}, output {s.output_index})")
            continue
        plan = tap.always if s.unsampled else tap.layer_plans.get(s.layer, tap.plan)
        if plan is None:
            continue
        values = plan.run(tensor).numpy()
        for live, again in zip(s.results, plan.decode(values, tuple(tensor.shape))):
            why = _differs(live, again)
            if why:
                problems.append(f"{s.layer}: {why}")
    return problems


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
