"""``layertap baseline`` and ``drift``: freeze a baseline from live passes, then read the scores against it."""

from __future__ import annotations

import argparse

from .args import CommandFactory, connect, positive_float, positive_int
from .json_lines import add_json_flag, show_rows
from .table import drift_table

__all__ = ["add_baseline_command", "add_drift_command"]


def _cmd_baseline(args: argparse.Namespace) -> int:
    thresholds = {
        key: value
        for key, value in (
            ("psi", args.psi),
            ("js", args.js),
            ("wasserstein", args.wasserstein),
            ("mean_shift", args.mean_shift),
        )
        if value is not None
    }
    with connect(args) as client:
        info = client.set_baseline(
            args.selector,
            passes=args.passes,
            window=args.window,
            point=args.point,
            thresholds=thresholds or None,
            name=args.name,
            derive=args.derive,
        )
    print(f"baseline tap {info.tap}: collecting {args.passes} passes over {len(info.layers)} layer(s)")
    for layer in info.layers:
        print(f"  {layer}")
    return 0


def _cmd_drift(args: argparse.Namespace) -> int:
    with connect(args) as client:
        if args.false_alarm_rate is not None:
            client.baselines.set_false_alarm_rate(args.false_alarm_rate)
        rows = client.drift(args.selector)
    return show_rows(args, rows, lambda width: drift_table(rows, width, f"drift at {args.host}"))


def add_baseline_command(command: CommandFactory) -> None:
    """Register ``baseline`` with the CLI's ``command(name, help)`` factory (which adds HOST and the connection flags)."""
    p = command("baseline", "Freeze a drift baseline from the next N live passes.")
    p.add_argument("selector", metavar="SELECTOR")
    p.add_argument("--passes", type=positive_int, default=500, help="passes in the baseline (default 500: ten windows of 50, enough to calibrate)")
    p.add_argument("--window", type=positive_int, default=50, help="sliding window compared with it (default 50)")
    p.add_argument("--point", default="output")
    p.add_argument("--name", default="", help="the baseline tap's id (default: baseline-<hash of selector and point>)")
    p.add_argument("--derive", default="", choices=("", "entropy", "top1_prob"),
                   help="baseline the per-token softmax entropy or top-1 probability of the tensor's last axis")
    for metric in ("psi", "js", "wasserstein", "mean-shift"):
        p.add_argument(f"--{metric}", type=positive_float,
                       help=f"{metric} threshold; any threshold makes the alarm fixed instead of calibrated")
    p.set_defaults(func=_cmd_baseline)


def add_drift_command(command: CommandFactory) -> None:
    """Register ``drift`` with the CLI's ``command(name, help)`` factory."""
    p = command("drift", "Show current drift scores and alarms against the baselines.")
    p.add_argument("selector", nargs="?", default="", metavar="SELECTOR", help="filter layers")
    p.add_argument("--false-alarm-rate", type=positive_float, default=None, metavar="RATE",
                   help="first set the server's per-window false-alarm rate of calibrated alarms (needs admin)")
    add_json_flag(p)
    p.set_defaults(func=_cmd_drift)
