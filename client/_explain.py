"""Grad-CAM explanations: the request, the call and the result of ``Client.explain``.

``Client.explain`` calls :func:`explain` with its transport; the call lives
here so that the client module keeps to its size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._codec import Array, decode_tensor
from ._errors import InvalidArgument
from ._io import encode_inputs, split_input
from ._transport import Transport, Unary
from .v1 import telemetry_pb2

__all__ = ["Explanation", "explain", "explain_request"]

EXPLAIN = Unary.of("TelemetryService", "Explain", telemetry_pb2.ExplainRequest, telemetry_pb2.ExplainResponse)


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


def explain_request(
    x: Any, layer: str, target: int | Sequence[int] | None = None, *, normalize: bool = False, upsample: bool = False,
    output_name: str = "",
) -> telemetry_pb2.ExplainRequest:
    """Builds an ExplainRequest; ``x`` is an array, a tuple or list of arrays for a multi-argument model,
    or a dict name -> array for named inputs. ``output_name`` picks the output to explain (default: the
    one tensor, else ``logits``, else the only tensor output)."""
    if not isinstance(layer, str) or not layer:
        raise InvalidArgument("layer: name the layer to explain (see Client.layers())")
    if target is None:
        targets: list[int] = []
    elif isinstance(target, (int, np.integer)):
        targets = [int(target)]
    else:
        targets = [int(t) for t in target]
    return telemetry_pb2.ExplainRequest(inputs=encode_inputs(*split_input(x), what="explain input"), layer=layer,
                                        targets=targets, normalize=normalize, upsample=upsample,
                                        output_name=output_name)


def explain(
    transport: Transport,
    x: Any,
    layer: str,
    target: int | Sequence[int] | None = None,
    *,
    normalize: bool = False,
    upsample: bool = False,
    output_name: str = "",
    timeout: float | None = None,
) -> Explanation:
    """Makes the Explain call of ``Client.explain`` (see there) on ``transport``."""
    req = explain_request(x, layer, target, normalize=normalize, upsample=upsample, output_name=output_name)
    resp = transport.unary(EXPLAIN, req, timeout=timeout, layer_hint=True)
    maps = np.asarray(decode_tensor(resp.maps), dtype=np.float32)
    return Explanation(layer, maps, list(resp.targets), list(resp.scores))
