"""One Explain request: its checks against the inputs, its first pass, its method, its result.

The methods are Captum's (:mod:`.gradcam`, :mod:`.integrated`,
:mod:`.saliency`); this module checks what only the decoded inputs can tell
(the main input's dtype against the method, the baseline's shape and dtype),
runs the first pass (:mod:`.prepared`), then the method's internal batches
(:mod:`.passes`), and gathers the groups' results.

Limitation: warm-up and Infer run under ``torch.inference_mode()`` (faster,
and the compiled reducer kernels are keyed on it). A model that builds a
cache lazily on its first forward (rotary tables, positional caches) builds
it there as an inference tensor, which autograd cannot save for backward; it
cannot be explained, and Explain answers FAILED_PRECONDITION saying so
rather than blaming the caller's input. Building the cache in ``__init__``
(or cloning it when used) avoids it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from layertap.server.errors import InvalidField, Unsupported
from layertap.server.explain.forward import check_targets, main_input_key
from layertap.server.explain.gradcam import grad_cam
from layertap.server.explain.integrated import integrated_gradients, layer_integrated_gradients
from layertap.server.explain.library import captum
from layertap.server.explain.options import (
    GRAD_CAM,
    INTEGRATED_GRADIENTS,
    LAYER_INTEGRATED_GRADIENTS,
    SALIENCY,
    ExplainOptions,
    Explanation,
)
from layertap.server.explain.passes import ExplainPasses
from layertap.server.explain.prepared import prepare
from layertap.server.explain.saliency import saliency
from layertap.server.host.inputs import ModelInputs
from layertap.server.host.model_host import ModelHost

log = logging.getLogger(__name__)

__all__ = ["default_layer", "explain", "require_hooks"]

#: Methods whose result has no deltas: name -> function giving the groups' attributions.
_PLAIN: dict[str, Callable[..., list[torch.Tensor]]] = {GRAD_CAM: grad_cam, SALIENCY: saliency}
#: Methods with deltas: name -> function giving the groups' attributions and deltas.
_PATHS: dict[str, Callable[..., tuple[list[torch.Tensor], list[torch.Tensor]]]] = {
    INTEGRATED_GRADIENTS: integrated_gradients, LAYER_INTEGRATED_GRADIENTS: layer_integrated_gradients}


def require_hooks(host: ModelHost) -> None:
    """Refuse a model that takes no module hooks (TorchScript), with FAILED_PRECONDITION."""
    if not host.loaded.hooks_supported:
        raise Unsupported(f"model source {host.loaded.source!r} does not support module hooks (TorchScript "
                          "refuses Python hooks); Explain needs an eager, export or factory model")


def default_layer(host: ModelHost) -> str:
    """The module ``get_input_embeddings()`` returns (Hugging Face models), by name.

    Raises:
        InvalidField: The model has no such method, or it names no module of the model (field ``layer``).
    """
    get = getattr(host.module, "get_input_embeddings", None)
    found = get() if callable(get) else None
    for name, module in host.modules.items():
        if module is found and name:
            return name
    raise InvalidField("layer", "layer_integrated_gradients needs a layer: the model has no get_input_embeddings() "
                                "module (see ListLayers)")


def _main(host: ModelHost, inputs: ModelInputs) -> tuple[str, torch.Tensor]:
    key = main_input_key(host, inputs)
    return (key or (host.inputs[0].name if host.inputs else "input")), (inputs.kwargs[key] if key else inputs.args[0])


def _check_baseline(host: ModelHost, opts: ExplainOptions, name: str, main: torch.Tensor) -> None:
    if opts.baseline == "noise" and not main.is_floating_point():
        raise InvalidField("baseline_kind", f"a noise baseline needs a floating main input; {name!r} holds "
                                            f"{main.dtype} (token ids): use zeros or a given baseline of token ids")
    base = opts.baseline_tensor
    if base is None:
        return
    want = list(main.shape)
    if list(base.shape) not in (want, [1, *want[1:]]):
        raise InvalidField("baseline.shape", f"expected the main input's shape {want} (or a batch of 1: "
                                             f"{[1, *want[1:]]}), got {list(base.shape)}")
    if base.is_floating_point() != main.is_floating_point() or (not main.is_floating_point() and base.dtype != main.dtype):
        raise InvalidField("baseline.dtype", f"expected {'a floating dtype' if main.is_floating_point() else main.dtype} "
                                             f"like the main input {name!r}, got {base.dtype}")
    vocab = host.inputs[0].vocab if host.inputs else None
    if vocab is not None and base.numel():
        lo, hi = int(base.min()), int(base.max())  # the request's own CPU copy, before any pass
        if lo < 0 or hi >= vocab:
            raise InvalidField("baseline", f"token id {lo if lo < 0 else hi} is outside the model's vocabulary "
                                           f"[0, {vocab})")


def check_inputs(host: ModelHost, inputs: ModelInputs, opts: ExplainOptions) -> int:
    """What the decoded inputs tell about the request; returns the batch size.

    Raises:
        InvalidField: An empty batch, bad targets, a method that needs a
            floating main input given token ids, a baseline that does not fit.
    """
    name, main = _main(host, inputs)
    n = int(main.shape[0]) if main.dim() else 0
    if n < 1:
        raise InvalidField("inputs[0].shape", "Explain needs a batch of at least one sample")
    check_targets(opts.targets, n)
    if opts.method in (INTEGRATED_GRADIENTS, SALIENCY) and not main.is_floating_point():
        raise InvalidField("method", f"{opts.method} differentiates the main input {name!r}, which holds "
                                     f"{main.dtype} (token ids?); use layer_integrated_gradients, at the input "
                                     "embedding by default")
    if opts.method in _PATHS:
        _check_baseline(host, opts, name, main)
    return n


def _tokens(host: ModelHost, main: torch.Tensor, attributions: torch.Tensor) -> tuple[str, ...]:
    tokenizer: Any = host.loaded.tokenizer
    if tokenizer is None or main.is_floating_point() or main.dim() != 2 or attributions.shape != main.shape:
        return ()
    return tuple(str(t) for row in main.tolist() for t in tokenizer.convert_ids_to_tokens(row))


def explain(host: ModelHost, inputs: ModelInputs, opts: ExplainOptions, passes: ExplainPasses) -> Explanation:
    """Explain validated CPU ``inputs`` (see ``decode_inputs``) with ``opts.method``, one pass per internal batch.

    Raises:
        Unsupported: TorchScript; a layer that does not run exactly once or
            does not output a floating tensor with the batch first (``(N, C,
            ...)`` for Grad-CAM); an output that is not ``(N, classes)``
            without targets; a model that cached an inference tensor while
            serving (see the module docstring).
        InvalidField: See :func:`check_inputs`; ``upsample`` on a map without
            1 to 3 spatial dims (or not as many as the input's); the model raised on the input.
        LimitExceeded: The device ran out of memory.
        DeadlineExceeded: The call's deadline passed, or it was cancelled, before its last batch.
    """
    require_hooks(host)
    n = check_inputs(host, inputs, opts)
    try:
        lib = captum()  # here, on the RPC thread (if preloading has not yet): not in a pass under the model lock
    except ImportError as exc:
        raise Unsupported(f"Explain needs captum, which does not import here ({exc}): "
                          "pip install 'layertap[server]'") from None
    passes.planned += 1
    prep = passes.run(prepare, host, inputs, opts)
    deltas: torch.Tensor | None = None
    if opts.method in _PATHS:
        parts, delta_parts = _PATHS[opts.method](lib, passes, prep, opts)
        deltas = torch.cat(delta_parts)  # (N,) float64 on the CPU: no parallel region
    else:
        parts = _PLAIN[opts.method](lib, passes, prep, opts)
    # One tensor from the groups, on the model thread: a large concatenation runs OpenMP.
    attributions = parts[0] if len(parts) == 1 else host.on_model_thread(torch.cat, parts)
    tokens = _tokens(host, _main(host, inputs)[1], attributions) if opts.method == LAYER_INTEGRATED_GRADIENTS else ()
    log.info("explain: method=%s layer=%s n=%d steps=%d batches=%d result=%s", opts.method, opts.layer or "-", n,
             opts.n_steps if deltas is not None else 0, passes.batches, list(attributions.shape))
    return Explanation(opts.method, opts.layer, attributions, prep.target_tensor, prep.scores, deltas,
                       opts.n_steps if deltas is not None else 0, passes.batches, tokens)
