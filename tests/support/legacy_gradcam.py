"""The hand-written Grad-CAM that served Explain until issue 28, kept as the reference.

This is ``server/explain/gradcam.py`` as of commit fa1ffef, unchanged but for
this paragraph: the server now computes Grad-CAM with Captum's
``LayerGradCam`` (``layertap.server.explain``), and
``tests/server/explain/test_gradcam_regression.py`` checks that its maps agree
with the ones this module computes on the same host, inputs and options.

Grad-CAM on the hosted model: one active pass with gradients that leaves no trace.

Grad-CAM (Selvaraju et al., 2017) weights each channel of a layer's output by
the spatial mean of the target score's gradient there, sums the channels and
keeps the positive part. The pass differs from Infer in three ways, each so
that the model ends exactly as it was:

* A forward hook swaps the layer's output for a copy of a detached leaf, and
  ``torch.autograd.grad`` differentiates with respect to that leaf only. No
  gradient reaches a parameter, so every ``.grad`` keeps its value, and the
  backward stops at the layer instead of running through the whole network.
  The copy keeps in-place operations downstream (``ReLU(inplace=True)``) off
  the leaf. The hook is removed in ``finally``.
* The model runs in eval mode, as an explanation of a prediction should:
  BatchNorm uses (and never updates) its running statistics and dropout is
  off. Each module's own ``training`` flag is put back afterwards.
* The pass is marked active, so taps, baselines and passive captures skip it.

Limitation: warm-up and Infer run under ``torch.inference_mode()`` (faster,
and the compiled reducer kernels are keyed on it). A model that builds a
cache lazily on its first forward (rotary tables, positional caches) builds
it there as an inference tensor, which autograd cannot save for backward; it
cannot be explained, and Explain answers FAILED_PRECONDITION saying so
rather than blaming the caller's input. Building the cache in ``__init__``
(or cloning it when used) avoids it.

The map is computed in float32 whatever the model's dtype, so a half-precision
model's explanation loses no further precision to the weighting and the sum.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from layertap.server.errors import InvalidField, LimitExceeded, Unsupported
from layertap.server.host.inputs import ModelInputs
from layertap.server.host.model_host import ModelHost, model_raised
from layertap.server.host.outputs import pick_output

log = logging.getLogger(__name__)

__all__ = ["EXPLAIN_OWNER", "Explanation", "GradCamOptions", "grad_cam", "require_hooks"]

#: The ``active_owner`` of an Explain pass: observers skip active passes.
EXPLAIN_OWNER = "explain"
#: Interpolation mode by the map's spatial rank (F.interpolate's names).
_MODES = {1: "linear", 2: "bilinear", 3: "trilinear"}


@dataclass(frozen=True)
class GradCamOptions:
    layer: str
    #: Empty: each sample's top class; one: every sample's; N: one per sample.
    targets: tuple[int, ...] = ()
    normalize: bool = False
    upsample: bool = False
    #: The output to explain (see ``pick_output``): empty picks the tensor, ``logits`` or the only one.
    output_name: str = ""


@dataclass(frozen=True)
class Explanation:
    #: float32, ``(N, *spatial)``, on the model's device.
    maps: torch.Tensor
    #: The explained index into each sample's flattened output, ``(N,)`` int64.
    targets: torch.Tensor
    #: The model's output at that index, ``(N,)`` float32.
    scores: torch.Tensor


class _LayerGrab:
    """Forward hook: hands the layer's output on as a copy of a fresh leaf that requires grad."""

    def __init__(self) -> None:
        self.leaf: torch.Tensor | None = None
        self.calls = 0
        self.refused = ""

    def __call__(self, module: nn.Module, args: Any, out: Any) -> Any:
        self.calls += 1
        if self.calls > 1:
            return None
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            self.refused = f"outputs {type(out).__name__ if not isinstance(out, torch.Tensor) else out.dtype}"
            return None
        self.leaf = out.detach().requires_grad_(True)
        return self.leaf.clone()


def _check_targets(targets: Sequence[int], n: int) -> None:
    if len(targets) not in (0, 1, n):
        raise InvalidField("targets", f"give none (top class), one (for every sample) or one per sample ({n}), "
                                     f"got {len(targets)}")


def _scores(out: Any, n: int, targets: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(target index, score) per sample from the model's output."""
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        what = type(out).__name__ if not isinstance(out, torch.Tensor) else f"a {out.dtype} tensor"
        raise Unsupported(f"the model outputs {what}; Explain needs one floating tensor shaped (N, classes)",
                          reason="OUTPUT_NOT_CLASSES")
    if out.dim() < 1 or out.shape[0] != n:
        raise Unsupported(f"the model's output is shaped {list(out.shape)}, without the batch of {n} first",
                          reason="OUTPUT_NOT_CLASSES")
    flat = out.reshape(n, -1)
    size = flat.shape[1]
    if not targets:
        if out.dim() != 2:
            raise Unsupported(f"targets: the model's output is shaped {list(out.shape)}, not (N, classes); give "
                              f"targets, indices into each sample's flattened output (0..{size - 1})",
                              reason="OUTPUT_NOT_CLASSES", field="targets")
        index = flat.detach().argmax(dim=1)
    else:
        for i, t in enumerate(targets):
            if not 0 <= t < size:
                raise InvalidField(f"targets[{i}]", f"must be in [0, {size}) for an output of "
                                                   f"{size} values per sample, got {t}")
        index = torch.tensor(list(targets), dtype=torch.int64, device=flat.device).expand(n)
    return index, flat.gather(1, index[:, None]).squeeze(1)


def _finish(cam: torch.Tensor, opts: GradCamOptions, input_size: Sequence[int]) -> torch.Tensor:
    """Upsample, then normalize, as asked."""
    if opts.upsample:
        mode = _MODES.get(cam.dim() - 1)
        if mode is None or len(input_size) != cam.dim() - 1:
            # The caller's argument, not the server's state: this layer and input never
            # upsample, and the same request without upsample is answered.
            raise InvalidField("upsample", f"the map of {opts.layer!r} has {cam.dim() - 1} spatial dim(s) and the "
                                          f"input {len(input_size)} (after N, C); upsampling needs 1 to 3 of each, "
                                          "the same number: leave upsample off or pick a spatial layer")
        cam = F.interpolate(cam[:, None], size=list(input_size), mode=mode, align_corners=False)[:, 0]
    if opts.normalize:
        flat = cam.reshape(cam.shape[0], -1)  # a layer without spatial dims gives one value per sample
        low = flat.min(dim=1).values.view(-1, *[1] * (cam.dim() - 1))
        span = flat.max(dim=1).values.view_as(low) - low
        cam = torch.where(span > 0, (cam - low) / span.clamp_min(torch.finfo(cam.dtype).tiny), torch.zeros_like(cam))
    return cam


#: Autograd's messages when a forward outside inference mode meets a tensor made inside it.
_INFERENCE_TENSOR_ERRORS = ("Inference tensors cannot be saved for backward",
                            "Inplace update to inference tensor outside InferenceMode")
_CACHED_INFERENCE_TENSOR = (
    "the model cached a tensor during serving (warm-up and Infer run under torch.inference_mode) and autograd "
    "cannot use it for Explain's backward; build the cache in the model's __init__ or clone it where it is used")


def _uses_inference_tensor(exc: Exception) -> bool:
    """The forward touched an inference tensor the model kept: the model's state, not the caller's input, is at fault."""
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _INFERENCE_TENSOR_ERRORS)


def require_hooks(host: ModelHost) -> None:
    """Refuse a model that takes no module hooks (TorchScript), with FAILED_PRECONDITION."""
    if not host.loaded.hooks_supported:
        raise Unsupported(f"model source {host.loaded.source!r} does not support module hooks (TorchScript "
                          "refuses Python hooks); Explain needs an eager, export or factory model")


def grad_cam(host: ModelHost, inputs: ModelInputs, opts: GradCamOptions) -> Explanation:
    """Grad-CAM maps of ``opts.layer`` for validated CPU ``inputs`` (see :func:`decode_inputs`).

    Raises:
        Unsupported: TorchScript, a layer that does not run exactly once or
            does not output a floating tensor ``(N, C, ...)``, an output that
            is not ``(N, classes)`` without targets (FAILED_PRECONDITION).
            A model that cached an inference tensor while serving (see the
            module docstring).
        InvalidField: Bad targets, ``upsample`` on a map without 1 to 3 spatial dims
            (or not as many as the input's), or the model raised on the input.
        LimitExceeded: The device ran out of memory.
    """
    require_hooks(host)
    tensors = inputs.tensors()
    n = int(tensors[0].shape[0]) if tensors and tensors[0].dim() else 0
    if n < 1:
        raise InvalidField("inputs[0].shape", "Explain needs a batch of at least one sample")
    _check_targets(opts.targets, n)
    model, layer = host.module, host.modules[opts.layer]
    grab = _LayerGrab()
    modes = [(m, m.training) for m in model.modules()]
    with host.pass_context(active_owner=EXPLAIN_OWNER), torch.enable_grad():
        handle = layer.register_forward_hook(grab)
        try:
            model.eval()
            try:
                out = host.forward(host.to_device(inputs))
            except torch.OutOfMemoryError:
                raise LimitExceeded("the device ran out of memory for this pass; send a smaller batch") from None
            except Exception as exc:  # noqa: BLE001 - the caller's input made the model raise
                if _uses_inference_tensor(exc):
                    raise Unsupported(_CACHED_INFERENCE_TENSOR, reason="INFERENCE_TENSOR_CACHED") from None
                raise model_raised(exc) from None
            leaf = _layer_output(grab, opts.layer, n)
            _, picked = pick_output(out, opts.output_name)
            index, score = _scores(picked, n, opts.targets)
            if not score.requires_grad:
                raise Unsupported(f"layer: the model's output does not depend on {opts.layer!r}", field="layer")
            (grad,) = torch.autograd.grad(score.sum(), leaf, allow_unused=True)
            if grad is None:
                raise Unsupported(f"layer: the model's output does not depend on {opts.layer!r}", field="layer")
        finally:
            handle.remove()
            for module, training in modes:
                module.training = training
    act, g = leaf.detach().float(), grad.float()
    spatial = tuple(range(2, act.dim()))
    weights = g.mean(dim=spatial, keepdim=True) if spatial else g
    cam = torch.relu((weights * act).sum(dim=1))
    maps = _finish(cam, opts, tensors[0].shape[2:])
    log.info("explain: layer=%s n=%d map=%s", opts.layer, n, list(maps.shape))
    return Explanation(maps, index, score.detach().float())


def _layer_output(grab: _LayerGrab, layer: str, n: int) -> torch.Tensor:
    """The leaf the hook made, once checked: the layer ran once and gave ``(N, C, ...)``."""
    if grab.calls != 1:
        how = "did not run" if not grab.calls else f"ran {grab.calls} times"
        raise Unsupported(f"layer: {layer!r} {how} in the pass; Grad-CAM needs a module that runs exactly once "
                          "(a module reused in one forward, such as a shared ReLU, is ambiguous: pick its block)",
                          field="layer")
    if grab.leaf is None:
        raise Unsupported(f"layer: {layer!r} {grab.refused}; Grad-CAM needs one floating tensor", field="layer")
    if grab.leaf.dim() < 2 or grab.leaf.shape[0] != n:
        raise Unsupported(f"layer: {layer!r} outputs shape {list(grab.leaf.shape)}; Grad-CAM needs "
                          f"(N={n}, channels, *spatial)", field="layer")
    return grab.leaf
