"""The one boundary between protobuf messages and Python values.

Everything that reads or builds a ``layertap.v1`` message lives here; the rest
of the client sees numpy arrays, torch tensors and the dataclasses of
:mod:`layertap._types`.

Tensors travel as raw little-endian row-major bytes with a dtype and an int64
shape. numpy has no bfloat16, so a bf16 tensor decodes to float32 in numpy by
an exact widening (its 16 bits become the high half of a float32), and to
``torch.bfloat16`` when torch is asked for.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from ._errors import InvalidArgument, ProtocolError
from ._types import (
    AbsMax,
    BaselineInfo,
    DriftThresholds,
    Histogram,
    LayerDrift,
    LayerInfo,
    MinMax,
    ModelMetadata,
    Moments,
    Nonfinite,
    Norm,
    PerChannel,
    Quantiles,
    ReducerResult,
    ReducerSpec,
    ServerStats,
    Summary,
    TapEvent,
    TapInfo,
    TapSpec,
    TensorSpec,
    ZeroFraction,
)
from .v1 import inference_pb2, telemetry_pb2, tensor_pb2

Array = npt.NDArray[Any]
#: A decoded tensor: a numpy array, or a torch.Tensor with ``as_torch=True``.
TensorValue = Any
ProgressCallback = Callable[[int, int], None]

_DT = tensor_pb2.DataType
_DType: TypeAlias = "tensor_pb2.DataType.ValueType"
_Point: TypeAlias = "telemetry_pb2.Point.ValueType"
_Kind: TypeAlias = "telemetry_pb2.ReducerKind.ValueType"
_STORAGE: dict[_DType, np.dtype[Any]] = {
    _DT.DATA_TYPE_FLOAT32: np.dtype("<f4"),
    _DT.DATA_TYPE_FLOAT16: np.dtype("<f2"),
    # bf16 has no numpy dtype: its bits are carried as uint16.
    _DT.DATA_TYPE_BFLOAT16: np.dtype("<u2"),
    _DT.DATA_TYPE_FLOAT64: np.dtype("<f8"),
    _DT.DATA_TYPE_INT8: np.dtype("i1"),
    _DT.DATA_TYPE_INT16: np.dtype("<i2"),
    _DT.DATA_TYPE_INT32: np.dtype("<i4"),
    _DT.DATA_TYPE_INT64: np.dtype("<i8"),
    _DT.DATA_TYPE_UINT8: np.dtype("u1"),
    _DT.DATA_TYPE_BOOL: np.dtype("?"),
}
_DTYPE_NAMES: dict[_DType, str] = {
    _DT.DATA_TYPE_FLOAT32: "float32",
    _DT.DATA_TYPE_FLOAT16: "float16",
    _DT.DATA_TYPE_BFLOAT16: "bfloat16",
    _DT.DATA_TYPE_FLOAT64: "float64",
    _DT.DATA_TYPE_INT8: "int8",
    _DT.DATA_TYPE_INT16: "int16",
    _DT.DATA_TYPE_INT32: "int32",
    _DT.DATA_TYPE_INT64: "int64",
    _DT.DATA_TYPE_UINT8: "uint8",
    _DT.DATA_TYPE_BOOL: "bool",
}
_BY_NAME: dict[str, _DType] = {name: code for code, name in _DTYPE_NAMES.items()}
_ALIASES = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32",
            "fp32": "float32", "double": "float64"}
#: numpy kind+itemsize -> wire dtype, for arrays the caller sends.
_FROM_NUMPY: dict[tuple[str, int], _DType] = {
    ("f", 4): _DT.DATA_TYPE_FLOAT32,
    ("f", 2): _DT.DATA_TYPE_FLOAT16,
    ("f", 8): _DT.DATA_TYPE_FLOAT64,
    ("i", 1): _DT.DATA_TYPE_INT8,
    ("i", 2): _DT.DATA_TYPE_INT16,
    ("i", 4): _DT.DATA_TYPE_INT32,
    ("i", 8): _DT.DATA_TYPE_INT64,
    ("u", 1): _DT.DATA_TYPE_UINT8,
    ("b", 1): _DT.DATA_TYPE_BOOL,
}

_POINTS: dict[str, _Point] = {
    "output": telemetry_pb2.POINT_OUTPUT,
    "input": telemetry_pb2.POINT_INPUT,
    "grad_output": telemetry_pb2.POINT_GRAD_OUTPUT,
    "grad_input": telemetry_pb2.POINT_GRAD_INPUT,
    "param_grad": telemetry_pb2.POINT_PARAM_GRAD,
}
_POINT_NAMES: dict[_Point, str] = {v: k for k, v in _POINTS.items()}

_REDUCERS: dict[str, _Kind] = {
    "moments": telemetry_pb2.REDUCER_KIND_MOMENTS,
    "minmax": telemetry_pb2.REDUCER_KIND_MINMAX,
    "abs_max": telemetry_pb2.REDUCER_KIND_ABS_MAX,
    "zero_fraction": telemetry_pb2.REDUCER_KIND_ZERO_FRACTION,
    "nonfinite": telemetry_pb2.REDUCER_KIND_NONFINITE,
    "norm": telemetry_pb2.REDUCER_KIND_NORM,
    "histogram": telemetry_pb2.REDUCER_KIND_HISTOGRAM,
    "quantiles": telemetry_pb2.REDUCER_KIND_QUANTILES,
    "per_channel": telemetry_pb2.REDUCER_KIND_PER_CHANNEL,
}
_REDUCER_NAMES: dict[_Kind, str] = {v: k for k, v in _REDUCERS.items()}
#: Parameters each reducer accepts (the field names of its proto params message).
REDUCER_PARAMS: dict[str, frozenset[str]] = {
    "histogram": frozenset({"bins", "min", "max", "edges", "sample_size"}),
    "quantiles": frozenset({"probabilities", "sample_size"}),
    "per_channel": frozenset({"dim", "max_channels"}),
}
#: Every reducer name the server knows, in proto order.
REDUCER_NAMES: tuple[str, ...] = tuple(_REDUCERS)
#: Every point name, in proto order.
POINT_NAMES: tuple[str, ...] = tuple(_POINTS)

_BASELINE_STATES = {
    telemetry_pb2.BASELINE_STATE_COLLECTING: "collecting",
    telemetry_pb2.BASELINE_STATE_READY: "ready",
}
_TAP_KINDS = {telemetry_pb2.TAP_KIND_DURABLE: "durable", telemetry_pb2.TAP_KIND_STREAM: "stream"}


# --------------------------------------------------------------------------- dtypes


def dtype_name(code: _DType) -> str:
    """Returns the numpy-style name of a wire dtype (``"unspecified"`` for 0)."""
    return _DTYPE_NAMES.get(code, "unspecified")


def dtype_code(name: str) -> _DType:
    """Returns the wire dtype for a name such as ``"float16"`` or ``"bf16"``.

    Raises:
        InvalidArgument: The name is not a supported dtype.
    """
    key = _ALIASES.get(name.strip().lower(), name.strip().lower())
    if key.startswith("torch."):
        key = key[len("torch."):]
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


def _torch() -> Any:
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


def _element_count(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def decode_array(
    buffer: Any, code: _DType, shape: Sequence[int], *, as_torch: bool = False, what: str = "tensor"
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
    storage = _STORAGE.get(code)
    if storage is None:
        raise ProtocolError(f"{what}: unsupported wire dtype {code}")
    dims = tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise ProtocolError(f"{what}: negative dimension in shape {list(dims)}")
    expected = _element_count(dims) * storage.itemsize
    nbytes = memoryview(buffer).nbytes
    if nbytes != expected:
        raise ProtocolError(
            f"{what}: {nbytes} bytes do not match {dtype_name(code)} x {list(dims)} "
            f"({expected} bytes expected)"
        )
    flat = np.frombuffer(buffer, dtype=storage)
    if not flat.flags.writeable:
        flat = flat.copy()  # Callers expect arrays they can modify.
    arr = flat.reshape(dims)
    if as_torch:
        torch = _torch()
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
    wire = _STORAGE[code]
    if arr.dtype != wire:
        arr = arr.astype(wire)  # Byte-swaps big-endian input.
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return tensor_pb2.Tensor(name=name, dtype=code, shape=list(arr.shape), raw_data=arr.tobytes())


def decode_tensor(t: tensor_pb2.Tensor, *, as_torch: bool = False) -> TensorValue:
    """Decodes a wire Tensor; see :func:`decode_array`."""
    return decode_array(t.raw_data, t.dtype, t.shape, as_torch=as_torch, what=t.name or "tensor")


# --------------------------------------------------------------------------- enums


def point_code(point: str) -> _Point:
    """Returns the wire Point for ``"output"``, ``"input"``, ...

    Raises:
        InvalidArgument: Unknown point name.
    """
    try:
        return _POINTS[point.strip().lower()]
    except KeyError:
        raise InvalidArgument(
            f"unknown point {point!r}; expected one of: {', '.join(_POINTS)}"
        ) from None


def point_name(code: _Point) -> str:
    """Returns the name of a wire Point (``"output"`` when unspecified)."""
    return _POINT_NAMES.get(code, "output")


# --------------------------------------------------------------------------- inference


def infer_request(inputs: Sequence[Any]) -> inference_pb2.InferRequest:
    """Builds an InferRequest from positional inputs."""
    return inference_pb2.InferRequest(inputs=[encode_tensor(x) for x in inputs])


def infer_outputs(resp: inference_pb2.InferResponse, *, as_torch: bool) -> list[TensorValue]:
    """Decodes an InferResponse's outputs, in order."""
    return [decode_tensor(t, as_torch=as_torch) for t in resp.outputs]


def metadata_from_proto(m: inference_pb2.GetModelMetadataResponse) -> ModelMetadata:
    """Converts GetModelMetadataResponse."""
    return ModelMetadata(
        model_name=m.model_name,
        source=m.source,
        device=m.device,
        dtype=dtype_name(m.dtype),
        parameter_count=m.parameter_count,
        inputs=[TensorSpec(s.name, dtype_name(s.dtype), tuple(s.shape)) for s in m.inputs],
        server_version=m.server_version,
        api_version=m.api_version,
        active_hooks=m.active_hooks,
        hooks_supported=m.hooks_supported,
    )


# --------------------------------------------------------------------------- layers, stats


def layers_from_proto(resp: telemetry_pb2.ListLayersResponse) -> list[LayerInfo]:
    """Converts ListLayersResponse."""
    return [
        LayerInfo(
            name=layer.name,
            type=layer.type,
            parameter_count=layer.parameter_count,
            input_shapes=[tuple(s.dims) for s in layer.input_shapes],
            output_shapes=[tuple(s.dims) for s in layer.output_shapes],
        )
        for layer in resp.layers
    ]


def stats_from_proto(s: telemetry_pb2.GetServerStatsResponse) -> ServerStats:
    """Converts GetServerStatsResponse."""
    return ServerStats(
        active_hooks=s.active_hooks,
        passes=s.passes,
        active_captures=s.active_captures,
        subscribers=s.subscribers,
        taps=s.taps,
        reducer_errors=s.reducer_errors,
        stream_dropped=s.stream_dropped,
    )


# --------------------------------------------------------------------------- capture


def capture_request(
    layers: Sequence[str],
    *,
    inputs: Sequence[Any] | None,
    passes: int,
    point: str,
    max_batch: int | None,
    dtype: str | None,
) -> telemetry_pb2.CaptureRequest:
    """Builds a CaptureRequest, validating the options client-side.

    Raises:
        InvalidArgument: Empty layer list, n < 1, negative max_batch, a point
            other than output/input, or a downcast dtype other than
            float16/bfloat16.
    """
    if not layers or any(not isinstance(name, str) or not name for name in layers):
        raise InvalidArgument("capture needs at least one non-empty layer name")
    if passes < 1:
        raise InvalidArgument(f"n must be >= 1, got {passes}")
    if max_batch is not None and max_batch < 1:
        raise InvalidArgument(f"max_batch must be >= 1, got {max_batch}")
    code = point_code(point)
    if code not in (telemetry_pb2.POINT_OUTPUT, telemetry_pb2.POINT_INPUT):
        raise InvalidArgument(f"capture supports point 'output' or 'input', got {point!r}")
    req = telemetry_pb2.CaptureRequest(
        layers=list(layers), point=code, passes=passes, max_batch=max_batch or 0
    )
    if dtype is not None:
        dcode = dtype_code(dtype)
        if dcode not in (_DT.DATA_TYPE_FLOAT16, _DT.DATA_TYPE_BFLOAT16):
            raise InvalidArgument(f"capture dtype must be 'float16' or 'bfloat16', got {dtype!r}")
        req.dtype = dcode
    if inputs is not None:
        req.inputs.extend(encode_tensor(x) for x in inputs)
    return req


@dataclass
class CapturedTensor:
    """One reassembled tensor of a capture, with its header's placement fields."""

    layer: str
    point: str
    output_index: int
    output_key: str
    output_count: int
    is_container: bool
    pass_index: int
    pass_ordinal: int
    active: bool
    dtype: str
    call_index: int = 0
    value: TensorValue = None


@dataclass
class _Pending:
    tensor: CapturedTensor
    code: _DType
    shape: tuple[int, ...]
    total: int
    num_chunks: int
    buffer: Array
    received: int = 0
    chunks: set[int] = field(default_factory=set)


class CaptureAssembler:
    """Reassembles a Capture stream (headers, then chunks written by offset).

    Each tensor's bytes go straight into one preallocated buffer of
    ``total_bytes``; the decoded array is a view of it (bf16 aside, which is
    widened). Every chunk is checked against its header, and :meth:`finish`
    verifies that every byte arrived.
    """

    def __init__(self, *, as_torch: bool = False, progress: ProgressCallback | None = None) -> None:
        self._as_torch = as_torch
        self._progress = progress
        self._pending: dict[int, _Pending] = {}
        self._seen: set[int] = set()
        self._done: list[CapturedTensor] = []
        self._received = 0
        self._expected = 0

    def feed(self, msg: telemetry_pb2.CaptureResponse) -> None:
        """Consumes one CaptureResponse.

        Raises:
            ProtocolError: The message contradicts the stream so far.
        """
        kind = msg.WhichOneof("payload")
        if kind == "header":
            self._header(msg.header)
        elif kind == "chunk":
            self._chunk(msg.chunk)
        else:
            raise ProtocolError("capture stream sent an empty message")
        if self._progress is not None:
            self._progress(self._received, self._expected)

    def _header(self, h: telemetry_pb2.CaptureHeader) -> None:
        if h.tensor_id in self._seen:
            raise ProtocolError(f"capture stream repeated header of tensor {h.tensor_id}")
        what = f"layer {h.layer!r} tensor {h.tensor_id}"
        storage = _STORAGE.get(h.dtype)
        if storage is None:
            raise ProtocolError(f"{what}: unsupported wire dtype {h.dtype}")
        shape = tuple(int(d) for d in h.shape)
        if any(d < 0 for d in shape):
            raise ProtocolError(f"{what}: negative dimension in shape {list(shape)}")
        if _element_count(shape) * storage.itemsize != h.total_bytes:
            raise ProtocolError(
                f"{what}: total_bytes {h.total_bytes} does not match "
                f"{dtype_name(h.dtype)} x {list(shape)}"
            )
        if (h.num_chunks == 0) != (h.total_bytes == 0):
            raise ProtocolError(f"{what}: {h.num_chunks} chunks for {h.total_bytes} bytes")
        tensor = CapturedTensor(
            layer=h.layer,
            point=point_name(h.point),
            output_index=h.output_index,
            output_key=h.output_key,
            output_count=h.output_count,
            is_container=h.is_container,
            pass_index=h.pass_index,
            pass_ordinal=h.pass_ordinal,
            active=h.active,
            dtype=dtype_name(h.dtype),
            call_index=h.call_index,
        )
        pending = _Pending(
            tensor=tensor,
            code=h.dtype,
            shape=shape,
            total=h.total_bytes,
            num_chunks=h.num_chunks,
            buffer=np.empty(h.total_bytes, dtype=np.uint8),
        )
        self._seen.add(h.tensor_id)
        self._expected += h.total_bytes
        if h.total_bytes == 0:
            self._complete(pending)
        else:
            self._pending[h.tensor_id] = pending

    def _chunk(self, c: telemetry_pb2.CaptureChunk) -> None:
        p = self._pending.get(c.tensor_id)
        if p is None:
            raise ProtocolError(f"capture chunk for unknown or finished tensor {c.tensor_id}")
        what = f"layer {p.tensor.layer!r} tensor {c.tensor_id}"
        data = c.data  # each access copies the bytes out of the message: once only
        n = len(data)
        if c.chunk_index >= p.num_chunks or c.chunk_index in p.chunks:
            raise ProtocolError(f"{what}: unexpected chunk {c.chunk_index} of {p.num_chunks}")
        if c.offset + n > p.total:
            raise ProtocolError(f"{what}: chunk at {c.offset}+{n} overruns {p.total} bytes")
        p.buffer[c.offset : c.offset + n] = np.frombuffer(data, dtype=np.uint8)
        p.chunks.add(c.chunk_index)
        p.received += n
        self._received += n
        if len(p.chunks) == p.num_chunks:
            if p.received != p.total:
                raise ProtocolError(f"{what}: {p.received} of {p.total} bytes in {p.num_chunks} chunks")
            del self._pending[c.tensor_id]
            self._complete(p)

    def _complete(self, p: _Pending) -> None:
        p.tensor.value = decode_array(
            p.buffer, p.code, p.shape, as_torch=self._as_torch, what=f"layer {p.tensor.layer!r}"
        )
        self._done.append(p.tensor)

    def finish(self) -> list[CapturedTensor]:
        """Returns every tensor, in arrival order.

        Raises:
            ProtocolError: The stream ended before every byte arrived.
        """
        if self._pending:
            p = next(iter(self._pending.values()))
            raise ProtocolError(
                f"capture ended early: layer {p.tensor.layer!r} got {p.received} of "
                f"{p.total} bytes ({len(self._pending)} tensor(s) incomplete)"
            )
        return list(self._done)


# --------------------------------------------------------------------------- taps


def _reducer_params(name: str, params: Mapping[str, Any]) -> telemetry_pb2.ReducerSpec:
    spec = telemetry_pb2.ReducerSpec(kind=_REDUCERS[name])
    allowed = REDUCER_PARAMS.get(name, frozenset())
    unknown = set(params) - allowed
    if unknown:
        valid = ", ".join(sorted(allowed)) if allowed else "none"
        raise InvalidArgument(
            f"reducer {name!r} has no parameter(s) {', '.join(sorted(unknown))}; valid: {valid}"
        )
    if not params:
        return spec
    target: Any = getattr(spec, name)
    try:
        for key, value in params.items():
            if key in ("edges", "probabilities"):
                getattr(target, key).extend(float(v) for v in value)
            else:
                setattr(target, key, value)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"reducer {name!r}: bad parameter: {exc}") from None
    return spec


def reducer_to_proto(reducer: ReducerSpec) -> telemetry_pb2.ReducerSpec:
    """Builds a ReducerSpec from ``"name"`` or ``{"name": {params}}``.

    Raises:
        InvalidArgument: Unknown reducer or parameter (the message lists the valid ones).
    """
    if isinstance(reducer, str):
        name, params = reducer, {}
    elif isinstance(reducer, Mapping) and len(reducer) == 1:
        ((name, raw),) = reducer.items()
        params = dict(raw or {})
    else:
        raise InvalidArgument(
            f"a reducer is a name or a one-key mapping name -> params, got {reducer!r}"
        )
    key = str(name).strip().lower().replace("-", "_")
    if key not in _REDUCERS:
        raise InvalidArgument(
            f"unknown reducer {name!r}; valid reducers: {', '.join(REDUCER_NAMES)}"
        )
    return _reducer_params(key, params)


def reducer_from_proto(spec: telemetry_pb2.ReducerSpec) -> ReducerSpec:
    """Converts a ReducerSpec back to the accepted input form."""
    name = _REDUCER_NAMES.get(spec.kind, "unspecified")
    if name not in REDUCER_PARAMS:
        return name
    params: dict[str, Any] = {}
    for fd, value in getattr(spec, name).ListFields():
        params[fd.name] = list(value) if fd.name in ("edges", "probabilities") else value
    return {name: params} if params else name


def tap_spec_to_proto(spec: TapSpec) -> telemetry_pb2.TapSpec:
    """Builds a wire TapSpec, validating sampling client-side.

    Raises:
        InvalidArgument: Empty selector, no or unknown reducers, bad point or sampling.
    """
    if not spec.selector:
        raise InvalidArgument("a tap needs a non-empty layer selector")
    if not spec.reducers:
        raise InvalidArgument(f"a tap needs at least one reducer; valid: {', '.join(REDUCER_NAMES)}")
    if spec.every is not None and spec.every < 1:
        raise InvalidArgument(f"every must be >= 1, got {spec.every}")
    if spec.probability is not None and not 0.0 < spec.probability <= 1.0:
        raise InvalidArgument(f"probability must be in (0, 1], got {spec.probability}")
    if spec.max_per_second is not None and not spec.max_per_second > 0.0:
        raise InvalidArgument(f"max_per_second must be > 0, got {spec.max_per_second}")
    return telemetry_pb2.TapSpec(
        name=spec.name,
        selector=spec.selector,
        point=point_code(spec.point),
        reducers=[reducer_to_proto(r) for r in spec.reducers],
        sampling=telemetry_pb2.Sampling(
            every_n=spec.every or 0,
            probability=spec.probability or 0.0,
            max_per_second=spec.max_per_second or 0.0,
        ),
    )


def tap_spec_from_proto(spec: telemetry_pb2.TapSpec) -> TapSpec:
    """Converts a wire TapSpec (zero sampling fields become None)."""
    s = spec.sampling
    return TapSpec(
        selector=spec.selector,
        reducers=tuple(reducer_from_proto(r) for r in spec.reducers),
        point=point_name(spec.point),
        every=s.every_n or None,
        probability=s.probability or None,
        max_per_second=s.max_per_second or None,
        name=spec.name,
    )


def _utc(msg: Any, name: str) -> _dt.datetime | None:
    if not msg.HasField(name):
        return None
    stamp: Any = getattr(msg, name)
    when: _dt.datetime = stamp.ToDatetime(tzinfo=_dt.timezone.utc)
    return when


def tap_info_from_proto(t: telemetry_pb2.TapInfo) -> TapInfo:
    """Converts a wire TapInfo."""
    return TapInfo(
        id=t.id,
        spec=tap_spec_from_proto(t.spec),
        kind=_TAP_KINDS.get(t.kind, "unspecified"),
        layers=list(t.layers),
        hits=t.hits,
        drops=t.drops,
        errors=t.errors,
        last_error=t.last_error,
        disabled=t.disabled,
        expires_at=_utc(t, "expires_at"),
        created_at=_utc(t, "created_at"),
    )


def create_tap_request(
    spec: TapSpec, *, ttl: float | None, forever: bool
) -> telemetry_pb2.CreateTapRequest:
    """Builds a CreateTapRequest; ``ttl`` is seconds (None: the server's 10 minutes).

    Raises:
        InvalidArgument: Non-positive ttl, or ttl together with forever.
    """
    req = telemetry_pb2.CreateTapRequest(spec=tap_spec_to_proto(spec), forever=forever)
    if ttl is not None:
        if forever:
            raise InvalidArgument("pass either ttl or forever=True, not both")
        if not ttl > 0:
            raise InvalidArgument(f"ttl must be > 0 seconds, got {ttl}")
        req.ttl.FromNanoseconds(int(round(ttl * 1e9)))
    return req


def subscribe_request(
    *, tap_ids: Iterable[str] = (), stream_taps: Iterable[TapSpec] = (), queue_size: int | None = None
) -> telemetry_pb2.SubscribeRequest:
    """Builds a SubscribeRequest."""
    if queue_size is not None and queue_size < 1:
        raise InvalidArgument(f"queue_size must be >= 1, got {queue_size}")
    return telemetry_pb2.SubscribeRequest(
        tap_ids=list(tap_ids),
        stream_taps=[tap_spec_to_proto(s) for s in stream_taps],
        queue_size=queue_size or 0,
    )


def _result_from_proto(r: telemetry_pb2.ReducerResult) -> tuple[str, ReducerResult] | None:
    kind = r.WhichOneof("value")
    if kind == "moments":
        return kind, Moments(r.moments.count, r.moments.mean, r.moments.std)
    if kind == "minmax":
        return kind, MinMax(r.minmax.min, r.minmax.max)
    if kind == "abs_max":
        return kind, AbsMax(r.abs_max.value)
    if kind == "zero_fraction":
        return kind, ZeroFraction(r.zero_fraction.fraction, r.zero_fraction.count)
    if kind == "nonfinite":
        return kind, Nonfinite(r.nonfinite.nan_count, r.nonfinite.inf_count)
    if kind == "norm":
        return kind, Norm(r.norm.l2)
    if kind == "histogram":
        h = r.histogram
        return kind, Histogram(list(h.edges), list(h.counts), h.sample_size, h.population)
    if kind == "quantiles":
        q = r.quantiles
        return kind, Quantiles(
            list(q.probabilities), list(q.values), q.sample_size, q.population, q.rank_error
        )
    if kind == "per_channel":
        c = r.per_channel
        return kind, PerChannel(c.dim, list(c.mean), list(c.std), list(c.abs_max), c.channels)
    return None  # A reducer newer than this client: skip it rather than fail.


def summary_from_proto(s: telemetry_pb2.Summary) -> Summary:
    """Converts a wire Summary."""
    results = dict(item for item in map(_result_from_proto, s.results) if item is not None)
    wall = s.wall_time.seconds + s.wall_time.nanos / 1e9
    return Summary(
        tap=s.tap,
        layer=s.layer,
        point=point_name(s.point),
        output_index=s.output_index,
        pass_index=s.pass_index,
        step=s.step if s.has_step else None,
        wall_time=wall,
        unsampled=s.unsampled,
        call_index=s.call_index,
        results=results,
    )


@dataclass(frozen=True)
class SubscribeBatch:
    """One decoded SubscribeResponse."""

    summaries: list[Summary]
    events: list[TapEvent]
    dropped: int
    stream_tap_ids: list[str]


def subscribe_batch_from_proto(m: telemetry_pb2.SubscribeResponse) -> SubscribeBatch:
    """Converts a SubscribeResponse."""
    return SubscribeBatch(
        summaries=[summary_from_proto(s) for s in m.summaries],
        events=[TapEvent(e.tap, e.kind, e.message) for e in m.events],
        dropped=m.dropped,
        stream_tap_ids=list(m.stream_tap_ids),
    )


# --------------------------------------------------------------------------- drift


def set_baseline_request(
    selector: str,
    *,
    passes: int,
    window: int,
    point: str,
    thresholds: DriftThresholds | Mapping[str, float] | None,
) -> telemetry_pb2.SetBaselineRequest:
    """Builds a SetBaselineRequest (thresholds left out take the server defaults).

    Raises:
        InvalidArgument: Empty selector, passes or window < 1, unknown threshold name.
    """
    if not selector:
        raise InvalidArgument("set_baseline needs a non-empty layer selector")
    if passes < 1 or window < 1:
        raise InvalidArgument(f"passes and window must be >= 1, got {passes} and {window}")
    req = telemetry_pb2.SetBaselineRequest(
        selector=selector, passes=passes, window=window, point=point_code(point)
    )
    if thresholds is not None:
        values = (
            {
                "psi": thresholds.psi,
                "js": thresholds.js,
                "wasserstein": thresholds.wasserstein,
                "mean_shift": thresholds.mean_shift,
            }
            if isinstance(thresholds, DriftThresholds)
            else dict(thresholds)
        )
        unknown = set(values) - {"psi", "js", "wasserstein", "mean_shift"}
        if unknown:
            raise InvalidArgument(
                f"unknown drift threshold(s) {', '.join(sorted(unknown))}; "
                "valid: psi, js, wasserstein, mean_shift"
            )
        req.thresholds.CopyFrom(telemetry_pb2.DriftThresholds(**{k: float(v) for k, v in values.items()}))
    return req


def baseline_from_proto(r: telemetry_pb2.SetBaselineResponse) -> BaselineInfo:
    """Converts SetBaselineResponse."""
    return BaselineInfo(tap=r.tap, layers=list(r.layers))


def drift_from_proto(r: telemetry_pb2.GetDriftResponse) -> list[LayerDrift]:
    """Converts GetDriftResponse (channel_drift_fraction -1 becomes None)."""
    return [
        LayerDrift(
            tap=d.tap,
            layer=d.layer,
            point=point_name(d.point),
            state=_BASELINE_STATES.get(d.state, "unspecified"),
            baseline_passes=d.baseline_passes,
            window_passes=d.window_passes,
            psi=d.psi,
            js=d.js,
            wasserstein=d.wasserstein,
            mean_shift=d.mean_shift,
            thresholds=DriftThresholds(
                d.thresholds.psi, d.thresholds.js, d.thresholds.wasserstein, d.thresholds.mean_shift
            ),
            drifted=d.drifted,
            channel_drift_fraction=(
                None if d.channel_drift_fraction < 0 else d.channel_drift_fraction
            ),
        )
        for d in r.layers
    ]

