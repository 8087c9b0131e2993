"""Captures: the request, reassembling the chunked stream, shaping the result.

:func:`capture_request` validates the options client-side. A Capture stream sends, per tensor, a header (layer, placement, dtype, shape,
byte count) and then its bytes in chunks, possibly interleaved with other
tensors' chunks. :class:`CaptureAssembler` writes each chunk at its offset
into one preallocated buffer per tensor and checks every step against the
header; :func:`shape_capture` then arranges the tensors the way
``Client.capture`` returns them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

import numpy as np

from ._codec import Array, DType, TensorValue, decode_array, dtype_code, dtype_name, encode_tensor, layout
from ._convert import point_code, point_name
from ._errors import InvalidArgument, ProtocolError
from ._types import Structured
from .v1 import telemetry_pb2, tensor_pb2

ProgressCallback = Callable[[int, int], None]


class CaptureOptions(TypedDict, total=False):
    """The keywords of ``Client.capture`` other than ``n`` and ``as_torch`` (see there)."""

    input: Any
    point: str
    max_batch: int | None
    dtype: str | None
    timeout: float | None
    progress: ProgressCallback | None


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
        if dcode not in (tensor_pb2.DATA_TYPE_FLOAT16, tensor_pb2.DATA_TYPE_BFLOAT16):
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
    code: DType
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
        shape, nbytes = layout(h.dtype, h.shape, what)
        if nbytes != h.total_bytes:
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


# --------------------------------------------------------------------------- result shape


def _layer_value(tensors: list[CapturedTensor]) -> Structured:
    calls = sorted({t.call_index for t in tensors})
    if len(calls) > 1:  # the module ran more than once in the pass: one entry per call
        return [_call_value([t for t in tensors if t.call_index == c]) for c in calls]
    return _call_value(tensors)


def _call_value(tensors: list[CapturedTensor]) -> Structured:
    if len(tensors) == 1 and not tensors[0].is_container:
        value: Structured = tensors[0].value
        return value
    ordered = sorted(tensors, key=lambda t: t.output_index)
    if any(t.output_key for t in ordered):
        return {t.output_key: t.value for t in ordered}
    return [t.value for t in ordered]


def shape_capture(tensors: list[CapturedTensor], names: list[str], *, single: bool, n: int) -> Any:
    """Arranges captured tensors as ``Client.capture`` returns them.

    Per pass: the one layer's value (``single``) or a dict name -> value, in
    the requested order; a list of passes when ``n > 1``.

    Raises:
        ProtocolError: No tensor arrived, or none for the single requested layer.
    """
    by_pass: dict[int, dict[str, list[CapturedTensor]]] = {}
    for t in tensors:
        by_pass.setdefault(t.pass_ordinal, {}).setdefault(t.layer, []).append(t)
    if not by_pass:
        raise ProtocolError("the capture stream ended without any tensor")
    passes: list[Structured] = []
    for ordinal in sorted(by_pass):
        layer_groups = by_pass[ordinal]
        order = names + [name for name in layer_groups if name not in names]
        values = {name: _layer_value(layer_groups[name]) for name in order if name in layer_groups}
        if single:
            if names[0] not in values:
                raise ProtocolError(f"the server sent no tensor for layer {names[0]!r}")
            passes.append(values[names[0]])
        else:
            passes.append(values)
    return passes[0] if n == 1 else passes
