"""Conversions between torch tensors and the wire ``Tensor`` message.

Tensors travel as raw little-endian row-major bytes with a dtype and an int64
shape, like KServe v2 ``raw_input_contents``.

Decoding copies a request's bytes once. Reading ``raw_data`` of a (upb)
message already returns a fresh ``bytes`` copy on every access, so the codec
reads it once and views that copy as a tensor (``torch.frombuffer``) instead
of copying it again. The copy belongs to this request alone: a model that
writes its input in place writes into a buffer nobody else sees. Tensors under
``VIEW_MIN_BYTES`` are copied into a ``bytearray`` instead, which costs
nothing and keeps interpreter-shared ``bytes`` objects (``b""``, single
bytes) out of reach of such a model.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

import numpy as np
import torch
from google.protobuf.internal import api_implementation

from layertap.server.errors import InvalidField
from layertap.server.limits import MAX_TENSOR_DIMS, MAX_TENSOR_ELEMENTS
from layertap.v1 import inference_pb2, tensor_pb2

DataType = tensor_pb2.DataType

#: The server's one dtype table: tensor.proto's DataType -> torch dtype, by
#: name (DATA_TYPE_FLOAT32 is torch.float32), in the enum's order. A DataType
#: added to the proto without a torch dtype of its name fails here, at import.
TORCH_BY_WIRE: Final[Mapping[tensor_pb2.DataType.ValueType, torch.dtype]] = MappingProxyType({
    value: getattr(torch, name.removeprefix("DATA_TYPE_").lower())
    for name, value in DataType.items()
    if value != tensor_pb2.DATA_TYPE_UNSPECIFIED
})
WIRE_BY_TORCH: dict[torch.dtype, tensor_pb2.DataType.ValueType] = {v: k for k, v in TORCH_BY_WIRE.items()}
#: ``"float32"`` -> ``torch.float32``: the names the server's flags and messages use.
DTYPE_BY_NAME: Final[Mapping[str, torch.dtype]] = MappingProxyType({str(t).removeprefix("torch."): t for t in TORCH_BY_WIRE.values()})

#: Smallest tensor decoded as a view of the request's bytes rather than a copy.
VIEW_MIN_BYTES = 4096
#: upb returns a fresh ``bytes`` on each read of a bytes field, private to the
#: caller, so a tensor may view it. The pure-Python protobuf returns the
#: message's own object: there, copy, or a model writing its input in place
#: would change the request.
_FIELD_READS_COPY = api_implementation.Type() == "upb"

# The views are of private, read-only ``bytes`` copies (see the module doc).
# torch warns about that once per process; spend the warning here, at import,
# rather than on some request's thread (warning filters are not thread-safe).
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(bytes(4), dtype=torch.uint8)

if sys.byteorder != "little":  # pragma: no cover - no big-endian CI machine
    raise ImportError("layertap's wire format assumes a little-endian host")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def wire_dtype(dtype: torch.dtype) -> tensor_pb2.DataType.ValueType:
    """The wire enum for a torch dtype; raises InvalidField when unsupported."""
    try:
        return WIRE_BY_TORCH[dtype]
    except KeyError:
        raise InvalidField("dtype", f"unsupported tensor dtype {dtype}") from None


def tensor_nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Bytes a dense tensor of ``dtype`` and ``shape`` occupies."""
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


def tensor_from_proto(msg: tensor_pb2.Tensor, field: str = "inputs[0]", raw: bytes | None = None) -> torch.Tensor:
    """Decode a wire tensor into a CPU torch tensor, validating bytes vs shape.

    Args:
        msg: The wire tensor.
        field: Its request field, for errors.
        raw: ``msg.raw_data`` when the caller already read it: each read of a
            bytes field copies it, so read it once.
    """
    data = msg.raw_data if raw is None else raw
    if msg.dtype not in TORCH_BY_WIRE:
        valid = ", ".join(tensor_pb2.DataType.Name(k) for k in TORCH_BY_WIRE)
        raise InvalidField(f"{field}.dtype", f"unsupported or unset dtype; expected one of {valid}")
    dtype = TORCH_BY_WIRE[msg.dtype]
    shape = tuple(int(d) for d in msg.shape)
    if len(shape) > MAX_TENSOR_DIMS:
        raise InvalidField(f"{field}.shape", f"at most {MAX_TENSOR_DIMS} dimensions, got {len(shape)}")
    if any(d < 0 for d in shape):
        raise InvalidField(f"{field}.shape", f"negative dimension in shape {list(shape)}")
    if math.prod(max(d, 1) for d in shape) > MAX_TENSOR_ELEMENTS:
        raise InvalidField(f"{field}.shape", f"shape {list(shape)} is over {MAX_TENSOR_ELEMENTS} elements "
                                            "(zero-sized dimensions counted as 1)")
    expected = tensor_nbytes(dtype, shape)
    if len(data) != expected:
        raise InvalidField(
            f"{field}.raw_data",
            f"got {len(data)} bytes but {dtype_name(dtype)} x {list(shape)} "
            f"needs {expected} bytes",
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    private = len(data) >= VIEW_MIN_BYTES and isinstance(data, bytes) and _FIELD_READS_COPY
    buffer = data if private else bytearray(data)
    return torch.frombuffer(buffer, dtype=dtype).reshape(shape)


#: Same-size integer dtypes, for a byte view of any CPU tensor (bf16 has no numpy dtype).
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def host_bytes(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's row-major bytes as a 1-D uint8 array: a view when contiguous, else one numpy copy.

    Why numpy: torch's ``.contiguous()`` copy runs an OpenMP parallel region,
    and on a gRPC worker or the recorder thread that starts a worker team of
    that thread's own, which slows every later forward (see
    ``host.model_thread``). numpy copies on the calling thread alone.
    """
    t = t.detach().resolve_conj().resolve_neg()  # a lazy conj/neg bit has no byte view
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    same = _SAME_SIZE_INT.get(t.element_size())
    if same is None:  # no real dtype of another size reaches here; keep torch's copy for one that does
        return t.contiguous().view(-1).view(torch.uint8).numpy()
    return np.ascontiguousarray(t.view(same).numpy()).reshape(-1).view(np.uint8)


def tensor_to_bytes(t: torch.Tensor) -> bytes:
    """Row-major bytes of a CPU tensor (see :func:`host_bytes`)."""
    return host_bytes(t).tobytes()


def tensor_to_proto(t: torch.Tensor, name: str = "") -> tensor_pb2.Tensor:
    """Encode a tensor (any device) as a wire tensor."""
    cpu = t.detach().to("cpu")
    return tensor_pb2.Tensor(
        name=name, dtype=wire_dtype(cpu.dtype), shape=list(cpu.shape), raw_data=tensor_to_bytes(cpu)
    )


@dataclass
class FlatOutputs:
    """A forward's result as the wire carries it (``InferResponse``)."""

    #: ``(name, tensor)``: ``"output"`` for one tensor, ``output{i}`` for a
    #: tuple/list position, the key for a dict or ``ModelOutput``.
    tensors: list[tuple[str, torch.Tensor]]
    #: An ``OutputStructure`` value.
    structure: int
    #: ``(name, type name)`` of each entry that is not a tensor: None, a cache object, a nested container.
    skipped: list[tuple[str, str]] = field(default_factory=list)


def flatten_outputs(out: object) -> FlatOutputs:
    """Model outputs with their names: one tensor, a tuple/list, or a dict (``ModelOutput`` is one).

    Raises:
        InvalidField: The model returned something with no tensor at all.
    """
    if isinstance(out, torch.Tensor):
        return FlatOutputs([("output", out)], inference_pb2.OUTPUT_STRUCTURE_TENSOR)
    if isinstance(out, dict):
        items = [(str(k), v) for k, v in out.items()]
        structure = inference_pb2.OUTPUT_STRUCTURE_MAPPING
    elif isinstance(out, (tuple, list)):
        items = [(f"output{i}", v) for i, v in enumerate(out)]
        structure = inference_pb2.OUTPUT_STRUCTURE_SEQUENCE
    else:
        raise InvalidField("outputs", f"model returned {type(out).__name__}, which has no tensors to send")
    flat = FlatOutputs([], structure)
    for name, value in items:
        if isinstance(value, torch.Tensor):
            flat.tensors.append((name, value))
        else:
            flat.skipped.append((name, type(value).__name__))
    return flat
