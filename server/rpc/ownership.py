"""Who may act on a principal's taps, baselines and incidents: their owner, or a caller with ``admin``."""

from __future__ import annotations

from typing import Any

import grpc

from layertap.server.errors import AlreadyExists, PermissionDenied, echo
from layertap.server.rpc.auth import principal_of, require
from layertap.server.taps.engine import TapEngine
from layertap.server.taps.tap import Tap
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["create_owned", "require_owner"]


def require_owner(context: grpc.ServicerContext, owner: str, doing: str) -> None:
    """PermissionDenied unless ``owner`` is the caller, or the caller has ``admin``.

    Args:
        owner: The owning principal's id (``""``: the server's).
        doing: What the caller is doing, e.g. ``"deleting tap 'x'"``; the message adds whose it is.

    Raises:
        PermissionDenied: Another's, without ``admin`` (metadata ``scope``, ``principal``).
    """
    if owner != principal_of(context).id:
        require(context, "admin", f"{doing} of {owner or 'the server'!r}")


def create_owned(engine: TapEngine, spec: pb.TapSpec, context: grpc.ServicerContext, **kwargs: Any) -> Tap:
    """``engine.create`` of a tap owned by the caller.

    A name that another principal's tap (or the server's) holds is
    PERMISSION_DENIED: it is not the caller's to reuse, and only its owner or
    ``admin`` may delete it, as DeleteTap says. The caller's own name, or any
    name for ``admin``, stays ALREADY_EXISTS: delete it, then create.

    Raises:
        PermissionDenied: Another principal's tap has this name (ErrorInfo ``field``, ``owner``).
        AlreadyExists: The caller's own tap has it (or the caller has ``admin``).
    """
    me = principal_of(context)
    try:
        return engine.create(spec, owner=me.id, **kwargs)
    except AlreadyExists as exc:
        holder = exc.metadata.get("owner", me.id)
        if holder == me.id or me.has("admin"):
            raise
        raise PermissionDenied(f"{exc.field}: the name {echo(spec.name)} is taken by a tap of {holder or 'the server'!r};"
                               " pick another name", field=exc.field,
                               metadata={"owner": holder, "principal": me.id}) from None
