"""Model inputs with names, and model outputs with their structure: the boundary of Infer.

Inputs: positional arrays go unnamed, first; keyword arrays (or a dict's
items) go with ``Tensor.name`` set, and the server passes them to
``forward`` as keyword arguments.

Outputs, by what the model's forward returned (``InferResponse.structure``):

- one tensor: that array, as before names existed;
- a tuple or list: an :class:`Outputs` list, one entry per position, ``None``
  where the model returned ``None`` or a non-tensor (a tuple was always a list);
- a dict or a ``ModelOutput``: an :class:`Outputs` dict, key -> array.

Either container's ``skipped`` lists the non-tensor entries with their type
(:class:`SkippedOutput`), e.g. a KV cache object. A server older than
structured outputs answers as before: one array, or a list.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._codec import TensorValue, decode_tensor, encode_tensor
from ._errors import InvalidArgument
from .v1 import inference_pb2, tensor_pb2

__all__ = ["OutputDict", "OutputList", "SkippedOutput", "decode_outputs", "encode_inputs"]

_POSITION = re.compile(r"output(\d+)")


@dataclass(frozen=True)
class SkippedOutput:
    """An output the server did not send because it is not a tensor."""

    #: Its key, or ``output{i}`` for a tuple position.
    name: str
    #: Its Python type name on the server, e.g. ``"DynamicCache"`` or ``"NoneType"``.
    type: str


class OutputDict(dict[str, Any]):
    """A named (dict or ``ModelOutput``) result: key -> array; ``skipped`` lists the non-tensors."""

    skipped: tuple[SkippedOutput, ...] = ()


class OutputList(list[Any]):
    """A tuple result: one entry per position, ``None`` for a non-tensor; ``skipped`` lists them."""

    skipped: tuple[SkippedOutput, ...] = ()


def encode_inputs(args: Sequence[Any], kwargs: Mapping[str, Any], what: str = "infer") -> list[tensor_pb2.Tensor]:
    """Wire tensors for ``forward(*args, **kwargs)``; one dict argument alone means its items by name.

    Raises:
        InvalidArgument: No input at all, a dict next to other inputs, or a name that is not a string.
    """
    if len(args) == 1 and isinstance(args[0], Mapping):
        if kwargs:
            raise InvalidArgument(f"{what}: give the inputs as one dict or as keywords, not both")
        kwargs = args[0]
        args = []
    if not args and not kwargs:
        raise InvalidArgument(f"{what}: give at least one input (see Client.metadata())")
    for name in kwargs:
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"{what}: input names are non-empty strings, got {name!r}")
    if any(isinstance(a, Mapping) for a in args):
        raise InvalidArgument(f"{what}: a dict of inputs must be the only positional argument")
    return [*(encode_tensor(x) for x in args), *(encode_tensor(x, name) for name, x in kwargs.items())]


def split_input(value: Any) -> tuple[Sequence[Any], Mapping[str, Any]]:
    """``input=`` of capture or explain: an array, a tuple/list (positional) or a dict (named)."""
    if isinstance(value, Mapping):
        return (), value
    if isinstance(value, (tuple, list)):
        return value, {}
    return (value,), {}


def decode_outputs(resp: inference_pb2.InferResponse, *, as_torch: bool) -> Any:
    """The result of ``Client.infer`` (see the module docstring)."""
    outputs: list[tuple[str, TensorValue]] = [(t.name, decode_tensor(t, as_torch=as_torch)) for t in resp.outputs]
    skipped = tuple(SkippedOutput(s.name, s.type) for s in resp.skipped)
    if resp.structure == inference_pb2.OUTPUT_STRUCTURE_MAPPING:
        named = OutputDict(outputs)
        named.skipped = skipped
        return named
    if resp.structure == inference_pb2.OUTPUT_STRUCTURE_SEQUENCE:
        at = {int(m.group(1)): v for name, v in outputs if (m := _POSITION.fullmatch(name))}
        at.update({int(m.group(1)): None for s in skipped if (m := _POSITION.fullmatch(s.name))})
        seq = OutputList(at.get(i) for i in range(max(at, default=-1) + 1))
        seq.skipped = skipped
        return seq
    values = [v for _, v in outputs]
    return values[0] if len(values) == 1 else values
