"""``layertap layers``, ``taps`` and ``stats``: what the server holds, as a table or ``--json`` lines."""

from __future__ import annotations

import argparse

from .args import CommandFactory, connect
from .json_lines import add_json_flag, show_rows
from .table import layers_table, stats_table, taps_table

__all__ = ["add_layers_command", "add_stats_command", "add_taps_command"]


def _cmd_layers(args: argparse.Namespace) -> int:
    with connect(args) as client:
        layers = client.layers()
    return show_rows(args, layers, lambda width: layers_table(layers, width, f"{len(layers)} layers at {args.host}"))


def _cmd_taps(args: argparse.Namespace) -> int:
    with connect(args) as client:
        taps = client.taps()
    return show_rows(args, taps, lambda width: taps_table(taps, width, f"{len(taps)} taps at {args.host}"))


def _cmd_stats(args: argparse.Namespace) -> int:
    with connect(args) as client:
        stats = client.stats()
    return show_rows(args, [stats], lambda _width: stats_table(stats, f"server stats at {args.host}"))


def add_layers_command(command: CommandFactory) -> None:
    """Register ``layers`` with the CLI's ``command(name, help)`` factory (which adds HOST and the connection flags)."""
    p = command("layers", "List the model's modules with types, parameters and last shapes.")
    add_json_flag(p)
    p.set_defaults(func=_cmd_layers)


def add_taps_command(command: CommandFactory) -> None:
    """Register ``taps`` with the CLI's ``command(name, help)`` factory."""
    p = command("taps", "List durable and stream taps with their counters.")
    add_json_flag(p)
    p.set_defaults(func=_cmd_taps)


def add_stats_command(command: CommandFactory) -> None:
    """Register ``stats`` with the CLI's ``command(name, help)`` factory."""
    p = command("stats", "Show the server's counters (hooks, passes, captures, subscribers).")
    add_json_flag(p)
    p.set_defaults(func=_cmd_stats)
