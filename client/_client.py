"""The layertap client: blocking calls, numpy (or torch) out.

Its calls go through one :class:`~layertap._transport.Transport` (channel,
deadlines, token, error translation), shared with its sub-clients
``client.incidents`` and ``client.baselines``. Its capture and tap methods
come from mixins (``_client_capture``, ``_client_taps``): one class for the
user, each long method group in a file of its own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, Literal, overload

from . import _convert, _explain, _generate
from ._capture_wire import CaptureMessage
from ._channel import TlsOption, normalize_target
from ._client_capture import CAPTURE, CaptureMethods
from ._client_taps import TapMethods
from ._codec import Array
from ._errors import InvalidArgument
from ._explain import Explanation
from ._fleet_baseline import Baselines
from ._generate import Generation, Prompt
from ._incidents import Incidents
from ._io import decode_outputs, encode_inputs
from ._transport import LIST_LAYERS, ServerStream, Transport, Unary
from ._types import BaselineInfo, DriftThresholds, LayerDrift, LayerInfo, ModelMetadata, ServerStats, TapSpec
from .v1 import inference_pb2, telemetry_pb2

__all__ = ["Client"]

GET_MODEL_METADATA = Unary.of("InferenceService", "GetModelMetadata", inference_pb2.GetModelMetadataRequest, inference_pb2.GetModelMetadataResponse)
INFER = Unary.of("InferenceService", "Infer", inference_pb2.InferRequest, inference_pb2.InferResponse)
GET_SERVER_STATS = Unary.of("TelemetryService", "GetServerStats", telemetry_pb2.GetServerStatsRequest, telemetry_pb2.GetServerStatsResponse)

MiB = 1 << 20
#: Seconds a unary call or a capture may take unless ``timeout=`` says otherwise.
DEFAULT_TIMEOUT = 30.0
#: The server accepts requests of up to 256 MiB of tensor data by default; the
#: slack covers the protobuf envelope around the raw bytes.
DEFAULT_MAX_MESSAGE_BYTES = 256 * MiB + 1 * MiB


class Client(CaptureMethods, TapMethods):
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

    # ------------------------------------------------------------------ layers (capture: CaptureMethods; taps: TapMethods)

    def layers(self, *, timeout: float | None = None) -> list[LayerInfo]:
        """Lists every module with its type, parameter count and last-seen shapes."""
        resp = self._transport.unary(LIST_LAYERS, telemetry_pb2.ListLayersRequest(), timeout=timeout)
        return _convert.layers_from_proto(resp)

    def stats(self, *, timeout: float | None = None) -> ServerStats:
        """Returns the server-wide counters (active hooks, passes, captures, ...)."""
        resp = self._transport.unary(GET_SERVER_STATS, telemetry_pb2.GetServerStatsRequest(), timeout=timeout)
        return _convert.stats_from_proto(resp)

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

