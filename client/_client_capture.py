"""The capture method of :class:`~layertap.Client`: raw tensors at layers, passive or active.

A mixin, so ``Client`` keeps one class while capture's overloads (one per
shape of answer, for the user's type checker) and its long docstring live
with the Capture handle; the stream's assembly is :mod:`layertap._capture`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, overload

from . import _capture
from ._capture import CaptureOptions, ProgressCallback
from ._capture_wire import CaptureMessage, parse_response
from ._errors import DeadlineExceeded
from ._taps import Unpack
from ._transport import Streaming, Transport
from ._types import Structured
from .v1 import telemetry_pb2

__all__ = ["CAPTURE", "CaptureMethods"]

#: Capture with its chunks read in place, not through protobuf (see _capture_wire).
CAPTURE: Streaming[telemetry_pb2.CaptureRequest, CaptureMessage] = Streaming(
    "TelemetryService", "Capture", telemetry_pb2.CaptureRequest, parse_response)


class CaptureMethods:
    """``Client.capture``: the tensors at one or more layers, for one or more passes."""

    _transport: Transport

    # n=1 gives one pass, n>1 a list of passes. Literal[1] overlaps int (mypy's
    # overload-overlap): a non-literal n that happens to be 1 gets one pass too.
    @overload
    def capture(  # type: ignore[overload-overlap]
        self, layers: str, *, n: Literal[1] = ..., as_torch: Literal[False] = ...,
        **options: Unpack[CaptureOptions],
    ) -> Structured: ...
    @overload
    def capture(  # type: ignore[overload-overlap]
        self, layers: list[str] | tuple[str, ...], *, n: Literal[1] = ..., as_torch: Literal[False] = ...,
        **options: Unpack[CaptureOptions],
    ) -> dict[str, Structured]: ...
    @overload
    def capture(
        self, layers: str, *, n: int, as_torch: Literal[False] = ..., **options: Unpack[CaptureOptions]
    ) -> list[Structured]: ...
    @overload
    def capture(
        self, layers: list[str] | tuple[str, ...], *, n: int, as_torch: Literal[False] = ...,
        **options: Unpack[CaptureOptions],
    ) -> list[dict[str, Structured]]: ...
    @overload
    def capture(  # as_torch=True: torch is no dependency, so its tensors have no static type here
        self, layers: str | Sequence[str], *, n: int = ..., as_torch: bool = ..., **options: Unpack[CaptureOptions]
    ) -> Any: ...

    def capture(
        self, layers: str | Sequence[str], *, input: Any = None,  # noqa: A002 - the issue's public name
        n: int = 1, point: str = "output", max_batch: int | None = None, dtype: str | None = None,
        as_torch: bool = False, timeout: float | None = None, progress: ProgressCallback | None = None,
    ) -> Any:
        """Fetches the tensors at one or more layers.

        Passive by default: waits for the next ``n`` live forward passes. With
        ``input``, active: the server runs that input instead (its passes are
        marked and never feed taps or baselines).

        Args:
            layers: One exact module name, a selector as for :meth:`watch`
                (a glob such as ``"layer*"``, or ``"re:<regex>"``; a string
                starting ``re:`` or holding ``*``, ``?`` or ``[`` is one),
                or a list of names and selectors.
            input: Model input for an active capture: an array, or a tuple or
                list of arrays for a multi-argument model.
            n: Passes to capture.
            point: ``"output"`` or ``"input"`` of the module; a training
                agent also takes ``"grad_output"``, ``"grad_input"`` and
                ``"param_grad"`` (a dict parameter name -> gradient).
            max_batch: Keep at most this many rows of the batch.
            dtype: Downcast floating tensors to ``"float16"`` or ``"bfloat16"``.
            as_torch: Return torch tensors (needs torch installed).
            timeout: Deadline override in seconds (passive captures wait for traffic).
            progress: Called as ``progress(received_bytes, total_bytes)`` while
                data arrives; ``total_bytes`` counts the headers seen so far.

        Returns:
            A layer name and ``n=1``: its array. A selector or a list: a dict
            layer name -> array, in the order the server matched them (a
            selector's layers in model order). ``n > 1``: a list with one such
            entry per pass. Where the layer's value is a tuple/list (or a
            multi-argument input), a list ordered by position replaces the
            array; a dict output gives a dict.
            A module that runs more than once per pass (a shared ReLU, say)
            gives a list with one such value per call, in call order.

            numpy has no bfloat16: a bf16 tensor arrives as float32 (exact: its
            bits widen into the high half), or as ``torch.bfloat16`` with
            ``as_torch=True``.

        Raises:
            LayerNotFound: A name is not a module, or a selector matches none;
                the error suggests close names.
            InvalidArgument: A malformed selector.
            CaptureTooLarge: Over the server's byte cap (no data was sent); the
                error says how many layers the request matched.
            ResourceExhausted: Too many concurrent captures, or n over the limit.
            FailedPrecondition: The model refuses hooks (TorchScript), or a named
                module (or every layer of a selector) did not run in the pass.
            DeadlineExceeded: No (or not enough) traffic before the deadline.
            ProtocolError: The stream ended before every byte arrived.
        """
        names = [layers] if isinstance(layers, str) else list(layers)
        req = _capture.capture_request(names, input=input, passes=n, point=point, max_batch=max_batch, dtype=dtype)
        # Checks for torch when as_torch is set: before the server does any work.
        assembler = _capture.CaptureAssembler(as_torch=as_torch, progress=progress)
        try:
            with self._transport.translating(layer_hint=True):
                _capture.receive(self._transport.stream(CAPTURE, req, timeout=timeout, layer_hint=True), assembler)
        except DeadlineExceeded as exc:
            if input is None:
                exc.hint = _capture.no_traffic_hint(names, n)
            raise
        single = isinstance(layers, str) and not _capture.is_pattern(layers)
        return _capture.shape_capture(assembler.finish(), names, single=single, n=n)
