"""What every command module shares: argument types, the registration factories, the connection.

A command module registers its commands with :func:`layertap.cli.parser.build_parser`
through ``add_<name>_command(command)``, where ``command(name, help)`` is a
:data:`CommandFactory`: it returns the subcommand's parser with HOST and the
connection flags already added, and :func:`connect` opens the client those
flags describe. Commands without a HOST (``token``, ``serve``, ``demo``)
register with the bare ``add_parser`` of the subcommands instead.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from .._channel import normalize_target
from .._client import Client
from .._errors import InvalidArgument

__all__ = [
    "PROG",
    "AddParser",
    "CommandFactory",
    "connect",
    "host",
    "non_negative_int",
    "positive_float",
    "positive_int",
]

PROG = "layertap"

#: ``command(name, help)``: a subcommand's parser with HOST and the connection flags.
CommandFactory = Callable[[str, str], argparse.ArgumentParser]
#: The subcommands' own ``add_parser``, for commands that take no HOST.
AddParser = Callable[..., argparse.ArgumentParser]


def connect(args: argparse.Namespace) -> Client:
    """The client the HOST argument and the connection flags of a command line describe."""
    return Client(args.host, timeout=args.timeout, token=args.token, tls=args.tls_ca or args.tls)


def host(text: str) -> str:
    """``host:port``, or a port on 127.0.0.1, normalized; argparse's usage error otherwise."""
    try:
        return normalize_target(text)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(exc.details) from None


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1, or argparse's usage error naming the bad value."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0 (a seed), or argparse's usage error naming the bad value."""
    return _int_at_least(text, 0)


def positive_float(text: str) -> float:
    """A number > 0 (NaN refused), or argparse's usage error naming the bad value."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value}")
    return value
