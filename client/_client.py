"""The layertap client: one gRPC channel, blocking calls, numpy (or torch) out."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Literal, overload

import grpc

from . import _capture, _convert, _explain
from ._capture import CaptureOptions, ProgressCallback
from ._capture_wire import capture_method
from ._channel import TlsOption, normalize_target, open_channel
from ._codec import Array
from ._errors import ClientClosed, DeadlineExceeded, InvalidArgument, NotFound, from_rpc_error
from ._taps import DurableTapOptions, SummaryStream, TapHandle, TapOptions, Unpack, tap_spec
from ._types import (
    BaselineInfo, DriftThresholds, LayerDrift, LayerInfo, ModelMetadata, ServerStats, Structured, TapInfo, TapSpec,
)
from .v1 import inference_pb2, inference_pb2_grpc, telemetry_pb2, telemetry_pb2_grpc

__all__ = ["Client"]

MiB = 1 << 20
#: Seconds a unary call or a capture may take unless ``timeout=`` says otherwise.
DEFAULT_TIMEOUT = 30.0
#: The server accepts requests of up to 256 MiB of tensor data by default; the
#: slack covers the protobuf envelope around the raw bytes.
DEFAULT_MAX_MESSAGE_BYTES = 256 * MiB + 1 * MiB
_LAYER_NAMES_TIMEOUT = 5.0


class Client:
    """A blocking client for one layertap server.

    Use it as a context manager, or call :meth:`close`. After close, every
    method raises :class:`~layertap.ClientClosed` (a ``RuntimeError``). The
    client is safe to share between threads.

    Every call has a deadline: ``timeout`` seconds by default, overridable per
    call with ``timeout=`` (``math.inf`` waits forever). Subscriptions
    (:meth:`watch`, :meth:`TapHandle.summaries`) have none unless given one.

    Args:
        target: ``"host:port"``, or a bare port for ``127.0.0.1``.
        timeout: Default deadline of a call, in seconds.
        max_message_bytes: gRPC send/receive limit; matches the server's
            default 256 MiB request cap plus envelope slack.
        token: Bearer token sent on every call; default ``$LAYERTAP_TOKEN``.
        tls: True (system roots), a CA bundle path, or ``grpc.ChannelCredentials``.

    Example:
        >>> with layertap.Client("localhost:50051") as client:
        ...     x = client.capture("layer4")
    """

    def __init__(
        self,
        target: str | int,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        token: str | None = None,
        tls: TlsOption = None,
    ) -> None:
        if not timeout > 0:
            raise InvalidArgument(f"timeout must be > 0 seconds, got {timeout}")
        self.target = normalize_target(target)
        self.timeout = timeout
        options = [("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.max_receive_message_length", max_message_bytes)]
        self._channel, calls = open_channel(self.target, options, token, tls)
        self._inference = inference_pb2_grpc.InferenceServiceStub(calls)
        self._telemetry = telemetry_pb2_grpc.TelemetryServiceStub(calls)
        self._capture_rpc = capture_method(calls)  # chunks read in place, not through protobuf
        self._closed = False
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Client:
        self._check_open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<layertap.Client {self.target} {state}>"

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Closes the channel and cancels its in-flight calls. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._channel.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed(f"this layertap.Client for {self.target} is closed; create a new one")

    def _deadline(self, timeout: float | None) -> float | None:
        t = self.timeout if timeout is None else timeout
        if math.isinf(t):
            return None
        if not t > 0:
            raise InvalidArgument(f"timeout must be > 0 seconds, got {t}")
        return t

    def _layer_names(self) -> list[str]:
        resp = self._telemetry.ListLayers(
            telemetry_pb2.ListLayersRequest(), timeout=min(self.timeout, _LAYER_NAMES_TIMEOUT)
        )
        return [layer.name for layer in resp.layers]

    @contextmanager
    def _translating(self, *, layer_hint: bool = False) -> Iterator[None]:
        """The one place where gRPC errors become layertap errors."""
        self._check_open()
        try:
            yield
        except grpc.RpcError as exc:
            mapped = (
                ClientClosed(f"this layertap.Client for {self.target} was closed during the call")
                if self._closed
                else from_rpc_error(exc, layer_names=self._layer_names if layer_hint else None)
            )
            raise mapped from exc

    # ------------------------------------------------------------------ inference

    def metadata(self, *, timeout: float | None = None) -> ModelMetadata:
        """Describes the served model and its input signature.

        Raises:
            LayertapError: Any server error, translated (see ``layertap._errors``).
        """
        with self._translating():
            resp = self._inference.GetModelMetadata(
                inference_pb2.GetModelMetadataRequest(), timeout=self._deadline(timeout)
            )
        return _convert.metadata_from_proto(resp)

    @overload
    def infer(
        self, x: Any, *more: Any, as_torch: Literal[False] = ..., timeout: float | None = ...
    ) -> Array | list[Array]: ...
    @overload
    def infer(self, x: Any, *more: Any, as_torch: bool, timeout: float | None = ...) -> Any: ...

    def infer(self, x: Any, *more: Any, as_torch: bool = False, timeout: float | None = None) -> Any:
        """Runs one forward pass.

        Args:
            x: First model input: a numpy array (or array-like) or a torch
                tensor. ``torch.bfloat16`` is sent as bfloat16.
            *more: Further positional inputs.
            as_torch: Return torch tensors (bf16 outputs stay bf16).
            timeout: Deadline override in seconds.

        Returns:
            One output: an array. Several: a list of arrays. numpy bf16 outputs
            arrive as float32 (exact widening).

        Raises:
            InvalidArgument: Wrong dtype, shape or byte count for the model.
        """
        req = _convert.infer_request((x, *more))
        with self._translating():
            resp = self._inference.Infer(req, timeout=self._deadline(timeout))
        outputs = _convert.infer_outputs(resp, as_torch=as_torch)
        return outputs[0] if len(outputs) == 1 else outputs

    # ------------------------------------------------------------------ layers, capture

    def layers(self, *, timeout: float | None = None) -> list[LayerInfo]:
        """Lists every module with its type, parameter count and last-seen shapes."""
        with self._translating():
            resp = self._telemetry.ListLayers(
                telemetry_pb2.ListLayersRequest(), timeout=self._deadline(timeout)
            )
        return _convert.layers_from_proto(resp)

    def stats(self, *, timeout: float | None = None) -> ServerStats:
        """Returns the server-wide counters (active hooks, passes, captures, ...)."""
        with self._translating():
            resp = self._telemetry.GetServerStats(
                telemetry_pb2.GetServerStatsRequest(), timeout=self._deadline(timeout)
            )
        return _convert.stats_from_proto(resp)

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
        self,
        layers: str | Sequence[str],
        *,
        input: Any = None,  # noqa: A002 - the issue's public name
        n: int = 1,
        point: str = "output",
        max_batch: int | None = None,
        dtype: str | None = None,
        as_torch: bool = False,
        timeout: float | None = None,
        progress: ProgressCallback | None = None,
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
            with self._translating(layer_hint=True):
                _capture.receive(self._capture_rpc(req, timeout=self._deadline(timeout)), assembler)
        except DeadlineExceeded as exc:
            if input is None:
                exc.hint = _capture.no_traffic_hint(names, n)
            raise
        single = isinstance(layers, str) and not _capture.is_pattern(layers)
        return _capture.shape_capture(assembler.finish(), names, single=single, n=n)

    explain = _explain.explain  # Grad-CAM; documented in layertap._explain

    # ------------------------------------------------------------------ taps

    def taps(self, *, timeout: float | None = None) -> list[TapInfo]:
        """Lists durable and stream taps with their kind, counters and expiry."""
        with self._translating():
            resp = self._telemetry.ListTaps(
                telemetry_pb2.ListTapsRequest(), timeout=self._deadline(timeout)
            )
        return [_convert.tap_info_from_proto(t) for t in resp.taps]

    def create_tap(self, selector: str | TapSpec, **options: Unpack[DurableTapOptions]) -> TapInfo:
        """Registers a durable tap.

        Args:
            selector: Exact module name, glob (``layer*``, ``**``) or ``re:`` regex;
                or a whole :class:`TapSpec` (keyword arguments then override it).
            reducers: Names, one per result kind of ``layertap._results.RESULTS``
                (moments, minmax, abs_max, zero_fraction, nonfinite, norm,
                histogram, quantiles, per_channel, latency), or one-key dicts with
                parameters, e.g. ``{"histogram": {"bins": 32, "min": -4, "max": 4}}``.
                Default: moments, minmax, nonfinite.
            point: ``"output"`` (default), ``"input"``, ``"grad_output"``,
                ``"grad_input"`` or ``"param_grad"``.
            every: Summarize every N-th live pass.
            probability: Summarize a pass with this probability.
            max_per_second: At most this many summaries per second.
            name: A label for the tap.
            ttl: Seconds to live (None: the server's default, 10 minutes).
            forever: Keep the tap until deleted.
            timeout: Deadline override in seconds.

        Raises:
            InvalidArgument: Unknown reducer or parameter (checked client-side), bad sampling.
            LayerNotFound: The selector matches no module.
        """
        ttl, forever = options.pop("ttl", None), options.pop("forever", False)
        timeout = options.pop("timeout", None)
        req = _convert.create_tap_request(tap_spec(selector, options), ttl=ttl, forever=forever)
        with self._translating(layer_hint=True):
            resp = self._telemetry.CreateTap(req, timeout=self._deadline(timeout))
        return _convert.tap_info_from_proto(resp.tap)

    def delete_tap(self, tap: str | TapInfo | TapHandle, *, timeout: float | None = None) -> None:
        """Removes a durable tap and its hooks.

        Raises:
            NotFound: No tap has this id (it may have expired).
        """
        tap_id = tap if isinstance(tap, str) else tap.id
        with self._translating():
            self._telemetry.DeleteTap(
                telemetry_pb2.DeleteTapRequest(id=tap_id), timeout=self._deadline(timeout)
            )

    @contextmanager
    def tap(self, selector: str | TapSpec, **options: Unpack[DurableTapOptions]) -> Iterator[TapHandle]:
        """Creates a durable tap for the duration of a ``with`` block.

        Takes the arguments of :meth:`create_tap`. On exit, however the block
        ends, open subscriptions are cancelled and the tap is deleted (a tap
        that already expired is fine).

        Example:
            >>> with client.tap("layer*", reducers=["moments"], ttl=60) as t:
            ...     for s in t.summaries():
            ...         print(s.layer, s.results["moments"].mean)
        """
        timeout = options.get("timeout")
        info = self.create_tap(selector, **options)
        handle = TapHandle(self, info)
        try:
            yield handle
        finally:
            handle.close()
            if not self._closed:
                try:
                    self.delete_tap(info.id, timeout=timeout)
                except NotFound:
                    pass  # Expired already: the goal is reached.

    def watch(
        self,
        selector: str | TapSpec,
        *,
        queue_size: int | None = None,
        timeout: float | None = None,
        **options: Unpack[TapOptions],
    ) -> SummaryStream:
        """Streams summaries from an inline stream tap that lives as long as the stream.

        Args:
            selector: As for :meth:`create_tap`.
            reducers: As for :meth:`create_tap` (default moments, minmax, nonfinite).
            every: Summarize every N-th live pass.
            point: Where to read the tensor (default ``"output"``).
            probability: Summarize a pass with this probability.
            max_per_second: At most this many summaries per second.
            queue_size: Server-side queue length; a slow reader loses the oldest
                messages, counted in ``stream.dropped``.
            timeout: Deadline in seconds (None: until closed).

        Returns:
            A :class:`SummaryStream`; close it (or use ``with``) to remove the tap.
            A bad selector raises when iteration starts.
        """
        req = _convert.subscribe_request(stream_taps=[tap_spec(selector, options)], queue_size=queue_size)
        return self._subscribe(req, timeout)

    def subscribe(
        self,
        tap_ids: str | Sequence[str] = (),
        *,
        queue_size: int | None = None,
        timeout: float | None = None,
    ) -> SummaryStream:
        """Follows durable taps (all of them when ``tap_ids`` is empty).

        Args:
            tap_ids: The id of a durable tap to follow, or a list of ids.
            queue_size: Server-side queue length for this subscriber.
            timeout: Deadline in seconds (None: until closed).
        """
        ids = ([tap_ids] if tap_ids else []) if isinstance(tap_ids, str) else tap_ids  # a str is one id; "" is all
        req = _convert.subscribe_request(tap_ids=ids, queue_size=queue_size)
        return self._subscribe(req, timeout)

    def _subscribe(self, req: telemetry_pb2.SubscribeRequest, timeout: float | None) -> SummaryStream:
        self._check_open()
        deadline = None if timeout is None or math.isinf(timeout) else self._deadline(timeout)
        with self._translating():
            call = self._telemetry.Subscribe(req, timeout=deadline)
        return SummaryStream(call, lambda: self._translating(layer_hint=True))

    # ------------------------------------------------------------------ drift

    def set_baseline(
        self,
        selector: str,
        *,
        passes: int = 100,
        window: int = 50,
        point: str = "output",
        thresholds: DriftThresholds | Mapping[str, float] | None = None,
        name: str = "",
        timeout: float | None = None,
    ) -> BaselineInfo:
        """Freezes a drift baseline from the next ``passes`` live passes.

        Args:
            selector: Layers to baseline (tap selector syntax).
            passes: Live passes that make up the baseline.
            window: Sliding window of current passes compared with it.
            point: Where to read the tensor.
            thresholds: Drift thresholds, as a :class:`DriftThresholds` or a
                mapping with keys psi, js, wasserstein, mean_shift (missing keys
                take the server defaults 0.2, 0.1, 0.1, 1.0).
            name: The baseline tap's id (default: ``baseline-<hash>`` of the
                selector and point). Calling again with the same name resets it.
            timeout: Deadline override in seconds.

        Returns:
            The durable tap collecting the baseline and the layers it covers.
        """
        req = _convert.set_baseline_request(
            selector, passes=passes, window=window, point=point, thresholds=thresholds, name=name
        )
        with self._translating(layer_hint=True):
            resp = self._telemetry.SetBaseline(req, timeout=self._deadline(timeout))
        return _convert.baseline_from_proto(resp)

    def drift(self, selector: str = "", *, timeout: float | None = None) -> list[LayerDrift]:
        """Returns the current drift scores, optionally filtered by a layer selector."""
        with self._translating(layer_hint=True):
            resp = self._telemetry.GetDrift(
                telemetry_pb2.GetDriftRequest(selector=selector), timeout=self._deadline(timeout)
            )
        return _convert.drift_from_proto(resp)
