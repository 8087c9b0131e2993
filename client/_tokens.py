"""The ``--auth-tokens`` line, written and read here only, and the scope names it uses.

One token per line; ``#`` starts a comment::

    # id       digest of the token             scopes          expiry (optional, RFC 3339)
    alice      sha256:9f86d08...               infer,read,tap  2027-01-01T00:00:00Z

A scope is a ``layertap.v1.Scope`` (``proto/layertap/v1/options.proto``),
named in lower case without its prefix. ``layertap token new`` writes a line
with :func:`format_line`; the server (``layertap.server.rpc.auth``) reads its
file with :func:`parse_line`. The line holds the token's digest, never the
token.
"""

from __future__ import annotations

import hashlib
from collections.abc import Container, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone

from .v1 import options_pb2

__all__ = ["SCOPES", "TokenLine", "digest", "format_line", "parse_line", "scope_name"]

_SCOPE_PREFIX = "SCOPE_"
_HEX = frozenset("0123456789abcdef")


def scope_name(scope: options_pb2.Scope.ValueType) -> str:
    """The name a token line gives a scope: ``SCOPE_READ`` -> ``"read"``."""
    return options_pb2.Scope.Name(scope).removeprefix(_SCOPE_PREFIX).lower()


#: Every scope's name, in the order of the enum (and of every message that lists them).
SCOPES: tuple[str, ...] = tuple(scope_name(v) for v in options_pb2.Scope.values() if v != options_pb2.SCOPE_UNSPECIFIED)


@dataclass(frozen=True)
class TokenLine:
    """One entry of a token file."""

    id: str
    digest: str  # "sha256:" and 64 lowercase hex digits
    scopes: frozenset[str]
    expires: float | None  # epoch seconds


def digest(token: str) -> str:
    """``sha256:<hex>`` of a token, as a token line holds it."""
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


def format_line(token_id: str, token_digest: str, scopes: Iterable[str], expires: str | None = None) -> str:
    """The line that admits a token: ``id sha256:<hex> scope,scope [expiry]``."""
    line = f"{token_id} {token_digest} {','.join(scopes)}"
    return f"{line} {expires}" if expires else line


def _parse_expiry(text: str) -> float:
    when = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    if when.tzinfo is None:
        raise ValueError("expiry needs a time zone (e.g. Z)")
    return when.astimezone(timezone.utc).timestamp()


def parse_line(raw: str, taken: Container[str] = ()) -> TokenLine | None:
    """Reads one line of a token file.

    Args:
        taken: Ids of the file's earlier lines: a second one is refused (after the
            digest and scopes are checked, before the expiry, as the server always has).

    Returns:
        The entry, or None for a blank or comment-only line.

    Raises:
        ValueError: The line is malformed; the message says how (the caller
            names the file and line).
    """
    line = raw.split("#", 1)[0].strip()
    if not line:
        return None
    parts = line.split()
    if len(parts) not in (3, 4):
        raise ValueError(f"expected 'id sha256:<hex> scope,scope [expiry]', got {len(parts)} fields")
    tid, dig, scope_text = parts[:3]
    algo, _, hexd = dig.partition(":")
    if algo != "sha256" or len(hexd) != 64 or not set(hexd.lower()) <= _HEX:
        raise ValueError("digest must be sha256:<64 hex digits> (the token's digest, not the token)")
    scopes = [s for s in scope_text.split(",") if s]
    if not scopes or any(s not in SCOPES for s in scopes):
        raise ValueError(f"scopes must be some of {','.join(SCOPES)}, got {scope_text!r}")
    if tid in taken:
        raise ValueError(f"token id {tid!r} appears twice")
    expires = None
    if len(parts) == 4:
        try:
            expires = _parse_expiry(parts[3])
        except ValueError as exc:
            raise ValueError(f"expiry {parts[3]!r} is not RFC 3339: {exc}") from None
    return TokenLine(tid, f"sha256:{hexd.lower()}", frozenset(scopes), expires)
