"""Exceptions raised by the layertap client.

Every server error is a gRPC status code; the client translates it, in one
place (:func:`from_rpc_error`), into one class of this hierarchy::

    LayertapError                 .code (StatusCode name) and .details
    ├── NotFound                  NOT_FOUND (e.g. an unknown tap id)
    │   └── LayerNotFound         NOT_FOUND naming a layer; .suggestions
    ├── InvalidArgument           INVALID_ARGUMENT (also client-side checks); a ValueError
    ├── ResourceExhausted         RESOURCE_EXHAUSTED (limits on captures, K, subscribers)
    │   └── CaptureTooLarge       the capture is over the server's byte cap
    ├── FailedPrecondition        FAILED_PRECONDITION (e.g. TorchScript refuses hooks)
    ├── DeadlineExceeded          DEADLINE_EXCEEDED (the call's deadline passed)
    ├── ServerUnavailable         UNAVAILABLE (server down or unreachable)
    ├── ProtocolError             the server sent a malformed or incomplete stream
    └── ClientClosed              the Client was used after close(); a RuntimeError

Codes with no class of their own (INTERNAL, UNIMPLEMENTED, ...) raise
``LayertapError`` itself, with ``.code`` set.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Sequence

import grpc

__all__ = [
    "CaptureTooLarge",
    "ClientClosed",
    "DeadlineExceeded",
    "FailedPrecondition",
    "InvalidArgument",
    "LayerNotFound",
    "LayertapError",
    "NotFound",
    "ProtocolError",
    "ResourceExhausted",
    "ServerUnavailable",
    "from_rpc_error",
]

#: The marker the server puts in RESOURCE_EXHAUSTED details of an over-cap capture.
CAPTURE_TOO_LARGE_MARKER = "capture too large"

_LAYERS_HINT = "Hint: list layers with client.layers()"


class LayertapError(Exception):
    """Base class of every error the layertap client raises.

    Attributes:
        code: The gRPC status code name, e.g. ``"NOT_FOUND"``; for errors
            raised by the client itself, the code it would have had.
        details: The server's (or the client's) message, unchanged.
        hint: What the client adds about the likely cause, or "".
    """

    default_code = "UNKNOWN"

    def __init__(self, details: str, *, code: str | None = None) -> None:
        self.code: str = code if code is not None else self.default_code
        self.details: str = details
        self.hint: str = ""
        super().__init__(details)

    def __str__(self) -> str:
        text = "; ".join(part for part in (self.details, self.hint) if part)
        return f"{text} [{self.code}]" if text else self.code


class NotFound(LayertapError):
    """A named thing (a tap, a layer) does not exist on the server."""

    default_code = "NOT_FOUND"


class LayerNotFound(NotFound, LookupError):
    """No module of the served model has this name or matches this selector.

    Attributes:
        layer: The name the server did not find, when its message says it.
        suggestions: Close layer names (from the server's message, or computed
            with ``difflib`` against ``client.layers()``).
    """

    def __init__(
        self,
        details: str,
        *,
        code: str | None = None,
        layer: str | None = None,
        suggestions: Sequence[str] = (),
    ) -> None:
        self.layer: str | None = layer
        self.suggestions: list[str] = list(suggestions)
        super().__init__(details, code=code)

    def __str__(self) -> str:
        msg = self.details
        if self.suggestions and "did you mean" not in msg.lower():
            msg = f"{msg.rstrip('. ')}; did you mean: {', '.join(self.suggestions)}?"
        if "client.layers()" not in msg:
            msg = f"{msg.rstrip()} {_LAYERS_HINT}"
        return f"{msg} [{self.code}]"


class InvalidArgument(LayertapError, ValueError):
    """The request is malformed: bad bytes, dtype, shape, selector or option."""

    default_code = "INVALID_ARGUMENT"


class ResourceExhausted(LayertapError):
    """A server limit was hit (concurrent captures, passes, subscribers, bytes)."""

    default_code = "RESOURCE_EXHAUSTED"


class CaptureTooLarge(ResourceExhausted):
    """The capture exceeds the server's byte cap; no tensor data was sent.

    Capture fewer layers, pass ``max_batch=`` or ``dtype="float16"``.
    """


class FailedPrecondition(LayertapError):
    """The server cannot do this in its current state (e.g. no hooks on TorchScript)."""

    default_code = "FAILED_PRECONDITION"


class DeadlineExceeded(LayertapError):
    """The call did not finish before its deadline (``timeout=``)."""

    default_code = "DEADLINE_EXCEEDED"


class ServerUnavailable(LayertapError):
    """The server is down, unreachable, or shutting down."""

    default_code = "UNAVAILABLE"


class ProtocolError(LayertapError):
    """The server's response broke the wire contract (missing or stray chunks, bad sizes)."""

    default_code = "DATA_LOSS"


class ClientClosed(LayertapError, RuntimeError):
    """The :class:`~layertap.Client` was used after ``close()``."""

    default_code = "CANCELLED"


_BY_CODE: dict[grpc.StatusCode, type[LayertapError]] = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAVAILABLE: ServerUnavailable,
}

_UNKNOWN_LAYER = re.compile(r"layer\s+'([^']*)'", re.IGNORECASE)
_DID_YOU_MEAN = re.compile(r"did you mean:?\s*([^?]*)\?", re.IGNORECASE)


def _layer_not_found(
    details: str, code: str, layer_names: Callable[[], Sequence[str]] | None
) -> LayerNotFound:
    named = _UNKNOWN_LAYER.search(details)
    layer = named.group(1) if named else None
    suggestions: list[str] = []
    hint = _DID_YOU_MEAN.search(details)
    if hint:
        suggestions = [s.strip().strip("'\"") for s in hint.group(1).split(",") if s.strip()]
    elif layer is not None and layer_names is not None:
        try:
            candidates = list(layer_names())
        except (LayertapError, grpc.RpcError):
            candidates = []  # Best effort: the original error matters more.
        suggestions = difflib.get_close_matches(layer, candidates, n=3, cutoff=0.5)
    return LayerNotFound(details, code=code, layer=layer, suggestions=suggestions)


def from_status(
    code: grpc.StatusCode,
    details: str,
    *,
    layer_names: Callable[[], Sequence[str]] | None = None,
) -> LayertapError:
    """Builds the exception for a status code and its details.

    Args:
        code: The gRPC status code.
        details: The status message.
        layer_names: Optional source of layer names, called only to compute
            suggestions when a NOT_FOUND message names a layer but offers none.

    Returns:
        The matching :class:`LayertapError` subclass instance.
    """
    name = code.name
    if code is grpc.StatusCode.NOT_FOUND and _names_a_layer(details):
        return _layer_not_found(details, name, layer_names)
    if (
        code is grpc.StatusCode.RESOURCE_EXHAUSTED
        and CAPTURE_TOO_LARGE_MARKER in details.lower()
    ):
        return CaptureTooLarge(details, code=name)
    return _BY_CODE.get(code, LayertapError)(details, code=name)


def _names_a_layer(details: str) -> bool:
    """The server's two unknown-layer forms (not, say, an unknown tap id)."""
    text = details.lower()
    return text.startswith("unknown layer") or "matches no layer" in text


def from_rpc_error(
    exc: grpc.RpcError, *, layer_names: Callable[[], Sequence[str]] | None = None
) -> LayertapError:
    """Translates a ``grpc.RpcError`` (which is also a ``grpc.Call``).

    Args:
        exc: The error raised by a gRPC stub call or stream iteration.
        layer_names: See :func:`from_status`.

    Returns:
        The matching :class:`LayertapError`; the caller raises it ``from exc``.
    """
    code_fn = getattr(exc, "code", None)
    details_fn = getattr(exc, "details", None)
    code = code_fn() if callable(code_fn) else None
    details = details_fn() if callable(details_fn) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    return from_status(code, details if isinstance(details, str) else str(exc), layer_names=layer_names)
