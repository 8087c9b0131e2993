"""The layertap client: blocking calls, numpy (or torch) out.

Its calls go through one :class:`~layertap._transport.Transport` (channel,
deadlines, token, error translation), shared with its sub-clients
``client.incidents`` and ``client.baselines``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from types import TracebackType
from typing import Any, Literal, overload

from . import _capture, _convert, _explain, _generate
from ._capture import CaptureOptions, ProgressCallback
from ._capture_wire import CaptureMessage, parse_response
from ._channel import TlsOption, normalize_target
from ._codec import Array
from ._errors import DeadlineExceeded, InvalidArgument, NotFound
from ._explain import Explanation
from ._fleet_baseline import Baselines
from ._generate import Generation, Prompt
from ._incidents import Incidents
from ._io import decode_outputs, encode_inputs
from ._results import RESULTS
from ._taps import DurableTapOptions, SummaryStream, TapHandle, TapOptions, Unpack, tap_spec
from ._transport import LIST_LAYERS, ServerStream, Streaming, Transport, Unary
from ._types import BaselineInfo, DriftThresholds, LayerDrift, LayerInfo, ModelMetadata, ServerStats, Structured, TapInfo, TapSpec
from .v1 import inference_pb2, telemetry_pb2

__all__ = ["Client"]

GET_MODEL_METADATA = Unary.of("InferenceService", "GetModelMetadata", inference_pb2.GetModelMetadataRequest, inference_pb2.GetModelMetadataResponse)
INFER = Unary.of("InferenceService", "Infer", inference_pb2.InferRequest, inference_pb2.InferResponse)
GET_SERVER_STATS = Unary.of("TelemetryService", "GetServerStats", telemetry_pb2.GetServerStatsRequest, telemetry_pb2.GetServerStatsResponse)
LIST_TAPS = Unary.of("TelemetryService", "ListTaps", telemetry_pb2.ListTapsRequest, telemetry_pb2.ListTapsResponse)
CREATE_TAP = Unary.of("TelemetryService", "CreateTap", telemetry_pb2.CreateTapRequest, telemetry_pb2.CreateTapResponse)
DELETE_TAP = Unary.of("TelemetryService", "DeleteTap", telemetry_pb2.DeleteTapRequest, telemetry_pb2.DeleteTapResponse)
SUBSCRIBE = Streaming.of("TelemetryService", "Subscribe", telemetry_pb2.SubscribeRequest, telemetry_pb2.SubscribeResponse)
#: Capture with its chunks read in place, not through protobuf (see _capture_wire).
CAPTURE: Streaming[telemetry_pb2.CaptureRequest, CaptureMessage] = Streaming(
    "TelemetryService", "Capture", telemetry_pb2.CaptureRequest, parse_response)

MiB = 1 << 20
#: Seconds a unary call or a capture may take unless ``timeout=`` says otherwise.
DEFAULT_TIMEOUT = 30.0
#: The server accepts requests of up to 256 MiB of tensor data by default; the
#: slack covers the protobuf envelope around the raw bytes.
DEFAULT_MAX_MESSAGE_BYTES = 256 * MiB + 1 * MiB


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
        tls_server_name: With ``tls``, the name to verify the certificate against instead of
            the target's host (a pod dialled by address; ``Fleet`` passes its ``dns:///`` name).

    Attributes:
        incidents: The server's flight-recorder incidents (:class:`~layertap.Incidents`).
        baselines: Drift baselines and scores (``set``, ``drift``).

    Example:
        >>> with layertap.Client("localhost:50051") as client:
        ...     x = client.capture("layer4")
    """

    def __init__(self, target: str | int, *, timeout: float = DEFAULT_TIMEOUT,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, token: str | None = None,
                 tls: TlsOption = None, tls_server_name: str | None = None) -> None:
        if not timeout > 0:
            raise InvalidArgument(f"timeout must be > 0 seconds, got {timeout}")
        self.target = normalize_target(target)
        options: list[tuple[str, Any]] = [("grpc.max_send_message_length", max_message_bytes),
                                          ("grpc.max_receive_message_length", max_message_bytes),
                                          *([("grpc.ssl_target_name_override", tls_server_name)] if tls_server_name else [])]
        self._transport = Transport(self.target, timeout=timeout, options=options, token=token, tls=tls)
        self.incidents = Incidents(self._transport)
        self.baselines = Baselines(self._transport)

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Client:
        self._transport.check_open()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<layertap.Client {self.target} {state}>"

    @property
    def timeout(self) -> float:
        """Default deadline of a call, in seconds."""
        return self._transport.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._transport.timeout = value

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._transport.closed

    def close(self) -> None:
        """Closes the channel and cancels its in-flight calls. Idempotent."""
        self._transport.close()

    # Older private spellings, kept for layertap._tensorboard and tests; new code calls the transport.

    def _translating(self, *, layer_hint: bool = False) -> AbstractContextManager[None]:
        return self._transport.translating(layer_hint=layer_hint)

    def _deadline(self, timeout: float | None) -> float | None:
        return self._transport.deadline(timeout)

    def _capture_rpc(self, req: telemetry_pb2.CaptureRequest, *, timeout: float | None) -> ServerStream[CaptureMessage]:
        """Opens a Capture stream; ``timeout`` is a deadline from :meth:`_deadline` (None: none)."""
        return self._transport.stream(CAPTURE, req, timeout=math.inf if timeout is None else timeout)

    # ------------------------------------------------------------------ inference

    def metadata(self, *, timeout: float | None = None) -> ModelMetadata:
        """Describes the served model and its input signature.

        Raises:
            LayertapError: Any server error, translated (see ``layertap._errors``).
        """
        resp = self._transport.unary(GET_MODEL_METADATA, inference_pb2.GetModelMetadataRequest(), timeout=timeout)
        return _convert.metadata_from_proto(resp)

    @overload
    def infer(self, *inputs: Any, as_torch: Literal[False] = ..., timeout: float | None = ...,
              **named: Any) -> Array | list[Array | None] | dict[str, Array]: ...
    @overload
    def infer(self, *inputs: Any, as_torch: bool, timeout: float | None = ..., **named: Any) -> Any: ...

    def infer(self, *inputs: Any, as_torch: bool = False, timeout: float | None = None, **named: Any) -> Any:
        """Runs one forward pass: ``infer(x)``, ``infer(input_ids=ids, attention_mask=mask)`` or ``infer({...})``.

        Args:
            *inputs: Positional model inputs: numpy arrays (or array-likes) or
                torch tensors (``torch.bfloat16`` is sent as bfloat16); or one
                dict, name -> input, for named inputs.
            as_torch: Return torch tensors (bf16 outputs stay bf16).
            timeout: Deadline override in seconds.
            **named: Inputs by ``forward``'s argument names (see ``metadata().inputs``).

        Returns:
            What the model returned (see ``layertap._io``): one tensor, an
            array; a tuple, a list with ``None`` where no tensor was; a dict
            or ``ModelOutput``, a dict name -> array. The list and dict list
            non-tensor outputs (a cache) in ``.skipped``. numpy bf16 outputs
            arrive as float32 (exact widening).

        Raises:
            InvalidArgument: A missing or unexpected input name, wrong count,
                dtype, shape or byte count for the model.
        """
        req = inference_pb2.InferRequest(inputs=encode_inputs(inputs, named))
        resp = self._transport.unary(INFER, req, timeout=timeout)
        return decode_outputs(resp, as_torch=as_torch)

    def generate(
        self, prompt: Prompt, *, max_new_tokens: int = 16, do_sample: bool = False, temperature: float | None = None,
        top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
        stop_token_ids: Sequence[int] = (), taps: str | TapSpec | Sequence[str | TapSpec] = (),
        capture: str | Sequence[str] = (), capture_dtype: str | None = None, as_torch: bool = False,
        timeout: float | None = None,
    ) -> Generation:
        """Generates tokens with the served causal LM (transformers' ``generate`` names), streaming each step;
        returns once the server accepted the request: iterate the :class:`Generation`, or call ``.result()``.

        Args:
            prompt: A text (needs a tokenizer in the model directory), one
                prompt's token ids, or a list of either for several sequences
                (lengths may differ); a 1-D or 2-D integer array too.
            max_new_tokens: New tokens per sequence (at most the server's ``--max-new-tokens``).
            do_sample: Sample with ``temperature``, ``top_k`` and ``top_p``
                (None: 1.0, every token, 1.0) instead of greedy decoding.
            seed: The request's own generator: a seed gives the same tokens whatever shares the batch.
            stop_token_ids: Tokens that end a sequence, besides the model's end-of-sequence ids.
            taps: Inline taps that live as long as the call and see only its
                rows: selectors or :class:`TapSpec` objects, as for :meth:`watch`.
            capture: Layer names or selectors whose outputs come with every step.
            capture_dtype: Downcast captured tensors to ``"float16"`` or ``"bfloat16"``.
            as_torch: Captured tensors as torch tensors (needs torch installed).
            timeout: Deadline of the whole call; none by default, as for streams (it ends after ``max_new_tokens``).

        Raises:
            InvalidArgument: A malformed prompt or option (also from the server).
            FailedPrecondition: The model cannot generate (``CANNOT_GENERATE``), or no tokenizer (``NO_TOKENIZER``).
            LayerNotFound: A tap or capture selector matches no module.
            PermissionDenied: Taps need the ``tap`` scope, captures ``capture``.
        """
        return _generate.generate(
            self._transport, prompt, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
            top_k=top_k, top_p=top_p, seed=seed, stop_token_ids=stop_token_ids, taps=taps, capture=capture,
            capture_dtype=capture_dtype, as_torch=as_torch, timeout=timeout)

    # ------------------------------------------------------------------ layers, capture

    def layers(self, *, timeout: float | None = None) -> list[LayerInfo]:
        """Lists every module with its type, parameter count and last-seen shapes."""
        resp = self._transport.unary(LIST_LAYERS, telemetry_pb2.ListLayersRequest(), timeout=timeout)
        return _convert.layers_from_proto(resp)

    def stats(self, *, timeout: float | None = None) -> ServerStats:
        """Returns the server-wide counters (active hooks, passes, captures, ...)."""
        resp = self._transport.unary(GET_SERVER_STATS, telemetry_pb2.GetServerStatsRequest(), timeout=timeout)
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

    def explain(
        self, x: Any, layer: str | None = None, target: int | Sequence[int] | None = None, *, method: str = "grad_cam",
        normalize: bool = False, upsample: bool = False, output_name: str = "", n_steps: int | None = None,
        baseline: Any = None, noise_std: float | None = None, seed: int | None = None,
        internal_batch_size: int | None = None, timeout: float | None = None,
    ) -> Explanation:
        """Which parts of ``x`` (or of a layer) the chosen outputs come from, by Captum on the server.

        Active passes in eval mode (taps skip them), one per internal batch (Infer runs in between); the model stays as it was.

        Args:
            x: Model input: an array, a tuple or list of arrays, or a dict name -> array. The main input (the
                model's first) is attributed; the others (an ``attention_mask``) ride along.
            layer: Layer methods only: Grad-CAM's module, whose output is ``(N, channels, *spatial)`` (usually the
                last convolutional block); layer integrated gradients' (default ``get_input_embeddings()``).
            target: Output index: None for each sample's top class, an int for every sample, or one per sample. A
                model whose output is not ``(N, classes)`` needs it: an index into each sample's flattened output.
            method: ``"grad_cam"``, ``"integrated_gradients"`` (``"ig"``), ``"layer_integrated_gradients"`` (``"lig"``), saliency.
            normalize: Grad-CAM: min-max each map to ``[0, 1]``.
            upsample: Grad-CAM: resize the maps bilinearly to the input's spatial size.
            output_name: The output to explain (a key, or ``output{i}``); default the tensor, else ``logits``, else the only one.
            n_steps: Integrated gradients' steps (default 50, at most 256).
            baseline: Where integrated gradients start: None or ``"zeros"``; ``"noise"`` (``noise_std`` times a standard
                normal, seeded with ``seed``); or an array shaped like the main input (or batch 1), token ids for token models.
            internal_batch_size: Rows (samples x steps) per server pass; default and most: the server's cap.
            timeout: Deadline override in seconds; the server starts no pass after it.

        Returns:
            An :class:`Explanation`.

        Raises:
            LayerNotFound: No module has this name; the error suggests close names.
            FailedPrecondition: TorchScript, a training agent, a layer that does not run once or has no channel
                dimension, or an output that is not ``(N, classes)`` without ``target``.
            InvalidArgument: Bad input, target, method, steps or baseline, or an option the method does not take
                (``upsample`` for a Linear head); the error's ``field`` names it.
        """
        return _explain.explain(self._transport, x, layer, target, method=method, normalize=normalize, upsample=upsample,
                                output_name=output_name, n_steps=n_steps, baseline=baseline, noise_std=noise_std, seed=seed,
                                internal_batch_size=internal_batch_size, timeout=timeout)

    # ------------------------------------------------------------------ taps

    def taps(self, *, timeout: float | None = None) -> list[TapInfo]:
        """Lists durable and stream taps with their kind, counters and expiry."""
        resp = self._transport.unary(LIST_TAPS, telemetry_pb2.ListTapsRequest(), timeout=timeout)
        return [_convert.tap_info_from_proto(t) for t in resp.taps]

    def create_tap(self, selector: str | TapSpec, **options: Unpack[DurableTapOptions]) -> TapInfo:
        """Registers a durable tap.

        Args:
            selector: Exact module name, glob (``layer*``, ``**``) or ``re:`` regex;
                or a whole :class:`TapSpec` (keyword arguments then override it).
            reducers: Names, one per result kind of ``layertap._results.RESULTS``
                ({kinds}), or one-key dicts with
                parameters, e.g. ``{"histogram": {"bins": 32, "min": -4, "max": 4}}``.
                Default: moments, minmax, nonfinite.
            point: ``"output"`` (default), ``"input"``, ``"grad_output"``,
                ``"grad_input"`` or ``"param_grad"``.
            every: Summarize every N-th live pass.
            probability: Summarize a pass with this probability; max_per_second: at most this many per second.
            phases: Only passes of these generation phases (see :class:`TapSpec`).
            keep_padding: Keep ``attention_mask`` padding in the statistics (default: left out).
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
        resp = self._transport.unary(CREATE_TAP, req, timeout=timeout, layer_hint=True)
        return _convert.tap_info_from_proto(resp.tap)

    def delete_tap(self, tap: str | TapInfo | TapHandle, *, timeout: float | None = None) -> None:
        """Removes a durable tap and its hooks.

        Raises:
            NotFound: No tap has this id (it may have expired).
        """
        tap_id = tap if isinstance(tap, str) else tap.id
        self._transport.unary(DELETE_TAP, telemetry_pb2.DeleteTapRequest(id=tap_id), timeout=timeout)

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
            if not self.closed:
                try:
                    self.delete_tap(info.id, timeout=timeout)
                except NotFound:
                    pass  # Expired already: the goal is reached.

    def watch(self, selector: str | TapSpec, *, queue_size: int | None = None, timeout: float | None = None,
              **options: Unpack[TapOptions]) -> SummaryStream:
        """Streams summaries from an inline stream tap that lives as long as the stream.

        Args:
            selector: As for :meth:`create_tap`.
            reducers: As for :meth:`create_tap` (default moments, minmax, nonfinite).
            phases: Only passes of these phases (``TapSpec.phases``), e.g. ``["decode"]``.
            keep_padding: Keep padded positions in the statistics (``TapSpec.keep_padding``).
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

    def subscribe(self, tap_ids: str | Sequence[str] = (), *, queue_size: int | None = None,
                  timeout: float | None = None) -> SummaryStream:
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
        t = self._transport
        return SummaryStream(t.stream(SUBSCRIBE, req, timeout=timeout, open_ended=True),
                             lambda: t.translating(layer_hint=True))

    # ------------------------------------------------------------------ drift (older spellings)

    def set_baseline(
        self, selector: str, *, passes: int = 500, window: int = 50, point: str = "output",
        thresholds: DriftThresholds | Mapping[str, float] | None = None, name: str = "", derive: str = "", timeout: float | None = None,
    ) -> BaselineInfo:
        """Freezes a drift baseline from the next ``passes`` live passes: ``client.baselines.set``, which see."""
        return self.baselines.set(selector, passes=passes, window=window, point=point, thresholds=thresholds,
                                  name=name, derive=derive, timeout=timeout)

    def drift(self, selector: str = "", *, timeout: float | None = None) -> list[LayerDrift]:
        """Returns the current drift scores, optionally filtered by a layer selector: ``client.baselines.drift``."""
        return self.baselines.drift(selector, timeout=timeout)


# The kinds, from the table: adding a reducer never edits this docstring.
Client.create_tap.__doc__ = (Client.create_tap.__doc__ or "").replace("{kinds}", ", ".join(r.field for r in RESULTS))
