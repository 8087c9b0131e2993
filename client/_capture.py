"""Captures: the request, reassembling the chunked stream, shaping the result.

:func:`capture_request` validates the options client-side. A Capture stream
sends, per tensor, a header (layer, placement, dtype, shape, byte count) and
then its bytes in order, in chunks (read in place: ``_capture_wire``).
:class:`CaptureAssembler` checks each header's claim before allocating the
tensor's buffer, and each chunk against the header and the bytes so far;
:func:`shape_capture` then arranges the tensors the way ``Client.capture``
returns them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import numpy as np

from ._capture_wire import CaptureMessage, WireChunk
from ._codec import Array, DType, TensorValue, decode_array, dtype_code, dtype_name, layout, require_torch
from ._convert import phase_name, point_code, point_name
from ._errors import InvalidArgument, ProtocolError
from ._io import encode_inputs, split_input
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


#: Characters that make a selector a glob (the server's selector grammar).
GLOB_CHARS = frozenset("*?[")


def is_pattern(selector: str) -> bool:
    """Whether a selector is a glob or ``re:`` regex rather than one exact name.

    The tap selector grammar's own rule: ``re:`` first, or any of ``*?[``.
    """
    return selector.startswith("re:") or not GLOB_CHARS.isdisjoint(selector)


def capture_request(
    layers: Sequence[str],
    *,
    input: Any,  # noqa: A002 - Client.capture's name
    passes: int,
    point: str,
    max_batch: int | None,
    dtype: str | None,
) -> telemetry_pb2.CaptureRequest:
    """Builds a CaptureRequest, validating the options client-side.

    Exact names go in ``layers``, which every server understands; when any
    entry is a glob or regex, all go in ``selectors``, keeping their order.
    ``input`` is an active capture's model input: an array, a tuple or
    list of them for a multi-argument model, or a dict name -> array for
    named inputs (None: a passive capture).

    Raises:
        InvalidArgument: Empty layer list, n < 1, negative max_batch, an
            unknown point, or a downcast dtype other than float16/bfloat16.
    """
    if not layers or any(not isinstance(name, str) or not name for name in layers):
        raise InvalidArgument("capture needs at least one non-empty layer name or selector")
    if passes < 1:
        raise InvalidArgument(f"n must be >= 1, got {passes}")
    if max_batch is not None and max_batch < 1:
        raise InvalidArgument(f"max_batch must be >= 1, got {max_batch}")
    # Gradient points are the server's to judge: a training agent takes them, a serving host refuses.
    code = point_code(point)
    req = telemetry_pb2.CaptureRequest(point=code, passes=passes, max_batch=max_batch or 0)
    (req.selectors if any(is_pattern(name) for name in layers) else req.layers).extend(layers)
    if dtype is not None:
        req.dtype = downcast_code(dtype)
    if input is not None:
        req.inputs.extend(encode_inputs(*split_input(input), what="capture input"))
    return req


def downcast_code(dtype: str) -> DType:
    """The wire dtype of a capture's downcast: ``"float16"`` or ``"bfloat16"`` (aliases such as ``"bf16"`` too).

    Raises:
        InvalidArgument: Any other dtype.
    """
    code = dtype_code(dtype)
    if code not in (tensor_pb2.DATA_TYPE_FLOAT16, tensor_pb2.DATA_TYPE_BFLOAT16):
        raise InvalidArgument(f"capture dtype must be 'float16' or 'bfloat16', got {dtype!r}")
    return code


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
    #: The pass's training step (a training agent's passes); None for Infer traffic and active passes.
    step: int | None = None
    #: The pass's place in a generation, as ``Summary.phase``, ``position`` and ``request_ids``.
    phase: str = ""
    position: int | None = None
    request_ids: tuple[str, ...] = ()
    value: TensorValue = None


#: Bytes the headers of one capture stream may claim in all. The server sends
#: at most --max-capture-bytes (256 MiB by default) per pass and 16 passes by
#: default; 64 GiB leaves room to raise both, while a hostile or broken server
#: can no longer make the client reserve an absurd buffer.
MAX_CAPTURE_BYTES = 64 << 30


@dataclass
class _Pending:
    tensor_id: int
    tensor: CapturedTensor
    code: DType
    shape: tuple[int, ...]
    total: int
    num_chunks: int
    buffer: Array
    received: int = 0
    chunks: int = 0


class CaptureAssembler:
    """Reassembles a Capture stream: each header, then its chunks in order.

    The wire contract is strict so that a result never holds a byte the
    server did not send: a tensor's chunks follow its header with indexes
    0, 1, 2... and each starts where the previous one ended, with no gap,
    overlap or empty chunk; the tensor is complete (all ``total_bytes`` in
    exactly ``num_chunks`` chunks) before the next header or the end of the
    stream. A header's claim is checked (dtype, shape, total against
    dtype x shape, the sum against ``max_bytes``) before its buffer is
    allocated; the decoded array is a view of that buffer (bf16 aside, which
    is widened). Any breach raises :class:`ProtocolError`.
    """

    def __init__(
        self,
        *,
        as_torch: bool = False,
        progress: ProgressCallback | None = None,
        max_bytes: int = MAX_CAPTURE_BYTES,
    ) -> None:
        if as_torch:
            require_torch()
        self._as_torch = as_torch
        self._progress = progress
        self._max_bytes = max_bytes
        self._open: _Pending | None = None
        self._seen: set[int] = set()
        self._done: list[CapturedTensor] = []
        self._received = 0
        self._expected = 0

    def feed(self, msg: CaptureMessage) -> None:
        """Consumes one CaptureResponse (or a chunk of one read in place).

        Raises:
            ProtocolError: The message contradicts the stream so far.
        """
        if isinstance(msg, WireChunk):
            self._chunk(msg)
        elif (kind := msg.WhichOneof("payload")) == "header":
            self._header(msg.header)
        elif kind == "chunk":
            self._chunk(msg.chunk)
        else:
            raise ProtocolError("capture stream sent an empty message")
        if self._progress is not None:
            self._progress(self._received, self._expected)

    def _header(self, h: telemetry_pb2.CaptureHeader) -> None:
        what = f"layer {h.layer!r} tensor {h.tensor_id}"
        if self._open is not None:
            raise ProtocolError(
                f"capture stream sent the header of {what} before {self._incomplete(self._open)}"
            )
        if h.tensor_id in self._seen:
            raise ProtocolError(f"capture stream repeated header of tensor {h.tensor_id}")
        shape, nbytes = layout(h.dtype, h.shape, what)
        if nbytes != h.total_bytes:
            raise ProtocolError(
                f"{what}: total_bytes {h.total_bytes} does not match "
                f"{dtype_name(h.dtype)} x {list(shape)} ({nbytes} bytes)"
            )
        # Every chunk carries at least one byte, so a tensor has 1..total_bytes chunks.
        if (h.num_chunks == 0) != (nbytes == 0) or h.num_chunks > nbytes:
            raise ProtocolError(f"{what}: {h.num_chunks} chunks for {nbytes} bytes")
        if self._expected + nbytes > self._max_bytes:
            raise ProtocolError(
                f"{what}: {nbytes} bytes on top of {self._expected} already announced exceed the "
                f"client's cap of {self._max_bytes} bytes per capture"
            )
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
            step=h.step if h.has_step else None,
            phase=phase_name(h.phase),
            position=h.position if h.has_position else None,
            request_ids=tuple(h.request_ids),
        )
        try:
            buffer = np.empty(nbytes, dtype=np.uint8)  # only after every check above
        except MemoryError:
            raise ProtocolError(
                f"tensor {h.tensor_id} ({tensor.layer!r}) claims {nbytes} bytes, more than this "
                "machine can allocate; capture fewer passes, a max_batch or a float16 downcast"
            ) from None
        pending = _Pending(
            tensor_id=h.tensor_id,
            tensor=tensor,
            code=h.dtype,
            shape=shape,
            total=nbytes,
            num_chunks=h.num_chunks,
            buffer=buffer,
        )
        self._seen.add(h.tensor_id)
        self._expected += nbytes
        if nbytes == 0:
            self._complete(pending)
        else:
            self._open = pending

    def _chunk(self, c: telemetry_pb2.CaptureChunk | WireChunk) -> None:
        p = self._open
        if p is None or p.tensor_id != c.tensor_id:
            state = "finished" if c.tensor_id in self._seen else "unannounced"
            during = "" if p is None else f" before {self._incomplete(p)}"
            raise ProtocolError(f"capture chunk for {state} tensor {c.tensor_id}{during}")
        what = f"layer {p.tensor.layer!r} tensor {c.tensor_id}"
        if c.chunk_index != p.chunks:
            raise ProtocolError(f"{what}: chunk {c.chunk_index} arrived where chunk {p.chunks} was due")
        if c.offset != p.received:
            raise ProtocolError(
                f"{what}: chunk {c.chunk_index} starts at byte {c.offset}, not at {p.received} "
                f"where the previous one ended ({'gap' if c.offset > p.received else 'overlap'})"
            )
        data = c.data  # a view (WireChunk), or a copy on each access of a protobuf message: read once
        n = len(data) if isinstance(data, bytes) else data.nbytes
        if n == 0:
            raise ProtocolError(f"{what}: chunk {c.chunk_index} is empty")
        if p.received + n > p.total:
            raise ProtocolError(f"{what}: chunk at {c.offset}+{n} overruns {p.total} bytes")
        p.buffer[p.received : p.received + n] = np.frombuffer(data, dtype=np.uint8)
        p.chunks += 1
        p.received += n
        self._received += n
        if p.chunks == p.num_chunks or p.received == p.total:
            if (p.chunks, p.received) != (p.num_chunks, p.total):
                raise ProtocolError(
                    f"{what}: {p.received} of {p.total} bytes in {p.chunks} of {p.num_chunks} chunks"
                )
            self._open = None
            self._complete(p)

    @staticmethod
    def _incomplete(p: _Pending) -> str:
        return (f"layer {p.tensor.layer!r} tensor {p.tensor_id} was complete "
                f"({p.received} of {p.total} bytes, {p.chunks} of {p.num_chunks} chunks)")

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
        p = self._open
        if p is not None:
            raise ProtocolError(
                f"capture ended early: layer {p.tensor.layer!r} got {p.received} of {p.total} bytes "
                f"({p.chunks} of {p.num_chunks} chunks)"
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
    the requested order (the server's, when ``names`` holds a selector); a
    list of passes when ``n > 1``.

    Raises:
        ProtocolError: No tensor arrived, or none for the single requested layer.
    """
    by_pass: dict[int, dict[str, list[CapturedTensor]]] = {}
    for t in tensors:
        by_pass.setdefault(t.pass_ordinal, {}).setdefault(t.layer, []).append(t)
    if not by_pass:
        raise ProtocolError("the capture stream ended without any tensor")
    passes: list[Structured] = []
    first = [] if any(is_pattern(name) for name in names) else names
    for ordinal in sorted(by_pass):
        layer_groups = by_pass[ordinal]
        order = first + [name for name in layer_groups if name not in first]
        values = {name: _layer_value(layer_groups[name]) for name in order if name in layer_groups}
        if single:
            if names[0] not in values:
                raise ProtocolError(f"the server sent no tensor for layer {names[0]!r}")
            passes.append(values[names[0]])
        else:
            passes.append(values)
    return passes[0] if n == 1 else passes


# --------------------------------------------------------------------------- the call


def receive(call: Any, assembler: CaptureAssembler) -> None:
    """Feeds every message of a Capture call to ``assembler``; cancels the call if anything fails.

    ``call`` is a Capture stream (responses parsed by :func:`~layertap._capture_wire.parse_response`),
    a ``grpc.Call`` iterating over :data:`CaptureMessage` values.
    """
    try:
        for msg in call:
            assembler.feed(msg)
    except BaseException:
        call.cancel()  # Free the server's capture hooks now, not at the deadline.
        raise


def no_traffic_hint(names: Sequence[str], passes: int) -> str:
    """What a passive capture that ran out of time most likely lacked."""
    return (f"no live Infer traffic reached {', '.join(names)} in time ({passes} pass(es) wanted): "
            "pass input= for an active capture, or a longer timeout=")
