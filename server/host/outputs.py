"""Which one of a model's outputs a caller means (Explain, ``serve --smoke``)."""

from __future__ import annotations

import torch

from layertap.server.codec import flatten_outputs
from layertap.server.errors import InvalidField, Unsupported
from layertap.v1 import inference_pb2


def pick_output(out: object, name: str = "") -> tuple[str, torch.Tensor]:
    """The one output a caller means: ``name``, else a bare tensor, else ``logits``, else the only tensor.

    Raises:
        InvalidField: ``name`` is not among the outputs (field ``output_name``).
        Unsupported: No name was given and the choice is ambiguous, or there is no tensor.
    """
    flat = flatten_outputs(out)
    found = dict(flat.tensors)
    names = ", ".join(found) or "none"
    if name:
        if name not in found:
            raise InvalidField("output_name", f"the model has no tensor output {name!r}; its outputs are {names}")
        return name, found[name]
    if flat.structure == inference_pb2.OUTPUT_STRUCTURE_TENSOR:
        return flat.tensors[0]
    if "logits" in found:
        return "logits", found["logits"]
    if len(found) == 1:
        return flat.tensors[0]
    raise Unsupported(f"the model returns several tensors ({names}); name the one to use with output_name "
                      "(--output-name)", field="output_name")
