"""Who may act on a principal's taps, baselines and incidents: their owner, or a caller with ``admin``."""

from __future__ import annotations

import grpc

from layertap.server.rpc.auth import principal_of, require

__all__ = ["require_owner"]


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
