"""Explanations: the request, the call and the result of ``Client.explain``.

``Client.explain`` calls :func:`explain` with its transport; the call lives
here so that the client module keeps to its size. The server computes every
method with Captum (Grad-CAM, integrated gradients, layer integrated
gradients, saliency); method names are ``ExplainMethod``'s without their
prefix, lower-case, with the short forms ``ig`` and ``lig``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._codec import Array, decode_tensor, encode_tensor
from ._errors import InvalidArgument
from ._io import encode_inputs, split_input
from ._transport import Transport, Unary
from .v1 import telemetry_pb2

__all__ = ["EXPLAIN_METHODS", "LAYER_METHODS", "Explanation", "explain", "explain_request", "method_name"]

EXPLAIN = Unary.of("TelemetryService", "Explain", telemetry_pb2.ExplainRequest, telemetry_pb2.ExplainResponse)

#: Method names, in proto order (UNSPECIFIED, which is Grad-CAM, left out).
_METHODS = {name.removeprefix("EXPLAIN_METHOD_").lower(): code
            for name, code in telemetry_pb2.ExplainMethod.items() if code}
_METHOD_NAMES = {code: name for name, code in _METHODS.items()}
EXPLAIN_METHODS: tuple[str, ...] = tuple(_METHODS)
#: Short forms the CLI and ``Client.explain`` accept.
_ALIASES = {"ig": "integrated_gradients", "lig": "layer_integrated_gradients", "gradcam": "grad_cam"}
#: Methods that attribute to a layer (``layer=``); the others attribute to the main input.
LAYER_METHODS: tuple[str, ...] = ("grad_cam", "layer_integrated_gradients")
_BASELINES = {"zeros": telemetry_pb2.BASELINE_KIND_ZEROS, "noise": telemetry_pb2.BASELINE_KIND_NOISE}


def method_name(method: str) -> str:
    """The full method name of ``method`` (a name or a short form).

    Raises:
        InvalidArgument: An unknown method (field ``method``).
    """
    full = _ALIASES.get(method, method)
    if full not in _METHODS:
        raise InvalidArgument(f"method: unknown method {method!r}; one of {', '.join(EXPLAIN_METHODS)} "
                              f"(or {', '.join(_ALIASES)})", field="method")
    return full


@dataclass(frozen=True)
class Explanation:
    """What a layer or the input contributed to the chosen outputs, one entry per sample.

    Attributes:
        layer: The layer explained; for layer integrated gradients without
            ``layer=``, the input embedding's name. "" for the input methods.
        attributions: float32. Grad-CAM: ``(N, *spatial)`` maps, at the
            layer's resolution or the input's with ``upsample``, in ``[0, 1]``
            with ``normalize``, otherwise ReLU of the gradient-weighted
            channel sum. Integrated gradients and saliency: shaped like the
            main input. Layer integrated gradients: shaped like the layer's
            output, or ``(N, tokens)`` for token ids, padding 0.
        classes: The explained output index per sample: the top class unless
            a target was given.
        scores: The model's output (pre-softmax) at that index, per sample.
        method: The method that ran (full name).
        delta: Integrated gradients: Captum's convergence delta per sample,
            ``sum(attributions) - (F(input) - F(baseline))``; None otherwise.
        n_steps: Integrated gradients: the steps taken; 0 otherwise.
        internal_batches: Passes the server ran, each under its model lock.
        tokens: Per sample, the main input's tokens as the model's tokenizer
            spells them (layer integrated gradients on token ids, when the
            server has the tokenizer); None otherwise.
    """

    layer: str
    attributions: Array
    classes: list[int]
    scores: list[float]
    method: str = "grad_cam"
    delta: Array | None = None
    n_steps: int = 0
    internal_batches: int = 0
    tokens: list[list[str]] | None = None

    @property
    def maps(self) -> Array:
        """Grad-CAM's name for :attr:`attributions`."""
        return self.attributions


def _baseline(request: telemetry_pb2.ExplainRequest, baseline: Any, noise_std: float | None,
              seed: int | None) -> None:
    if isinstance(baseline, str):
        if baseline not in _BASELINES:
            raise InvalidArgument(f"baseline: {baseline!r} is not a baseline; give 'zeros', 'noise' or an array",
                                  field="baseline")
        request.baseline_kind = _BASELINES[baseline]
    elif baseline is not None:
        request.baseline_kind = telemetry_pb2.BASELINE_KIND_GIVEN
        request.baseline.CopyFrom(encode_tensor(baseline))
    if noise_std is not None:
        request.noise_std = float(noise_std)
    if seed is not None:
        request.seed = int(seed)


def explain_request(
    x: Any, layer: str | None = None, target: int | Sequence[int] | None = None, *, method: str = "grad_cam",
    normalize: bool = False, upsample: bool = False, output_name: str = "", n_steps: int | None = None,
    baseline: Any = None, noise_std: float | None = None, seed: int | None = None,
    internal_batch_size: int | None = None,
) -> telemetry_pb2.ExplainRequest:
    """Builds an ExplainRequest; ``x`` is an array, a tuple or list of arrays for a multi-argument model,
    or a dict name -> array for named inputs. See ``Client.explain`` for the rest."""
    full = method_name(method)
    if full == "grad_cam" and not (isinstance(layer, str) and layer):
        raise InvalidArgument("layer: name the layer to explain (see Client.layers())", field="layer")
    if layer is not None and not isinstance(layer, str):
        raise InvalidArgument(f"layer: a module name, got {type(layer).__name__}", field="layer")
    if target is None:
        targets: list[int] = []
    elif isinstance(target, (int, np.integer)):
        targets = [int(target)]
    else:
        targets = [int(t) for t in target]
    for name, value in (("n_steps", n_steps), ("internal_batch_size", internal_batch_size)):
        if value is not None and not 0 < value < 1 << 32:
            raise InvalidArgument(f"{name}: a positive count, got {value}", field=name)
    request = telemetry_pb2.ExplainRequest(
        inputs=encode_inputs(*split_input(x), what="explain input"), layer=layer or "", targets=targets,
        normalize=normalize, upsample=upsample, output_name=output_name, method=_METHODS[full],
        n_steps=n_steps or 0, internal_batch_size=internal_batch_size or 0)
    _baseline(request, baseline, noise_std, seed)
    return request


def explain(transport: Transport, x: Any, layer: str | None = None, target: int | Sequence[int] | None = None, *,
            timeout: float | None = None, **options: Any) -> Explanation:
    """Makes the Explain call of ``Client.explain`` (see there) on ``transport``."""
    req = explain_request(x, layer, target, **options)
    resp = transport.unary(EXPLAIN, req, timeout=timeout, layer_hint=True)
    method = _METHOD_NAMES.get(resp.method, "grad_cam")  # a server from before methods sends none
    result = resp.attributions if resp.HasField("attributions") else resp.maps
    attributions = np.asarray(decode_tensor(result), dtype=np.float32)
    n = len(resp.targets)
    tokens = None
    if resp.tokens and n and len(resp.tokens) % n == 0:
        per = len(resp.tokens) // n
        tokens = [list(resp.tokens[i * per:(i + 1) * per]) for i in range(n)]
    return Explanation(resp.layer or req.layer, attributions, list(resp.targets), list(resp.scores), method,
                       np.asarray(resp.deltas, dtype=np.float64) if resp.deltas else None, resp.n_steps,
                       resp.internal_batches, tokens)
