"""``layertap serve`` and ``demo``: their arguments go, verbatim, to the server package.

The server (``layertap[server]``, with torch) is imported only when one of
them runs, so the base install runs every other command and ``layertap
--help`` never loads it. Here they only document themselves.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import Any

from .args import PROG, AddParser

__all__ = ["add_passthrough_commands", "passthrough_args"]

#: Subcommands whose arguments belong to the server package.
_PASSTHROUGH = ("serve", "demo")
_DEMOS = {"drift": "layertap.server.cli.drift_demo"}


def passthrough_args(args: list[str]) -> argparse.Namespace | None:
    """The parsed command line of ``serve`` or ``demo`` (their arguments kept verbatim); None for any other."""
    if not args or args[0] not in _PASSTHROUGH:
        return None
    # argparse would try to parse the server's own options.
    if args[0] == "serve":
        return argparse.Namespace(command="serve", rest=args[1:], func=_cmd_serve)
    return argparse.Namespace(
        command="demo",
        demo=args[1] if len(args) > 1 else None,
        rest=args[2:],
        func=_cmd_demo,
    )


def _server_entry(module: str, what: str) -> Callable[[list[str]], Any] | None:
    try:
        entry: Callable[[list[str]], Any] = getattr(importlib.import_module(module), "main")
    except ImportError as exc:
        print(
            f"{PROG}: {what} needs the server extra: pip install 'layertap[server]' ({exc})",
            file=sys.stderr,
        )
        return None
    return entry


def _cmd_serve(args: argparse.Namespace) -> int:
    serve_main = _server_entry("layertap.server.cli.serve", "serve")
    if serve_main is None:
        return 1
    return int(serve_main(list(args.rest)) or 0)


def _cmd_demo(args: argparse.Namespace) -> int:
    module = _DEMOS.get(args.demo or "")
    if module is None:
        print(f"{PROG}: demo: choose one of: {', '.join(_DEMOS)}", file=sys.stderr)
        return 2
    demo_main = _server_entry(module, f"demo {args.demo}")
    if demo_main is None:
        return 1
    return int(demo_main(list(args.rest)) or 0)


def add_passthrough_commands(add_parser: AddParser) -> None:
    """Register ``serve`` and ``demo`` for ``--help`` (:func:`passthrough_args` parses them before argparse)."""
    p = add_parser(
        "serve",
        help="Run a layertap server (needs layertap[server]); see 'layertap serve --help'.",
        add_help=False,
    )
    p.add_argument("args", nargs=argparse.REMAINDER)
    p = add_parser(
        "demo",
        help="Run a demo against a server, e.g. 'layertap demo drift' (needs layertap[server]).",
        add_help=False,
    )
    p.add_argument("args", nargs=argparse.REMAINDER)
