"""What a Capture request asks for: its layers (names and selectors), point, passes and downcast.

:func:`parse_options` checks a ``CaptureRequest`` against the model and the
server limits before anything is hooked. ``layers`` holds exact names,
``selectors`` the tap grammar (exact name, glob, ``re:``); each entry is kept
as a :class:`Selection`, so an error can name the request field it came from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from layertap.server.codec import TORCH_BY_WIRE, dtype_name
from layertap.server.errors import InvalidField, LimitExceeded, Unsupported, unknown_layer
from layertap.server.host.model_host import ModelHost
from layertap.server.taps.capture_limits import CaptureLimits
from layertap.server.taps.selectors import GLOB_CHARS, select_layers
from layertap.v1 import telemetry_pb2 as pb
from layertap.v1 import tensor_pb2

__all__ = ["GRAD_POINTS", "CaptureOptions", "Selection", "describe", "parse_options"]

DOWNCASTS = {tensor_pb2.DATA_TYPE_FLOAT16, tensor_pb2.DATA_TYPE_BFLOAT16}
#: Points read in the backward or at the optimizer's pre-step: only a training agent has them.
GRAD_POINTS = frozenset({pb.POINT_GRAD_OUTPUT, pb.POINT_GRAD_INPUT, pb.POINT_PARAM_GRAD})


#: Layers come from the model, so requests only need their length capped
#: before the lookup (and the "did you mean" search behind a miss).
MAX_LAYER_NAME = 1024
#: Names and selectors one request may list, together.
MAX_CAPTURE_LAYERS = 4096
#: Selectors one request may list: each is compiled and matched against every
#: layer name, so thousands of them on a large model would cost seconds.
MAX_CAPTURE_SELECTORS = 64


@dataclass(frozen=True)
class Selection:
    """One entry of a request (``layers[i]`` or ``selectors[i]``) and the layers it named."""

    field: str
    text: str
    layers: tuple[str, ...]
    #: A glob or ``re:`` selector: it needs only one of its layers to run, not each.
    pattern: bool = False


@dataclass(frozen=True)
class CaptureOptions:
    layers: tuple[str, ...]
    point: pb.Point.ValueType
    passes: int
    max_batch: int
    dtype: torch.dtype | None
    #: Where ``layers`` came from; empty means each layer was named exactly.
    selections: tuple[Selection, ...] = ()


def _select(req: pb.CaptureRequest, host: ModelHost) -> list[Selection]:
    """Resolve ``layers`` (exact names) and ``selectors`` (the tap grammar) against the model."""
    count = len(req.layers) + len(req.selectors)
    if not count:
        raise InvalidField("layers", "name at least one layer, or give a selector such as 'layer*' (see ListLayers)")
    if len(req.selectors) > MAX_CAPTURE_SELECTORS:
        raise InvalidField("selectors", f"at most {MAX_CAPTURE_SELECTORS} selectors per capture, got "
                                       f"{len(req.selectors)}; one glob or regex can match many layers")
    if count > MAX_CAPTURE_LAYERS:
        raise InvalidField("layers", f"at most {MAX_CAPTURE_LAYERS} layers and selectors per capture, got {count}")
    known = host.modules
    out = []
    for i, name in enumerate(req.layers):
        if len(name) > MAX_LAYER_NAME:
            raise InvalidField(f"layers[{i}]", f"a layer name is at most {MAX_LAYER_NAME} characters, got {len(name)}")
        if name not in known or not name:
            raise unknown_layer(name, host.layer_names, field=f"layers[{i}]")
        out.append(Selection(f"layers[{i}]", name, (name,)))
    names = host.layer_names
    for i, text in enumerate(req.selectors):
        where = f"selectors[{i}]"
        # select_layers caps the size, refuses bad patterns (INVALID_ARGUMENT)
        # and a selector that matches nothing (NOT_FOUND), naming ``where``.
        out.append(Selection(where, text, tuple(select_layers(text, names, where)),
                             pattern=text.startswith("re:") or bool(GLOB_CHARS & set(text))))
    return out


def parse_options(req: pb.CaptureRequest, host: ModelHost, limits: CaptureLimits) -> CaptureOptions:
    """Validate a CaptureRequest against the model and the server limits."""
    if not host.loaded.hooks_supported:
        raise Unsupported(
            f"model source {host.loaded.source!r} does not support module hooks "
            "(TorchScript refuses Python hooks); Capture needs an eager, export or factory model"
        )
    selections = _select(req, host)
    point = req.point or pb.POINT_OUTPUT
    if point not in GRAD_POINTS and point not in (pb.POINT_OUTPUT, pb.POINT_INPUT):
        raise InvalidField("point", f"unknown point {point}; Capture takes POINT_OUTPUT, POINT_INPUT or, on a "
                                   "training agent, a gradient point")
    if point in GRAD_POINTS and not host.training:
        # A serving host runs no backward, so such a capture would only wait out its deadline.
        raise Unsupported("point: gradient points need a training agent (layertap.attach), where a backward "
                          "runs; on a serving host use POINT_OUTPUT or POINT_INPUT", field="point")
    passes = req.passes or 1
    if req.inputs and req.passes > 1:
        raise InvalidField("passes", "an active capture (with inputs) runs exactly one pass")
    if passes > limits.max_passes:
        raise LimitExceeded(f"passes={passes} exceeds the server limit of {limits.max_passes}")
    dtype = None
    if req.dtype:
        if req.dtype not in DOWNCASTS:
            raise InvalidField("dtype", "downcast must be DATA_TYPE_FLOAT16 or DATA_TYPE_BFLOAT16")
        dtype = TORCH_BY_WIRE[req.dtype]
    layers = tuple(dict.fromkeys(name for s in selections for name in s.layers))
    return CaptureOptions(layers, point, passes, req.max_batch, dtype, tuple(selections))


def describe(opts: CaptureOptions) -> str:
    """Log-safe description (never tensor data)."""
    dt = dtype_name(opts.dtype) if opts.dtype else "native"
    # A selector such as '**' can match every module: log the first few.
    shown = ",".join(opts.layers[:16]) + (",..." if len(opts.layers) > 16 else "")
    return (f"layers={len(opts.layers)}[{shown}] point={opts.point} passes={opts.passes} "
            f"max_batch={opts.max_batch} dtype={dt}")
