"""``layertap token new``: a random bearer token, and the line that admits it to ``serve --auth-tokens``."""

from __future__ import annotations

import argparse
import secrets
import sys

from .._tokens import SCOPES, digest, format_line
from .args import PROG, AddParser

__all__ = ["add_token_command"]


def _cmd_token_new(args: argparse.Namespace) -> int:
    """The token goes to stdout once; only its digest goes into the server's file."""
    scopes = [part.strip() for part in args.scopes.split(",") if part.strip()]
    bad = [scope for scope in scopes if scope not in SCOPES]
    if bad or not scopes or not args.id or any(c.isspace() or c == "#" for c in args.id):
        print(f"{PROG}: token new: --id must be one word; --scopes some of {','.join(SCOPES)}", file=sys.stderr)
        return 2
    token = secrets.token_urlsafe(32)
    line = format_line(args.id, digest(token), scopes, args.expires)
    print(f"token: {token}")
    print(f"add this line to the --auth-tokens file (then send SIGHUP to the server):\n{line}")
    return 0


def add_token_command(add_parser: AddParser) -> None:
    """Register ``token`` (no HOST: it never calls a server) with the subcommands' ``add_parser``."""
    p = add_parser("token", help="Manage access tokens for 'layertap serve --auth-tokens'.")
    tok = p.add_subparsers(dest="token_command", metavar="ACTION", required=True)
    p = tok.add_parser("new", help="Print a new random token and the token-file line that admits it.")
    p.add_argument("--id", required=True, help="the token's id: the principal named in logs and tap owners")
    p.add_argument("--scopes", required=True, help=f"comma-separated: {','.join(SCOPES)}")
    p.add_argument("--expires", help="RFC 3339 expiry, e.g. 2027-01-01T00:00:00Z")
    p.set_defaults(func=_cmd_token_new)
