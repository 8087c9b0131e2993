"""An explanation's first pass: the inputs on the device, the targets and scores, the layer checked, the baseline.

Every method starts here. One forward without gradients gives each sample's
target (its top class unless the caller named one) and its score; a layer
method's layer is probed in the same pass (it must run once and give one
floating tensor with the batch first), and a path method's baseline is
built on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from layertap.server.errors import Unsupported
from layertap.server.explain.forward import LayerProbe, ModelFunction, targets_and_scores
from layertap.server.explain.options import GRAD_CAM, STEPPED, ExplainOptions
from layertap.server.host.inputs import ModelInputs
from layertap.server.host.model_host import ModelHost

__all__ = ["MASK_INPUT", "Prepared", "not_in_graph", "prepare", "sample_groups", "step_chunks"]

#: The input whose zeros mark padding in a token model (Hugging Face's name).
MASK_INPUT = "attention_mask"
#: Autograd's messages when the output does not depend on what is differentiated.
_NOT_IN_GRAPH = ("appears to not have been used in the graph", "does not require grad and does not have a grad_fn")


@dataclass
class Prepared:
    fn: ModelFunction
    #: The explained index per sample, as a list (Captum's target).
    targets: list[int]
    #: ``(N,)`` int64 and float32, on the CPU.
    target_tensor: torch.Tensor
    scores: torch.Tensor
    #: The layer of a layer method.
    layer_module: nn.Module | None = None
    #: A path method's baseline, the main input's shape and dtype, on the device.
    baseline: torch.Tensor | None = None
    #: ``(N, tokens)``: nonzero where a token model's input is not padding; None without a mask.
    mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def n(self) -> int:
        return int(self.fn.main.shape[0])


def not_in_graph(exc: RuntimeError, layer: str) -> Exception:
    """Autograd's complaint that the output does not depend on the layer (or input), as FAILED_PRECONDITION."""
    if not any(m in str(exc) for m in _NOT_IN_GRAPH):
        return exc
    what = f"layer: the model's output does not depend on {layer!r}" if layer else \
        "inputs: the model's output does not depend on its main input through a differentiable path"
    return Unsupported(what, field="layer" if layer else "inputs")


def sample_groups(n: int, rows: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of groups of at most ``rows`` samples covering ``n``."""
    size = max(1, min(n, rows))
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def step_chunks(n_steps: int, samples: int, rows: int) -> list[tuple[int, int]]:
    """``(start, stop)`` step ranges of one batch each: ``rows // samples`` steps (at least one), as Captum's
    ``_batch_attribution`` cuts them."""
    per = max(1, rows // samples)
    return [(start, min(start + per, n_steps)) for start in range(0, n_steps, per)]


def _mask(fn: ModelFunction) -> torch.Tensor | None:
    mask = fn.device_inputs.kwargs.get(MASK_INPUT)
    main = fn.main
    if mask is None or main.is_floating_point() or tuple(mask.shape) != tuple(main.shape):
        return None
    return mask


def _baseline(fn: ModelFunction, opts: ExplainOptions, mask: torch.Tensor | None) -> torch.Tensor:
    main = fn.main
    if opts.baseline == "given":
        assert opts.baseline_tensor is not None  # checked with the request
        base = opts.baseline_tensor.to(main.device, dtype=main.dtype).expand_as(main).contiguous()
    elif opts.baseline == "noise":
        gen = torch.Generator().manual_seed(opts.seed)
        base = (torch.randn(tuple(main.shape), generator=gen) * opts.noise_std).to(main.device, dtype=main.dtype)
    else:
        base = torch.zeros_like(main)
    if mask is not None:
        # Padding keeps the input's own ids: its embeddings never move along the
        # path, so padding gets no attribution and completeness still holds.
        base = torch.where(mask == 0, main, base)
    return base


def prepare(host: ModelHost, inputs: ModelInputs, opts: ExplainOptions) -> Prepared:
    """The first pass (run it with :meth:`ExplainPasses.run`): see the module docstring.

    Raises:
        Unsupported: The layer does not run once or does not give a floating
            ``(N, ...)`` tensor (``(N, channels, ...)`` for Grad-CAM); the output
            is not ``(N, classes)`` and no targets were given.
        InvalidField: Bad targets; the model raised on the input.
    """
    fn = ModelFunction(host, host.to_device(inputs), opts.output_name)
    n = int(fn.main.shape[0])
    layer = host.modules[opts.layer] if opts.layer else None
    probe = LayerProbe(opts.layer)
    handle = layer.register_forward_hook(probe) if layer is not None else None
    try:
        with torch.no_grad():
            out = fn.output(fn.main, *fn.others)
    finally:
        if handle is not None:
            handle.remove()
    if layer is not None:
        if opts.method == GRAD_CAM:
            probe.check(n, min_dims=2, needs=f"Grad-CAM needs (N={n}, channels, *spatial)")
        else:
            probe.check(n, min_dims=1, needs=f"Explain needs the batch (N={n}) first")
    index, score = targets_and_scores(out, opts.targets)
    mask = _mask(fn) if opts.method in STEPPED else None
    baseline = _baseline(fn, opts, mask) if opts.method in STEPPED else None
    return Prepared(fn, index.tolist(), index.cpu(), score.detach().float().cpu(), layer, baseline, mask)
