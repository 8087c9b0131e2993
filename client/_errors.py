"""Exceptions raised by the layertap client.

Every server error is a gRPC status; the client translates it, in one place
(:func:`from_rpc_error`), into one class of this hierarchy::

    LayertapError                 .code, .details, .reason, .field, .metadata
    ├── NotFound                  NOT_FOUND (e.g. an unknown tap id)
    │   └── LayerNotFound         reason LAYER_NOT_FOUND; .layer, .suggestions
    ├── InvalidArgument           INVALID_ARGUMENT (also client-side checks); a ValueError
    ├── AlreadyExists             ALREADY_EXISTS (e.g. a tap name that is taken)
    ├── ResourceExhausted         RESOURCE_EXHAUSTED (limits on captures, K, subscribers)
    │   └── CaptureTooLarge       reason CAPTURE_TOO_LARGE: over the server's byte cap
    ├── FailedPrecondition        FAILED_PRECONDITION (e.g. TorchScript refuses hooks)
    ├── DeadlineExceeded          DEADLINE_EXCEEDED (the call's deadline passed)
    ├── ServerUnavailable         UNAVAILABLE (server down or unreachable)
    ├── Unauthenticated           UNAUTHENTICATED (no, unknown or expired token)
    ├── PermissionDenied          PERMISSION_DENIED (the token lacks the scope; .metadata["scope"])
    ├── ProtocolError             the server sent a malformed or incomplete stream
    └── ClientClosed              the Client was used after close(); a RuntimeError

The class comes from data, never from message text: the server attaches a
``google.rpc.Status`` whose ``ErrorInfo`` (domain ``layertap.dev``) carries a
``reason`` and metadata, plus a ``BadRequest`` field violation for invalid
arguments. The reasons are ``layertap.v1.ErrorReason`` (``errors.proto``), sent
as :func:`wire_reason` names them. A reason with a class of its own
(LAYER_NOT_FOUND, CAPTURE_TOO_LARGE) picks it; otherwise the status code does, which also covers
statuses that carry no details (a deadline, an unreachable server). Codes with
no class of their own (INTERNAL, UNIMPLEMENTED, ...) raise ``LayertapError``
itself, with ``.code`` set.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
from google.rpc import error_details_pb2  # type: ignore[import-untyped, unused-ignore]
from grpc_status import rpc_status  # type: ignore[import-untyped, unused-ignore]

from .v1 import errors_pb2

__all__ = [
    "AlreadyExists",
    "CaptureTooLarge",
    "ClientClosed",
    "DeadlineExceeded",
    "FailedPrecondition",
    "InvalidArgument",
    "LayerNotFound",
    "LayertapError",
    "NotFound",
    "PermissionDenied",
    "ProtocolError",
    "ResourceExhausted",
    "ServerUnavailable",
    "Unauthenticated",
    "from_rpc_error",
]

#: The ErrorInfo domain of layertap's own error details.
ERROR_DOMAIN = "layertap.dev"

_LAYERS_HINT = "Hint: list layers with client.layers()"
_REASON_PREFIX = "ERROR_REASON_"


def wire_reason(reason: errors_pb2.ErrorReason.ValueType) -> str:
    """The ``ErrorInfo.reason`` string of an ErrorReason, the one place that spells it.

    It is the value's name without the prefix that buf's lint asks of enum
    values: ``ERROR_REASON_LAYER_NOT_FOUND`` travels as ``"LAYER_NOT_FOUND"``.
    """
    return errors_pb2.ErrorReason.Name(reason).removeprefix(_REASON_PREFIX)


#: Every reason the server may send, as on the wire.
REASONS = frozenset(
    wire_reason(v) for v in errors_pb2.ErrorReason.values() if v != errors_pb2.ERROR_REASON_UNSPECIFIED
)


class LayertapError(Exception):
    """Base class of every error the layertap client raises.

    Attributes:
        code: The gRPC status code name, e.g. ``"NOT_FOUND"``; for errors
            raised by the client itself, the code it would have had.
        details: The server's (or the client's) message, unchanged.
        reason: The server's ``ErrorInfo`` reason, e.g. ``"LAYER_NOT_FOUND"``;
            "" when the status carried none (or the client raised the error).
        field: The request field at fault, e.g. ``"spec.reducers[0].histogram.bins"``,
            when the server named one; else None.
        metadata: The server's ``ErrorInfo`` metadata (strings; ``field`` included).
        hint: What the client adds about the likely cause, or "".
    """

    default_code = "UNKNOWN"

    def __init__(
        self,
        details: str,
        *,
        code: str | None = None,
        reason: str = "",
        field: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self.code: str = code if code is not None else self.default_code
        self.details: str = details
        self.reason: str = reason
        self.field: str | None = field
        self.metadata: dict[str, str] = dict(metadata or {})
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
        layer: The name or selector the server did not find.
        suggestions: Close layer names (the server's, or computed with
            ``difflib`` against ``client.layers()``).
    """

    def __init__(
        self,
        details: str,
        *,
        layer: str | None = None,
        suggestions: Sequence[str] = (),
        **status: Any,
    ) -> None:
        self.layer: str | None = layer
        self.suggestions: list[str] = list(suggestions)
        super().__init__(details, **status)

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


class AlreadyExists(LayertapError):
    """Something with this name already exists on the server (e.g. a tap name)."""

    default_code = "ALREADY_EXISTS"


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


class Unauthenticated(LayertapError):
    """The server wants a valid token: none was sent, or it is unknown or expired.

    Pass ``token=`` to :class:`~layertap.Client` or set ``LAYERTAP_TOKEN``.
    """

    default_code = "UNAUTHENTICATED"


class PermissionDenied(LayertapError):
    """The token is valid but lacks the scope this call needs (``.metadata["scope"]``)."""

    default_code = "PERMISSION_DENIED"


class ProtocolError(LayertapError):
    """The server's response broke the wire contract (missing or stray chunks, bad sizes)."""

    default_code = "DATA_LOSS"


class ClientClosed(LayertapError, RuntimeError):
    """The :class:`~layertap.Client` was used after ``close()``."""

    default_code = "CANCELLED"


_BY_CODE: dict[grpc.StatusCode, type[LayertapError]] = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAVAILABLE: ServerUnavailable,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}
#: ErrorInfo reasons that refine their status code into a class of their own.
_BY_REASON: dict[str, type[LayertapError]] = {
    wire_reason(errors_pb2.ERROR_REASON_LAYER_NOT_FOUND): LayerNotFound,
    wire_reason(errors_pb2.ERROR_REASON_CAPTURE_TOO_LARGE): CaptureTooLarge,
}


def _details_of(exc: grpc.RpcError) -> tuple[str, dict[str, str], str | None]:
    """Reads a failed call's ``google.rpc.Status`` details, the one place that does.

    Returns:
        The ErrorInfo reason and metadata (of domain ``layertap.dev``), and the
        field at fault (metadata ``field``, else the first BadRequest
        violation's); "", {} and None where the status carries no details.
    """
    try:
        status: Any = rpc_status.from_call(exc)
    except (AttributeError, TypeError, ValueError):
        status = None  # Not a grpc.Call, or trailers that contradict the status.
    reason, metadata, violations = "", dict[str, str](), list[str]()
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.domain == ERROR_DOMAIN:
                reason, metadata = str(info.reason), {str(k): str(v) for k, v in info.metadata.items()}
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations.extend(str(v.field) for v in bad.field_violations)
    return reason, metadata, metadata.get("field") or next(iter(violations), None)


def _suggest(layer: str | None, layer_names: Callable[[], Sequence[str]] | None) -> list[str]:
    if layer is None or layer_names is None:
        return []
    try:
        candidates = list(layer_names())
    except (LayertapError, grpc.RpcError):
        return []  # Best effort: the original error matters more.
    return difflib.get_close_matches(layer, candidates, n=3, cutoff=0.5)


def from_rpc_error(
    exc: grpc.RpcError, *, layer_names: Callable[[], Sequence[str]] | None = None
) -> LayertapError:
    """Translates a ``grpc.RpcError`` (which is also a ``grpc.Call``).

    Args:
        exc: The error raised by a gRPC stub call or stream iteration.
        layer_names: Optional source of layer names, called only to compute
            suggestions for a LAYER_NOT_FOUND that carries none.

    Returns:
        The matching :class:`LayertapError`; the caller raises it ``from exc``.
    """
    code_fn = getattr(exc, "code", None)
    details_fn = getattr(exc, "details", None)
    code = code_fn() if callable(code_fn) else None
    details = details_fn() if callable(details_fn) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    message = details if isinstance(details, str) else str(exc)
    reason, metadata, field = _details_of(exc)
    cls = _BY_REASON.get(reason) or _BY_CODE.get(code, LayertapError)
    status: dict[str, Any] = {"code": code.name, "reason": reason, "field": field, "metadata": metadata}
    if cls is LayerNotFound:
        layer = metadata.get("layer")
        suggestions = [s for s in metadata.get("suggestions", "").split(",") if s]
        return LayerNotFound(
            message, layer=layer, suggestions=suggestions or _suggest(layer, layer_names), **status
        )
    return cls(message, **status)
