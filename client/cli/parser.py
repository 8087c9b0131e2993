"""The argparse tree of ``layertap``: one ``add_<name>_command`` per command, in ``--help`` order.

Every command that talks to a server gets its parser from ``command(name,
help)`` (:data:`layertap.cli.args.CommandFactory`), which adds HOST and the
connection flags; its module adds the rest and sets ``func``, the handler
:func:`layertap.cli.main` calls with the parsed arguments.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .._client import DEFAULT_TIMEOUT
from .._version import __version__
from .args import PROG, host, positive_float
from .capture import add_capture_command
from .drift import add_baseline_command, add_drift_command
from .explain import add_explain_command
from .generate import add_generate_command
from .incidents import add_incidents_command
from .infer import add_infer_command
from .listing import add_layers_command, add_stats_command, add_taps_command
from .passthrough import add_passthrough_commands, passthrough_args
from .profile import add_profile_command
from .tensorboard import add_tensorboard_command
from .tokens import add_token_command
from .watch import add_watch_command

__all__ = ["build_parser", "parse_args"]


def build_parser() -> argparse.ArgumentParser:
    """Builds the argument parser (``serve`` and ``demo`` only document themselves here)."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Tap any layer of a served PyTorch model over gRPC."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("host", type=host, metavar="HOST", help="host:port, or a port on 127.0.0.1")
        p.add_argument(
            "--timeout",
            type=positive_float,
            default=DEFAULT_TIMEOUT,
            help=f"deadline of each call in seconds (default {DEFAULT_TIMEOUT:g})",
        )
        p.add_argument("--token", help="bearer token (default: $LAYERTAP_TOKEN)")
        p.add_argument("--tls", action="store_true", help="connect over TLS, trusting the system's roots")
        p.add_argument("--tls-ca", metavar="CA_FILE", help="connect over TLS, trusting this CA bundle")
        return p

    add_layers_command(command)
    add_capture_command(command)
    add_watch_command(command)
    add_baseline_command(command)
    add_drift_command(command)
    add_taps_command(command)
    add_stats_command(command)
    add_infer_command(command)
    add_generate_command(command)
    add_explain_command(command)
    add_profile_command(command)
    add_tensorboard_command(command)
    add_incidents_command(command)
    add_token_command(sub.add_parser)
    add_passthrough_commands(sub.add_parser)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses a command line; ``serve`` and ``demo`` keep their arguments verbatim.

    Raises:
        SystemExit: On a usage error (argparse prints it) or ``--help``.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    passthrough = passthrough_args(args)
    if passthrough is not None:
        return passthrough
    return build_parser().parse_args(args)
