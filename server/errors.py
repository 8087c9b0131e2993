"""Domain errors of the server and their one mapping to gRPC status codes.

Service code raises these; :func:`status_for` is the single place that turns
them into a status code, so every RPC reports errors the same way::

    LayertapServerError
     ├── NotFound              -> NOT_FOUND
     ├── InvalidSpec           -> INVALID_ARGUMENT  (names the offending field)
     ├── LimitExceeded         -> RESOURCE_EXHAUSTED
     ├── Unsupported           -> FAILED_PRECONDITION
     └── Unavailable           -> UNAVAILABLE
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

import grpc


class LayertapServerError(Exception):
    """Base of errors that are reported to the client as a status."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class NotFound(LayertapServerError):
    code = grpc.StatusCode.NOT_FOUND


class InvalidSpec(LayertapServerError):
    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class LimitExceeded(LayertapServerError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unsupported(LayertapServerError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(LayertapServerError):
    code = grpc.StatusCode.UNAVAILABLE


LAYER_HINT = "Hint: list layers with ListLayers / client.layers()"


def close_names(name: str, known: Iterable[str]) -> str:
    """``"; did you mean: a, b?"`` for the names closest to ``name`` (or "")."""
    close = difflib.get_close_matches(name, list(known), n=5, cutoff=0.5)
    return f"; did you mean: {', '.join(close)}?" if close else ""


def unknown_layer(name: str, known: Iterable[str]) -> NotFound:
    """Build the NOT_FOUND error for an unknown layer, with close names."""
    return NotFound(f"unknown layer {name!r}{close_names(name, known)} {LAYER_HINT}")


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Map an exception raised by service code to (status code, details)."""
    if isinstance(exc, LayertapServerError):
        return exc.code, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"


def grpc_errors(method):  # type: ignore[no-untyped-def]
    """Decorate a servicer method: domain errors become a status, once, here.

    Works for unary methods and for server-streaming generators. Unexpected
    exceptions are logged with a traceback and reported as INTERNAL without
    leaking internals (or tensor data) to the client.
    """
    import functools
    import inspect
    import logging

    log = logging.getLogger("layertap.server")

    def fail(exc: BaseException, context: grpc.ServicerContext) -> None:
        code, details = status_for(exc)
        if code == grpc.StatusCode.INTERNAL:
            log.exception("%s failed", method.__qualname__)
        context.abort(code, details)

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
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            if isinstance(exc, grpc.RpcError):
                raise
            fail(exc, context)
    return unary


class AlreadyExists(LayertapServerError):
    code = grpc.StatusCode.ALREADY_EXISTS
