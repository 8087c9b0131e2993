"""The tensor wire codec: numpy (or torch) values <-> ``layertap.v1.Tensor`` bytes.

Tensors travel as raw little-endian row-major bytes with a dtype and an int64
shape. numpy has no bfloat16, so a bf16 tensor decodes to float32 in numpy by
an exact widening (its 16 bits become the high half of a float32), and to
``torch.bfloat16`` when torch is asked for.
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from ._errors import InvalidArgument, ProtocolError
from .v1 import tensor_pb2

Array = npt.NDArray[Any]
#: A decoded tensor: a numpy array, or a torch.Tensor with ``as_torch=True``.
TensorValue = Any

_DT = tensor_pb2.DataType
DType: TypeAlias = "tensor_pb2.DataType.ValueType"


def _dtype_table() -> dict[DType, tuple[str, np.dtype[Any]]]:
    """tensor.proto's DataType -> (numpy-style name, numpy storage of its little-endian bytes).

    DATA_TYPE_FLOAT32 is "float32". A DataType added to the proto whose name
    numpy does not know fails here, at import, until it gets a storage below.
    """
    table: dict[DType, tuple[str, np.dtype[Any]]] = {}
    for wire, code in _DT.items():
        if code == _DT.DATA_TYPE_UNSPECIFIED:
            continue
        name = wire.removeprefix("DATA_TYPE_").lower()
        # bf16 has no numpy dtype: its bits are carried as uint16.
        table[code] = (name, np.dtype("<u2") if name == "bfloat16" else np.dtype(name).newbyteorder("<"))
    return table


#: The client's one dtype table (see :func:`_dtype_table`).
_DTYPES = _dtype_table()
_BY_NAME: dict[str, DType] = {name: code for code, (name, _) in _DTYPES.items()}
_ALIASES = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32",
            "fp32": "float32", "double": "float64"}
#: numpy kind+itemsize -> wire dtype, for arrays the caller sends (bf16 has no numpy kind).
_FROM_NUMPY: dict[tuple[str, int], DType] = {
    (storage.kind, storage.itemsize): code
    for code, (_, storage) in _DTYPES.items()
    if code != _DT.DATA_TYPE_BFLOAT16
}

#: Bounds on a shape the server sends: numpy allows 64 dimensions, no model
#: output needs half of that, and 2**48 elements is 256 TiB even as uint8.
MAX_DIMS = 32
MAX_ELEMENTS = 1 << 48


def dtype_name(code: DType) -> str:
    """Returns the numpy-style name of a wire dtype (``"unspecified"`` for 0)."""
    entry = _DTYPES.get(code)
    return entry[0] if entry else "unspecified"


def dtype_code(name: str) -> DType:
    """Returns the wire dtype for a name such as ``"float16"`` or ``"bf16"``.

    Raises:
        InvalidArgument: The name is not a supported dtype.
    """
    key = _ALIASES.get(name.strip().lower(), name.strip().lower())
    key = key.removeprefix("torch.")
    try:
        return _BY_NAME[key]
    except KeyError:
        raise InvalidArgument(
            f"unknown dtype {name!r}; expected one of: {', '.join(_BY_NAME)}"
        ) from None


def bf16_bits_to_float32(bits: Array) -> Array:
    """Widens bfloat16 bit patterns (uint16) to float32, exactly.

    bfloat16 is the high half of a float32, so shifting its bits left by 16
    gives the same value, NaN payloads included.
    """
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def require_torch() -> Any:
    """Imports torch, or explains that ``as_torch=True`` needs it."""
    try:
        return importlib.import_module("torch")
    except ImportError:
        raise ImportError(
            "as_torch=True needs PyTorch, which the base layertap install does not "
            "include: pip install torch (or layertap[server])"
        ) from None


def _is_torch_tensor(x: object) -> bool:
    # A tensor can only exist if torch was imported, so never import it here.
    # While another thread is importing torch, sys.modules holds a partially
    # initialised module without `Tensor` yet: treat that as "no torch".
    tensor_type = getattr(sys.modules.get("torch"), "Tensor", None)
    return isinstance(tensor_type, type) and isinstance(x, tensor_type)


def layout(code: DType, shape: Sequence[int], what: str) -> tuple[tuple[int, ...], int]:
    """Checks a wire dtype and shape; returns the dims and the byte count they need.

    Sizes come from the server, so they are bounded here, in Python ints that
    cannot overflow, before numpy or torch sees them.

    Raises:
        ProtocolError: Unknown dtype, a negative dimension, more than
            ``MAX_DIMS`` dimensions, or more than ``MAX_ELEMENTS`` elements.
    """
    entry = _DTYPES.get(code)
    if entry is None:
        raise ProtocolError(f"{what}: unsupported wire dtype {code}")
    if len(shape) > MAX_DIMS:
        raise ProtocolError(f"{what}: {len(shape)} dimensions, at most {MAX_DIMS} are supported")
    dims = tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise ProtocolError(f"{what}: negative dimension in shape {list(dims)}")
    # A zero dimension makes any product 0: count the others too, so an empty
    # tensor cannot claim a shape whose strides overflow numpy's size checks.
    if math.prod(max(d, 1) for d in dims) > MAX_ELEMENTS:
        raise ProtocolError(f"{what}: shape {list(dims)} has more than {MAX_ELEMENTS} elements")
    return dims, math.prod(dims) * entry[1].itemsize


def decode_array(
    buffer: Any, code: DType, shape: Sequence[int], *, as_torch: bool = False, what: str = "tensor"
) -> TensorValue:
    """Decodes raw little-endian bytes into an array of ``shape``.

    Args:
        buffer: bytes-like object holding exactly the tensor's bytes. A
            writable buffer (bytearray, numpy array) is used without a copy.
        code: Wire dtype.
        shape: Dimensions, all >= 0.
        as_torch: Return a torch.Tensor (bf16 stays ``torch.bfloat16``).
        what: Names the tensor in error messages.

    Returns:
        A numpy array (bf16 widened to float32) or a torch tensor.

    Raises:
        ProtocolError: Unknown dtype, negative dimension, or a byte count that
            does not match dtype x shape.
    """
    dims, expected = layout(code, shape, what)
    nbytes = memoryview(buffer).nbytes
    if nbytes != expected:
        raise ProtocolError(
            f"{what}: {nbytes} bytes do not match {dtype_name(code)} x {list(dims)} "
            f"({expected} bytes expected)"
        )
    flat = np.frombuffer(buffer, dtype=_DTYPES[code][1])
    if not flat.flags.writeable:
        flat = flat.copy()  # Callers expect arrays they can modify.
    arr = flat.reshape(dims)
    if as_torch:
        torch = require_torch()
        if code == _DT.DATA_TYPE_BFLOAT16:
            return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(arr)
    if code == _DT.DATA_TYPE_BFLOAT16:
        return bf16_bits_to_float32(arr)
    return arr


def encode_tensor(x: Any, name: str = "") -> tensor_pb2.Tensor:
    """Encodes a numpy array (or array-like) or a torch tensor as a wire Tensor.

    A ``torch.bfloat16`` tensor is sent as DATA_TYPE_BFLOAT16 raw bits; other
    torch tensors go through numpy. Tensors on an accelerator are copied to the
    host first.

    Raises:
        InvalidArgument: The dtype has no wire equivalent (complex, uint16, ...).
    """
    if _is_torch_tensor(x):
        torch = sys.modules["torch"]
        t = x.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            bits = t.view(torch.int16).numpy()
            return tensor_pb2.Tensor(
                name=name,
                dtype=_DT.DATA_TYPE_BFLOAT16,
                shape=list(t.shape),
                raw_data=bits.astype("<i2", copy=False).tobytes(),
            )
        try:
            x = t.numpy()
        except TypeError as exc:
            raise InvalidArgument(f"cannot send a tensor of dtype {t.dtype}: {exc}") from None
    arr = np.asarray(x)
    code = _FROM_NUMPY.get((arr.dtype.kind, arr.dtype.itemsize))
    if code is None:
        raise InvalidArgument(
            f"cannot send an array of dtype {arr.dtype}; supported: "
            f"{', '.join(n for n in _BY_NAME if n != 'bfloat16')} (and torch.bfloat16)"
        )
    wire = _DTYPES[code][1]
    if arr.dtype != wire:
        arr = arr.astype(wire)  # Byte-swaps big-endian input.
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return tensor_pb2.Tensor(name=name, dtype=code, shape=list(arr.shape), raw_data=arr.tobytes())


def decode_tensor(t: tensor_pb2.Tensor, *, as_torch: bool = False) -> TensorValue:
    """Decodes a wire Tensor; see :func:`decode_array`."""
    return decode_array(t.raw_data, t.dtype, t.shape, as_torch=as_torch, what=t.name or "tensor")
