"""A request's tensors checked against the model's declared inputs before any pass runs.

Why here, on the request's thread: a wrong count, name, dtype or shape (or a
token id outside the vocabulary) is the caller's error, answered with a field
that names the input, never a model exception from inside the forward. The
binding by name is :mod:`.inputs`'; the training host's refusal is
:meth:`~layertap.server.host.model_host.ModelHost.validate_inputs`'.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from layertap.server.codec import dtype_name
from layertap.server.errors import InvalidField
from layertap.server.host.inputs import ModelInputs, bind_inputs
from layertap.server.host.sources import InputSpec

__all__ = ["check_inputs"]


def _castable(got: torch.dtype, want: torch.dtype) -> bool:
    """float32 inputs are accepted by float16/bfloat16 models: numpy has no
    bfloat16, so a numpy-only client could not call them otherwise."""
    return got == torch.float32 and want in (torch.float16, torch.bfloat16)


def check_inputs(inputs: Sequence[torch.Tensor | tuple[str, torch.Tensor]] | ModelInputs, declared: list[InputSpec],
                 field_name: str = "inputs") -> ModelInputs:
    """Bind the tensors to the ``declared`` inputs and check count, names, dtype, shape and token ids.

    Raises:
        InvalidField: A missing, unexpected or repeated name, a wrong count, dtype or shape, or a token id
            outside the vocabulary; the field names ``inputs[i]`` (or the input's name, for a named one).
    """
    pairs = list(inputs.named()) if isinstance(inputs, ModelInputs) else [
        p if isinstance(p, tuple) else ("", p) for p in inputs]
    bound, specs = bind_inputs(pairs, declared, field_name)
    for i, ((name, t), spec) in enumerate(zip(pairs, specs)):
        where = f"{field_name}[{i}]" if not name else f"{field_name}[{i}] ({name})"
        if t.dtype != spec.dtype and not _castable(t.dtype, spec.dtype):
            also = " (or float32, cast on the server)" if _castable(torch.float32, spec.dtype) else ""
            raise InvalidField(f"{field_name}[{i}].dtype",
                               f"{where}: expected {dtype_name(spec.dtype)}{also}, got {dtype_name(t.dtype)}")
        if t.dim() != len(spec.shape) or any(
            want != -1 and got != want for got, want in zip(t.shape, spec.shape)
        ):
            raise InvalidField(f"{field_name}[{i}].shape",
                               f"{where}: expected {list(spec.shape)} (-1 = any), got {list(t.shape)}")
    shapes = {spec.name: t.shape for (_name, t), spec in zip(pairs, specs)}
    for i, ((name, t), spec) in enumerate(zip(pairs, specs)):
        where = f"{field_name}[{i}]" if not name else f"{field_name}[{i}] ({name})"
        if spec.shape_of is not None and spec.shape_of in shapes and t.shape != shapes[spec.shape_of]:
            raise InvalidField(f"{field_name}[{i}].shape", f"{where}: {spec.name} must have {spec.shape_of}'s "
                                                           f"shape {list(shapes[spec.shape_of])}, got {list(t.shape)}")
        if spec.vocab is not None and t.numel():
            # The request's own CPU copy, before the forward: not a pass's hot path.
            lo, hi = int(t.min()), int(t.max())
            if lo < 0 or hi >= spec.vocab:
                bad = lo if lo < 0 else hi
                raise InvalidField(f"{field_name}[{i}]", f"{where}: token id {bad} is outside the model's "
                                                         f"vocabulary [0, {spec.vocab})")
    return bound
