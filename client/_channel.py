"""The client's gRPC channel: plain text or TLS, with the bearer token on every call."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Union

import grpc

from ._errors import InvalidArgument

#: Environment variable the token defaults to.
TOKEN_ENV = "LAYERTAP_TOKEN"

#: ``tls=``: None/False (plain text), True (system roots), a CA bundle path, or credentials.
TlsOption = Union[None, bool, str, os.PathLike[str], grpc.ChannelCredentials]  # a runtime alias: Union works on every supported Python


class _BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer <token>`` to every call's metadata."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), self._header]
        return _Details(details.method, details.timeout, metadata, details.credentials,
                        getattr(details, "wait_for_ready", None), getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


class _Details(grpc.ClientCallDetails):
    def __init__(self, method: str, timeout: Any, metadata: Any, credentials: Any, wait_for_ready: Any,
                 compression: Any) -> None:
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


def credentials(tls: TlsOption) -> grpc.ChannelCredentials | None:
    """Channel credentials for ``tls=`` (None: plain text)."""
    if tls is None or tls is False:
        return None
    if tls is True:
        return grpc.ssl_channel_credentials()
    if isinstance(tls, grpc.ChannelCredentials):
        return tls
    if isinstance(tls, (str, os.PathLike)):
        try:
            return grpc.ssl_channel_credentials(root_certificates=Path(tls).read_bytes())
        except OSError as exc:
            raise InvalidArgument(f"tls: cannot read CA bundle {os.fspath(tls)!r}: {exc.strerror or exc}") from None
    raise InvalidArgument(f"tls: expected True, a CA bundle path or grpc.ChannelCredentials, got {type(tls).__name__}")


def open_channel(target: str, options: Sequence[tuple[str, Any]], token: str | None,
                 tls: TlsOption) -> tuple[grpc.Channel, grpc.Channel]:
    """(the channel to close, the channel to call through).

    ``token`` None reads :data:`TOKEN_ENV`; "" sends none.
    """
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    creds = credentials(tls)
    base = grpc.secure_channel(target, creds, options=list(options)) if creds else grpc.insecure_channel(
        target, options=list(options))
    if not token:
        return base, base
    if any(c in token for c in "\r\n") or token != token.strip():
        raise InvalidArgument("token: must not contain whitespace or line breaks")
    return base, grpc.intercept_channel(base, _BearerToken(token))


def normalize_target(target: str | int) -> str:
    """Turns ``"host:port"``, ``"port"``, ``":port"`` or an int port into a gRPC target.

    A bare port means ``127.0.0.1``, the server's default bind address.
    """
    text = str(target).strip()
    if text.startswith(":"):
        text = text[1:]
    if text.isdigit():
        return f"127.0.0.1:{text}"
    if not text:
        raise InvalidArgument("empty server address; expected host:port or a port")
    return text
