"""Bearer tokens, scopes and the one interceptor that enforces them.

``--auth-tokens FILE`` holds one token per line, in the format of
:mod:`layertap._tokens` (which ``layertap token new`` writes)::

    # id       digest of the token             scopes          expiry (optional, RFC 3339)
    alice      sha256:9f86d08...               infer,read,tap  2027-01-01T00:00:00Z

The file holds digests, never tokens. A request sends ``authorization: Bearer
<token>``; the server hashes it and compares the digest with every entry
(``hmac.compare_digest``). Each method's scope is declared once, in the protos
(``option (layertap.v1.required_scope)``, ``options.proto``), and read here
from the descriptors; a method of a served service without one is refused,
so an RPC added later cannot slip through. Health stays open; reflection
needs any valid token. Without ``--auth-tokens`` no interceptor is installed
and every caller is :data:`ANONYMOUS`, with every scope.
"""

from __future__ import annotations

import contextvars
import hmac
import logging
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.descriptor import MethodDescriptor
from grpc_status import rpc_status
from prometheus_client import CollectorRegistry, Counter

from layertap._tokens import SCOPES, digest, format_line, parse_line, scope_name
from layertap.server.errors import LayertapServerError, PermissionDenied, Unauthenticated, rich_status
from layertap.server.throttled_log import ThrottledLog
from layertap.v1 import inference_pb2, options_pb2, telemetry_pb2

log = logging.getLogger("layertap.server.auth")

#: Services that stay open without a token.
OPEN_SERVICES = frozenset({"grpc.health.v1.Health"})
#: Services that need a valid token but no scope.
ANY_TOKEN_SERVICES = frozenset({"grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection"})
SERVED_SERVICES = (
    inference_pb2.DESCRIPTOR.services_by_name["InferenceService"],
    telemetry_pb2.DESCRIPTOR.services_by_name["TelemetryService"],
)


def required_scope(method: MethodDescriptor) -> str | None:
    """The scope a method's proto declares (``required_scope``), or None when it declares none."""
    scope = method.GetOptions().Extensions[options_pb2.required_scope]
    return scope_name(scope) if scope != options_pb2.SCOPE_UNSPECIFIED else None


def method_scopes() -> dict[str, str | None]:
    """``/pkg.Service/Method`` → scope for every method of the served protos (None: unassigned)."""
    return {f"/{service.full_name}/{m.name}": required_scope(m) for service in SERVED_SERVICES for m in service.methods}


#: Method → scope per service (full names), as the protos declare them; a method without one is left out.
METHOD_SCOPES: dict[str, dict[str, str]] = {
    service.full_name: {m.name: scope for m in service.methods if (scope := required_scope(m)) is not None}
    for service in SERVED_SERVICES
}


class TokenFileError(ValueError):
    """The token file is malformed; the message names the line."""


@dataclass(frozen=True)
class Principal:
    id: str
    scopes: frozenset[str]
    expires: float | None = None  # epoch seconds

    def has(self, scope: str) -> bool:
        return scope in self.scopes


#: Every caller when auth is off: all scopes, including admin.
ANONYMOUS = Principal("anonymous", frozenset(SCOPES))
#: The caller of a call the Authenticator refuses (never anyone's principal).
_REFUSED = Principal("", frozenset())
#: The principal of the call whose handler the interceptors are choosing (see :func:`arriving_principal`).
_ARRIVING: contextvars.ContextVar[Principal] = contextvars.ContextVar("layertap_arriving_principal",
                                                                      default=ANONYMOUS)


def new_token(token_id: str, scopes: Iterable[str]) -> tuple[str, str]:
    """A new random token and the token-file line that admits it."""
    scopes = list(scopes)
    bad = [s for s in scopes if s not in SCOPES]
    if bad or not scopes:
        raise ValueError(f"scopes: expected some of {','.join(SCOPES)}, got {','.join(scopes) or 'none'}")
    token = secrets.token_urlsafe(32)
    return token, format_line(token_id, digest(token), scopes)


def parse_token_file(path: str | Path) -> list[tuple[Principal, str]]:
    """(principal, digest) per entry. Raises TokenFileError naming the line."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise TokenFileError(f"{path}: {exc.strerror or exc}") from None
    entries: list[tuple[Principal, str]] = []
    seen: set[str] = set()
    for n, raw in enumerate(text.splitlines(), 1):
        try:
            entry = parse_line(raw, taken=seen)
        except ValueError as exc:
            raise TokenFileError(f"{path}:{n}: {exc}") from None
        if entry is None:
            continue
        seen.add(entry.id)
        entries.append((Principal(entry.id, entry.scopes, entry.expires), entry.digest))
    return entries


_principals: weakref.WeakKeyDictionary[Any, Principal] = weakref.WeakKeyDictionary()


def principal_of(context: grpc.ServicerContext) -> Principal:
    """The authenticated caller of an RPC (ANONYMOUS when auth is off)."""
    try:
        return _principals.get(context, ANONYMOUS)
    except TypeError:
        return ANONYMOUS


def require(context: grpc.ServicerContext, scope: str, why: str) -> None:
    """Raise PermissionDenied unless the caller has ``scope``."""
    p = principal_of(context)
    if not p.has(scope):
        raise PermissionDenied(f"{why} needs scope {scope!r}; {p.id!r} lacks it",
                               metadata={"scope": scope, "principal": p.id})


class Authenticator(grpc.ServerInterceptor):
    """The token table (reloadable) and the interceptor that checks every call."""

    def __init__(self, path: str, *, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.clock = clock
        self._entries = parse_token_file(path)
        self._lock = threading.Lock()
        self._scopes = method_scopes()
        self._log = ThrottledLog(log)
        self.failures = Counter("layertap_auth_failures_total", "Refused RPCs and scrapes, by reason",
                                ["reason"], registry=CollectorRegistry())

    def register(self, registry: CollectorRegistry) -> None:
        """Count failures on the server's registry (exported on /metrics)."""
        self.failures = Counter("layertap_auth_failures_total", "Refused RPCs and scrapes, by reason",
                                ["reason"], registry=registry)

    def reload(self) -> bool:
        """Re-read the token file; a bad file keeps the old table and logs an error."""
        try:
            entries = parse_token_file(self.path)
        except TokenFileError as exc:
            log.error("--auth-tokens reload failed, keeping the old tokens: %s", exc)
            return False
        with self._lock:
            self._entries = entries
        log.info("--auth-tokens reloaded: %d tokens", len(entries))
        return True

    def authenticate(self, token: str | None) -> tuple[Principal | None, str]:
        """(principal, "") or (None, why)."""
        if not token:
            return None, "missing token"
        dig = digest(token)
        found = None
        with self._lock:
            entries = self._entries
        for principal, d in entries:  # no early exit: same work for every token
            if hmac.compare_digest(d, dig):
                found = principal
        if found is None:
            return None, "unknown token"
        if found.expires is not None and self.clock() >= found.expires:
            return None, f"expired token of {found.id!r}"
        return found, ""

    def check_bearer(self, header: str | None, scope: str) -> tuple[Principal | None, str]:
        """For /metrics: an ``Authorization: Bearer`` header that has ``scope``."""
        token = header[7:].strip() if header and header[:7].lower() == "bearer " else None
        p, why = self.authenticate(token)
        if p is not None and not p.has(scope):
            return None, f"missing scope {scope}"
        return p, why

    def count(self, reason: str, principal: str, method: str, why: str) -> None:
        """Count a refusal on ``layertap_auth_failures_total``; the log gets one line per reason a minute."""
        self.failures.labels(reason=reason).inc()
        self._log.warning(reason, f"auth: refused {method} for {principal}: {why}")

    def _decide(self, method: str, service: str, metadata: Any) -> tuple[Principal, tuple[str, str, str, LayertapServerError] | None]:
        """(the caller, None) or (who, (reason, principal id, why, the refusal))."""
        token = None
        for key, value in metadata or ():
            if key == "authorization" and isinstance(value, str) and value[:7].lower() == "bearer ":
                token = value[7:].strip()
        principal, why = self.authenticate(token)
        if principal is None:
            return _REFUSED, ("UNAUTHENTICATED", "unknown", why, Unauthenticated(
                f"{method}: {why}; send 'authorization: Bearer <token>'", metadata={"method": method}))
        if service not in ANY_TOKEN_SERVICES:
            scope = self._scopes.get(method)
            if scope is None:
                return principal, ("PERMISSION_DENIED", principal.id, "no scope assigned", PermissionDenied(
                    f"{method}: no scope allows this method", metadata={"method": method}))
            if not principal.has(scope):
                return principal, ("PERMISSION_DENIED", principal.id, f"missing scope {scope}", PermissionDenied(
                    f"{method} needs scope {scope!r}; {principal.id!r} lacks it",
                    metadata={"method": method, "scope": scope, "principal": principal.id}))
        return principal, None

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        method: str = handler_call_details.method
        service = method.lstrip("/").split("/", 1)[0]
        if service in OPEN_SERVICES:
            return continuation(handler_call_details)
        # Decided before the interceptors after this one run, so that they know the caller when the call
        # arrives (PrincipalAdmission checks its share then) and take no place for a call refused here.
        principal, refused = self._decide(method, service, handler_call_details.invocation_metadata)
        arriving = _ARRIVING.set(principal if refused is None else _REFUSED)
        try:
            handler = continuation(handler_call_details)
        finally:
            _ARRIVING.reset(arriving)
        if handler is None:
            return None
        if refused is not None:
            reason, who, why, exc = refused
            self.count(reason, who, method, why)
            return _refusal(exc)
        log.debug("auth: %s calls %s", principal.id, method)
        return _bound(handler, principal)


def arriving_principal() -> Principal | None:
    """In an interceptor after :class:`Authenticator`: the caller of the call whose handler is being chosen.

    None when the Authenticator refuses the call (it replaces whatever handler comes back, so no place
    should be taken for it); :data:`ANONYMOUS` when no Authenticator runs (auth off) or for the open
    services.
    """
    p = _ARRIVING.get()
    return None if p is _REFUSED else p


def _wrap(handler: grpc.RpcMethodHandler, behavior: Callable) -> grpc.RpcMethodHandler:  # type: ignore[type-arg]
    kind = ("stream" if handler.request_streaming else "unary") + "_" + ("stream" if handler.response_streaming else "unary")
    make = getattr(grpc, f"{kind}_rpc_method_handler")
    return make(behavior, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def _inner(handler: grpc.RpcMethodHandler) -> Callable:  # type: ignore[type-arg]
    inner = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    assert inner is not None, "a method handler has one behaviour"
    return inner


def _refusal(exc: LayertapServerError) -> grpc.RpcMethodHandler:
    """A handler that ends the call with ``exc`` without reading the request.

    Whatever the method's shape, it is served as a request stream with no
    deserializer that is never iterated: grpc then never receives the
    message, so a caller without a valid token cannot make the server buffer
    and parse up to ``--max-message-bytes`` (256 MiB) per call first; the
    transport's flow-control window bounds what arrives. The client still
    sees only the status, as for any refused call.
    """
    status = rpc_status.to_status(rich_status(exc))

    def abort(_requests: Any, context: grpc.ServicerContext) -> Any:
        context.abort_with_status(status)

    return grpc.stream_stream_rpc_method_handler(abort)


def _bound(handler: grpc.RpcMethodHandler, principal: Principal) -> grpc.RpcMethodHandler:
    inner = _inner(handler)

    def call(request: Any, context: grpc.ServicerContext) -> Any:
        _principals[context] = principal
        return inner(request, context)

    return _wrap(handler, call)
