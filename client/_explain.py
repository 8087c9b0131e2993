"""Grad-CAM explanations: the request and result of ``Client.explain``.

:func:`explain` is bound as the method ``Client.explain``; it lives here so
that the client module keeps to its size, and it reaches the client through
:class:`_ExplainCalls`, the three members it uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ._codec import Array, decode_tensor, encode_tensor
from ._errors import InvalidArgument
from .v1 import telemetry_pb2, telemetry_pb2_grpc

__all__ = ["Explanation", "explain", "explain_request"]


@dataclass(frozen=True)
class Explanation:
    """Grad-CAM maps of one layer, one per sample.

    Attributes:
        maps: float32 ``(N, *spatial)``: at the layer's resolution, or the
            input's with ``upsample``; in ``[0, 1]`` with ``normalize``,
            otherwise not scaled (ReLU of the gradient-weighted channel sum).
        classes: The explained output index per sample: the top class unless
            a target was given.
        scores: The model's output (pre-softmax) at that index, per sample.
    """

    layer: str
    maps: Array
    classes: list[int]
    scores: list[float]


class _ExplainCalls(Protocol):
    """What :func:`explain` needs of ``Client``."""

    _telemetry: telemetry_pb2_grpc.TelemetryServiceStub

    def _translating(self, *, layer_hint: bool = ...) -> AbstractContextManager[None]: ...

    def _deadline(self, timeout: float | None) -> float | None: ...


def explain_request(
    x: Any, layer: str, target: int | Sequence[int] | None = None, *, normalize: bool = False, upsample: bool = False
) -> telemetry_pb2.ExplainRequest:
    """Builds an ExplainRequest; ``x`` is an array, or a tuple or list of arrays for a multi-argument model."""
    if not isinstance(layer, str) or not layer:
        raise InvalidArgument("layer: name the layer to explain (see Client.layers())")
    if target is None:
        targets: list[int] = []
    elif isinstance(target, (int, np.integer)):
        targets = [int(target)]
    else:
        targets = [int(t) for t in target]
    inputs = x if isinstance(x, (tuple, list)) else [x]
    return telemetry_pb2.ExplainRequest(inputs=[encode_tensor(t) for t in inputs], layer=layer, targets=targets,
                                        normalize=normalize, upsample=upsample)


def explain(
    self: _ExplainCalls,
    x: Any,
    layer: str,
    target: int | Sequence[int] | None = None,
    *,
    normalize: bool = False,
    upsample: bool = False,
    timeout: float | None = None,
) -> Explanation:
    """Grad-CAM: which parts of ``x`` the layer's features for a class come from.

    The server runs ``x`` once with gradients (an active pass: taps skip it)
    in eval mode and leaves the model as it was.

    Args:
        x: Model input: an array, or a tuple or list of arrays for a
            multi-argument model.
        layer: Exact module name whose output, ``(N, channels, *spatial)``,
            is explained; usually the last convolutional block.
        target: Output index to explain: None for each sample's top class,
            an int for every sample, or one per sample. A model whose output
            is not ``(N, classes)`` needs it: an index into each sample's
            flattened output.
        normalize: Min-max each map to ``[0, 1]``.
        upsample: Resize the maps bilinearly to the input's spatial size.
        timeout: Deadline override in seconds.

    Returns:
        An :class:`Explanation`.

    Raises:
        LayerNotFound: No module has this name; the error suggests close names.
        FailedPrecondition: TorchScript, a training agent, a layer that does
            not run once or has no channel dimension, or an output that is not
            ``(N, classes)`` without ``target``.
        InvalidArgument: Bad input or target, or ``upsample`` for a layer
            whose map has no spatial dims to resize (e.g. a Linear head).
    """
    req = explain_request(x, layer, target, normalize=normalize, upsample=upsample)
    with self._translating(layer_hint=True):
        resp = self._telemetry.Explain(req, timeout=self._deadline(timeout))
    maps = np.asarray(decode_tensor(resp.maps), dtype=np.float32)
    return Explanation(layer, maps, list(resp.targets), list(resp.scores))
