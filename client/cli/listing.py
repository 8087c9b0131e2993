"""``layertap layers``, ``taps`` and ``stats``: what the server holds, as a table or ``--json`` lines."""

from __future__ import annotations

import argparse

from rich.console import Console

from .args import CommandFactory, connect
from .json_lines import add_json_flag, write_json_lines
from .table import layers_table, stats_table, taps_table

__all__ = ["add_layers_command", "add_stats_command", "add_taps_command"]


def _cmd_layers(args: argparse.Namespace) -> int:
    with connect(args) as client:
        layers = client.layers()
    if args.json:
        write_json_lines(layers)
        return 0
    console = Console()
    console.print(layers_table(layers, console.width, f"{len(layers)} layers at {args.host}"))
    return 0


def _cmd_taps(args: argparse.Namespace) -> int:
    with connect(args) as client:
        taps = client.taps()
    if args.json:
        write_json_lines(taps)
        return 0
    console = Console()
    console.print(taps_table(taps, console.width, f"{len(taps)} taps at {args.host}"))
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    with connect(args) as client:
        stats = client.stats()
    if args.json:
        write_json_lines([stats])
        return 0
    Console().print(stats_table(stats, f"server stats at {args.host}"))
    return 0


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
