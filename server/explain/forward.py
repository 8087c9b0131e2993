"""The hosted model as Captum calls it, and the targets it explains.

Captum calls ``forward_func(*inputs, *additional_forward_args)`` and picks
each row's target from the result. :class:`ModelFunction` is that function
for a request: the main input (the model's first declared input) comes first,
the request's other tensors (an ``attention_mask``) follow in their own order,
and the result is the output the caller means (:func:`pick_output`) flattened
to ``(rows, values)``, so a target is an index into each sample's flattened
output, as it was before Captum.

A forward that raises is the caller's input (INVALID_ARGUMENT), except for
out-of-memory (RESOURCE_EXHAUSTED) and a model that cached an inference
tensor while serving (FAILED_PRECONDITION, see :data:`CACHED_INFERENCE_TENSOR`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from layertap.server.errors import InvalidField, LayertapServerError, LimitExceeded, Unsupported
from layertap.server.host.inputs import ModelInputs
from layertap.server.host.model_host import ModelHost, model_raised
from layertap.server.host.outputs import pick_output

__all__ = ["CACHED_INFERENCE_TENSOR", "LayerProbe", "ModelFunction", "check_targets", "targets_and_scores"]

#: Autograd's messages when a forward outside inference mode meets a tensor made inside it.
_INFERENCE_TENSOR_ERRORS = ("Inference tensors cannot be saved for backward",
                            "Inplace update to inference tensor outside InferenceMode")
CACHED_INFERENCE_TENSOR = (
    "the model cached a tensor during serving (warm-up and Infer run under torch.inference_mode) and autograd "
    "cannot use it for Explain's backward; build the cache in the model's __init__ or clone it where it is used")


def _uses_inference_tensor(exc: Exception) -> bool:
    """The forward touched an inference tensor the model kept: the model's state, not the caller's input, is at fault."""
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _INFERENCE_TENSOR_ERRORS)


def main_input_key(host: ModelHost, inputs: ModelInputs) -> str:
    """Where the model's main input sits in ``inputs``: ``""`` for the first positional tensor, else its keyword."""
    name = host.inputs[0].name if host.inputs else ""
    if name in inputs.kwargs:
        return name
    if inputs.args:
        return ""
    raise InvalidField("inputs", f"Explain attributes the model's main input {name!r}; send it")


class ModelFunction:
    """``forward_func`` for Captum: ``(main, *others) -> output (rows, values)``, on the model's device.

    Args:
        host: The model host (its forward, its output picking).
        inputs: The request's inputs on the device: the layout the calls
            rebuild (which tensor is positional, which a keyword).
        output_name: The output to explain (see :func:`pick_output`).
    """

    def __init__(self, host: ModelHost, inputs: ModelInputs, output_name: str) -> None:
        self.host = host
        self.output_name = output_name
        #: The request's inputs on the device.
        self.device_inputs = inputs
        self.key = main_input_key(host, inputs)
        self._layout = [("", i) for i in range(len(inputs.args))] + [(k, 0) for k in inputs.kwargs]
        self._main_at = self._layout.index((self.key, 0))
        tensors = inputs.tensors()
        #: The main input and the others, in the order Captum passes them.
        self.main = tensors[self._main_at]
        self.others = tuple(t for i, t in enumerate(tensors) if i != self._main_at)

    def inputs(self, main: torch.Tensor, *others: torch.Tensor) -> ModelInputs:
        """The model inputs of one call: ``main`` back in its place."""
        tensors = list(others)
        tensors.insert(self._main_at, main)
        args = tuple(t for (key, _), t in zip(self._layout, tensors) if not key)
        kwargs = {key: t for (key, _), t in zip(self._layout, tensors) if key}
        return ModelInputs(args, kwargs)

    def output(self, main: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
        """The output the caller means, as the model shapes it."""
        try:
            out = self.host.forward(self.inputs(main, *others))
        except LayertapServerError:
            raise
        except torch.OutOfMemoryError:
            raise LimitExceeded("the device ran out of memory for this pass; send a smaller batch or a smaller "
                                "internal_batch_size") from None
        except Exception as exc:  # noqa: BLE001 - the caller's input made the model raise
            if _uses_inference_tensor(exc):
                raise Unsupported(CACHED_INFERENCE_TENSOR, reason="INFERENCE_TENSOR_CACHED") from None
            raise model_raised(exc) from None
        _, picked = pick_output(out, self.output_name)
        rows = int(main.shape[0])
        if not picked.is_floating_point():
            raise Unsupported(f"the model outputs a {picked.dtype} tensor; Explain needs one floating tensor shaped "
                              "(N, classes)", reason="OUTPUT_NOT_CLASSES")
        if picked.dim() < 1 or picked.shape[0] != rows:
            raise Unsupported(f"the model's output is shaped {list(picked.shape)}, without the batch of {rows} first",
                              reason="OUTPUT_NOT_CLASSES")
        return picked

    def __call__(self, main: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
        picked = self.output(main, *others)
        return picked.reshape(picked.shape[0], -1)

    def rows(self, start: int, stop: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The main input and the others of samples ``start:stop`` (views)."""
        return self.main[start:stop], tuple(t[start:stop] for t in self.others)


def check_targets(targets: Sequence[int], n: int) -> None:
    if len(targets) not in (0, 1, n):
        raise InvalidField("targets", f"give none (top class), one (for every sample) or one per sample ({n}), "
                                     f"got {len(targets)}")


def targets_and_scores(out: torch.Tensor, targets: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(target index, score) per sample from the model's output (see :meth:`ModelFunction.output`)."""
    n = int(out.shape[0])
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


@dataclass
class LayerProbe:
    """Forward hook for the first pass: how often the layer ran, and what its first call gave.

    A layer method needs a module that runs exactly once per pass (Captum's
    hooks keep one call's value), whose output is one floating tensor with the
    batch first.
    """

    layer: str
    calls: int = 0
    output: str = ""
    shape: tuple[int, ...] = ()

    def __call__(self, module: nn.Module, args: Any, out: Any) -> None:
        self.calls += 1
        if self.calls == 1:
            if isinstance(out, torch.Tensor):
                self.output = "" if out.is_floating_point() else f"outputs {out.dtype}"
                self.shape = tuple(out.shape)
            else:
                self.output = f"outputs {type(out).__name__}"

    def check(self, n: int, *, min_dims: int, needs: str) -> None:
        """Raises Unsupported (field ``layer``) unless the layer ran once and gave a floating ``(N, ...)`` tensor."""
        if self.calls != 1:
            how = "did not run" if not self.calls else f"ran {self.calls} times"
            raise Unsupported(f"layer: {self.layer!r} {how} in the pass; Explain's layer methods need a module that "
                              "runs exactly once (a module reused in one forward, such as a shared ReLU, is "
                              "ambiguous: pick its block)", field="layer")
        if self.output:
            raise Unsupported(f"layer: {self.layer!r} {self.output}; Explain needs one floating tensor", field="layer")
        if len(self.shape) < min_dims or self.shape[0] != n:
            raise Unsupported(f"layer: {self.layer!r} outputs shape {list(self.shape)}; {needs}", field="layer")
