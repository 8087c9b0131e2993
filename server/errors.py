"""Domain errors of the server and their one mapping to gRPC statuses.

Service code raises these; :func:`status_for` and :func:`rich_status` are the
single place that turns them into a status, so every RPC reports errors the
same way::

    LayertapServerError      status code / ErrorInfo reason
     ├── NotFound            NOT_FOUND
     │   └── LayerNotFound   NOT_FOUND / LAYER_NOT_FOUND
     ├── InvalidField        INVALID_ARGUMENT  (names the offending field)
     ├── Unauthenticated     UNAUTHENTICATED
     ├── PermissionDenied    PERMISSION_DENIED
     ├── AlreadyExists       ALREADY_EXISTS
     ├── LimitExceeded       RESOURCE_EXHAUSTED (/ CAPTURE_TOO_LARGE over the byte cap,
     │                       CAPTURE_BUDGET_EXHAUSTED, CAPTURE_OUT_OF_MEMORY)
     ├── DeadlineExceeded    DEADLINE_EXCEEDED (the server stopped waiting, e.g. for traffic)
     ├── Unsupported         FAILED_PRECONDITION
     └── Unavailable         UNAVAILABLE
    anything else            INTERNAL

The reason is the status code's name unless shown otherwise. Reasons are
declared once, as ``layertap.v1.ErrorReason`` (``errors.proto``), and spelled
on the wire by ``layertap._errors.wire_reason``, which the client reads with.

Besides the code and message, every error status carries a ``google.rpc.Status``
(grpcio-status, the ``grpc-status-details-bin`` trailer) so clients in any
language read the cause as data, not message text:

* ``ErrorInfo``: ``domain`` ``"layertap.dev"``; ``reason`` as above; metadata
  ``field`` (the request field at fault, when known), ``layer`` and
  ``suggestions`` (comma-separated close names) for LAYER_NOT_FOUND, and
  ``max_bytes`` for CAPTURE_TOO_LARGE (and an over-cap Infer request).
* ``BadRequest``: for INVALID_ARGUMENT, one ``FieldViolation(field, description)``.

The message is unchanged by the details: it still names the field.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import logging
from collections.abc import Iterable, Mapping

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from layertap._errors import wire_reason
from layertap.v1.errors_pb2 import ErrorReason

#: The ErrorInfo domain of layertap's error details.
DOMAIN = "layertap.dev"
#: The reason of a capture over the server's byte cap (a LimitExceeded).
CAPTURE_TOO_LARGE = wire_reason(ErrorReason.ERROR_REASON_CAPTURE_TOO_LARGE)
#: The reason of a capture refused because all captures' clones fill ``--capture-budget-bytes``.
CAPTURE_BUDGET_EXHAUSTED = wire_reason(ErrorReason.ERROR_REASON_CAPTURE_BUDGET_EXHAUSTED)
#: The reason of a capture whose device copy ran out of memory (the model's pass was unaffected).
CAPTURE_OUT_OF_MEMORY = wire_reason(ErrorReason.ERROR_REASON_CAPTURE_OUT_OF_MEMORY)


class LayertapServerError(Exception):
    """Base of errors that are reported to the client as a status.

    Args:
        message: The status message.
        reason: Overrides the class's ErrorInfo reason (e.g. CAPTURE_TOO_LARGE): an
            ErrorReason as :func:`~layertap._errors.wire_reason` spells it.
        field: The request field at fault, when known.
        metadata: More ErrorInfo metadata (string values).
    """

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    reason = wire_reason(ErrorReason.ERROR_REASON_INTERNAL)

    def __init__(
        self, message: str, *, reason: str | None = None, field: str = "", metadata: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason
        self.field = field
        self.metadata = dict(metadata or {})

    def error_info(self) -> error_details_pb2.ErrorInfo:
        metadata = {"field": self.field, **self.metadata} if self.field else dict(self.metadata)
        return error_details_pb2.ErrorInfo(reason=self.reason, domain=DOMAIN, metadata=metadata)


class NotFound(LayertapServerError):
    code = grpc.StatusCode.NOT_FOUND
    reason = wire_reason(ErrorReason.ERROR_REASON_NOT_FOUND)


class LayerNotFound(NotFound):
    """No module has this name, or no module matches this selector."""

    reason = wire_reason(ErrorReason.ERROR_REASON_LAYER_NOT_FOUND)

    def __init__(self, message: str, *, layer: str, suggestions: Iterable[str] = (), field: str = "") -> None:
        metadata = {"layer": layer}
        if close := ",".join(suggestions):
            metadata["suggestions"] = close
        super().__init__(message, field=field, metadata=metadata)


class InvalidField(LayertapServerError):
    """A request field is invalid: the message starts with the field's path (``spec.sampling.every``),
    ErrorInfo carries it as ``field``, and BadRequest as the violation's field."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = wire_reason(ErrorReason.ERROR_REASON_INVALID_ARGUMENT)

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}", field=field)
        self.description = message


class Unauthenticated(LayertapServerError):
    """No token, an unknown one, or an expired one."""

    code = grpc.StatusCode.UNAUTHENTICATED
    reason = wire_reason(ErrorReason.ERROR_REASON_UNAUTHENTICATED)


class PermissionDenied(LayertapServerError):
    """A valid token without the scope the method (or the tap's owner) needs."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = wire_reason(ErrorReason.ERROR_REASON_PERMISSION_DENIED)


class AlreadyExists(LayertapServerError):
    code = grpc.StatusCode.ALREADY_EXISTS
    reason = wire_reason(ErrorReason.ERROR_REASON_ALREADY_EXISTS)


class LimitExceeded(LayertapServerError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = wire_reason(ErrorReason.ERROR_REASON_RESOURCE_EXHAUSTED)


class DeadlineExceeded(LayertapServerError):
    """The server stopped waiting (a passive capture that saw no traffic), not the client's deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = wire_reason(ErrorReason.ERROR_REASON_DEADLINE_EXCEEDED)


class Unsupported(LayertapServerError):
    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = wire_reason(ErrorReason.ERROR_REASON_FAILED_PRECONDITION)


class Unavailable(LayertapServerError):
    code = grpc.StatusCode.UNAVAILABLE
    reason = wire_reason(ErrorReason.ERROR_REASON_UNAVAILABLE)


class NonfiniteLogits(LayertapServerError):
    """The model's logits held NaN or infinity: no token can be chosen (a model fault, not the input's)."""

    code = grpc.StatusCode.INTERNAL
    reason = wire_reason(ErrorReason.ERROR_REASON_NONFINITE_LOGITS)


LAYER_HINT = "Hint: list layers with ListLayers / client.layers()"
#: Longest status message sent (see ``status_for``).
MAX_MESSAGE_CHARS = 1024
#: Longest excerpt of client input echoed back in an error message.
ECHO_CHARS = 80


def echo(text: str) -> str:
    """``repr`` of client input for an error message, cut to ``ECHO_CHARS``.

    A message must not grow with a hostile input (a 4 MB name echoed whole).
    """
    if len(text) <= ECHO_CHARS:
        return repr(text)
    return f"{text[:ECHO_CHARS]!r}... ({len(text)} chars)"


def _suggest(name: str, known: Iterable[str]) -> tuple[list[str], str]:
    """The names closest to ``name``, and ``"; did you mean: a, b?"`` for them (or "")."""
    close = difflib.get_close_matches(name, list(known), n=5, cutoff=0.5)
    return close, f"; did you mean: {', '.join(close)}?" if close else ""


def unknown_layer(name: str, known: Iterable[str], field: str = "") -> LayerNotFound:
    """Build the NOT_FOUND error for an unknown layer, with close names."""
    close, hint = _suggest(name, known)
    return LayerNotFound(f"unknown layer {echo(name)}{hint} {LAYER_HINT}", layer=name[:ECHO_CHARS],
                         suggestions=close, field=field)


def no_layer_matches(selector: str, probe: str, known: Iterable[str], field: str = "selector") -> LayerNotFound:
    """Build the NOT_FOUND error for a pattern selector that matches no layer.

    ``probe`` is the selector without its pattern syntax, to find close names.
    """
    close, hint = _suggest(probe, known)
    return LayerNotFound(
        f"selector {echo(selector)} matches no layer{hint} {LAYER_HINT}", layer=selector[:ECHO_CHARS],
        suggestions=close, field=field
    )


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Map an exception raised by service code to (status code, details)."""
    if isinstance(exc, LayertapServerError):
        # Bounded whatever the input: the message travels twice in trailers
        # (grpc-message and the Status detail), which gRPC caps at 8 KiB.
        return exc.code, str(exc)[:MAX_MESSAGE_CHARS]
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"


def _packed(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def rich_status(exc: BaseException) -> status_pb2.Status:
    """The ``google.rpc.Status`` of an exception: code, message and details (see the module doc)."""
    code, message = status_for(exc)
    if not isinstance(exc, LayertapServerError):
        exc = LayertapServerError(message)
    details = [_packed(exc.error_info())]
    if isinstance(exc, InvalidField):
        violation = error_details_pb2.BadRequest.FieldViolation(field=exc.field, description=exc.description)
        details.append(_packed(error_details_pb2.BadRequest(field_violations=[violation])))
    return status_pb2.Status(code=code.value[0], message=message, details=details)


def grpc_errors(method):  # type: ignore[no-untyped-def]
    """Decorate a servicer method: domain errors become a status, once, here.

    Works for unary methods and for server-streaming generators. Unexpected
    exceptions are logged with a traceback and reported as INTERNAL without
    leaking internals (or tensor data) to the client.
    """
    log = logging.getLogger("layertap.server")

    def fail(exc: BaseException, context: grpc.ServicerContext) -> None:
        status = rich_status(exc)
        if status.code == grpc.StatusCode.INTERNAL.value[0]:
            log.exception("%s failed", method.__qualname__)
        context.abort_with_status(rpc_status.to_status(status))

    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def stream(self, request, context):  # type: ignore[no-untyped-def]
            try:
                yield from method(self, request, context)
            except Exception as exc:  # noqa: BLE001 - mapped to a status
                if isinstance(exc, grpc.RpcError) or not context.is_active():
                    return
                fail(exc, context)
        return stream

    @functools.wraps(method)
    def unary(self, request, context):  # type: ignore[no-untyped-def]
        try:
            return method(self, request, context)
        except Exception as exc:  # mapped to a status
            if isinstance(exc, grpc.RpcError):
                raise
            fail(exc, context)
    return unary
