"""``layertap profile``: the slowest layers of a served model, as torch.profiler prints them.

A stream tap with the ``latency`` reducer times every module over a few live
passes (or passes this command runs from ``--input``). A module's self time
is its total less its tapped children's totals, so the self column adds up to
the model's forward, as in ``torch.profiler``'s ``key_averages().table()``.
"""

from __future__ import annotations

import argparse
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .._client import Client
from .._errors import LayertapError
from .._types import Summary
from .args import CommandFactory, connect, positive_float, positive_int

__all__ = ["LayerTime", "add_profile_command", "layer_times", "profile_table"]

#: Passes one profile times; with the warm-up and the closing pass they stay
#: below the server's default stream queue (256 messages, one per pass).
MAX_PASSES = 200


@dataclass(frozen=True)
class LayerTime:
    """One module's forward time over the profiled passes, in seconds."""

    name: str
    calls: int
    total: float
    self_total: float
    max: float

    @property
    def avg(self) -> float:
        return self.total / self.calls if self.calls else math.nan


def _parent(name: str, timed: set[str]) -> str | None:
    """The nearest timed ancestor of a dotted module name."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in timed:
            return candidate
    return None


def layer_times(summaries: Iterable[Summary]) -> list[LayerTime]:
    """Per-module totals and self times from ``latency`` summaries, slowest self time first."""
    totals: dict[str, list[float]] = {}
    for s in summaries:
        lat = s.results.get("latency")
        if lat is not None and s.output_index == 0 and math.isfinite(getattr(lat, "seconds")):
            totals.setdefault(s.layer, []).append(getattr(lat, "seconds"))
    timed = set(totals)
    children: dict[str, float] = {}
    for name, times in totals.items():
        parent = _parent(name, timed)
        if parent is not None:
            children[parent] = children.get(parent, 0.0) + sum(times)
    out = [LayerTime(name, len(t), sum(t), max(sum(t) - children.get(name, 0.0), 0.0), max(t))
           for name, t in totals.items()]
    return sorted(out, key=lambda r: (-r.self_total, -r.total, r.name))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}ms" if seconds >= 1e-3 else f"{seconds * 1e6:.3f}us"


def profile_table(rows: list[LayerTime], device: str, top: int | None = None) -> str:
    """A plain-text table in torch.profiler's layout; percentages of the summed self time."""
    unit = "CUDA" if device.startswith("cuda") else "CPU"
    whole = sum(r.self_total for r in rows) or math.nan
    header = ["Name", f"Self {unit} %", f"Self {unit}", f"{unit} total %", f"{unit} total", f"{unit} time avg",
              f"{unit} time max", "# of Calls"]
    cells = [[r.name, f"{100 * r.self_total / whole:.2f}%", _ms(r.self_total), f"{100 * r.total / whole:.2f}%",
              _ms(r.total), _ms(r.avg), _ms(r.max), str(r.calls)] for r in rows[:top]]
    widths = [max(len(row[i]) for row in [header, *cells]) + 2 for i in range(len(header))]
    rule = "  ".join("-" * w for w in widths)

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    lines = [rule, line(header), rule, *map(line, cells), rule, f"Self {unit} time total: {_ms(sum(r.self_total for r in rows))}"]
    return "\n".join(lines)


def _collect(client: Client, args: argparse.Namespace) -> list[Summary]:
    """Summaries of ``args.passes`` whole passes: live traffic, or passes run from ``--input``.

    Summaries arrive in pass order, so a pass is whole once the next one shows
    up; one pass more than asked ends the collection. With ``--input`` the
    first pass is a warm-up (first calls allocate) and is not counted.
    """
    x = np.load(args.input, allow_pickle=False) if args.input is not None else None
    got: list[Summary] = []
    passes: list[int] = []
    with client.watch(args.selector, reducers=["latency"], timeout=args.duration) as stream:
        batches = stream.batches()
        first = next(batches, [])  # the server's first message: the stream tap is in place
        skip = 0
        if x is not None:
            skip = 1
            for _ in range(args.passes + 2):  # the server queues them; far below its queue length
                client.infer(x)
        try:
            for batch in itertools.chain([first], batches):
                for s in batch:
                    if not passes or s.pass_index != passes[-1]:
                        passes.append(s.pass_index)
                    if len(passes) > skip + args.passes:
                        return got
                    if len(passes) > skip:
                        got.append(s)
        except LayertapError as exc:
            if exc.code != "DEADLINE_EXCEEDED" or args.duration is None:
                raise  # reaching --duration ends the profile with what came in
    return got


def _cmd_profile(args: argparse.Namespace) -> int:
    with connect(args) as client:
        device = client.metadata().device
        summaries = _collect(client, args)
    rows = layer_times(summaries)
    if not rows:
        print("no latency summaries arrived: send traffic, or pass --input")
        return 1
    print(profile_table(rows, device, args.top))
    return 0


def _passes(text: str) -> int:
    value = positive_int(text)
    if value > MAX_PASSES:
        raise argparse.ArgumentTypeError(f"at most {MAX_PASSES} passes (the server queues {MAX_PASSES + 2} for --input)")
    return value


def add_profile_command(command: CommandFactory) -> None:
    """Register ``profile`` with the CLI's ``command(name, help)`` factory (which adds HOST and the connection flags)."""
    p = command("profile", "Time every module's forward over a few passes; print the slowest, like torch.profiler.")
    p.add_argument("selector", nargs="?", default="**", metavar="SELECTOR", help="modules to time (default: all)")
    p.add_argument("--top", type=positive_int, help="print only the N slowest layers (by self time)")
    p.add_argument("--passes", type=_passes, default=10, help=f"passes to time (default 10, at most {MAX_PASSES})")
    p.add_argument("--input", type=Path, help="run this .npy input for each pass instead of waiting for live traffic")
    p.add_argument("--duration", type=positive_float, help="stop waiting for passes after this many seconds")
    p.set_defaults(func=_cmd_profile)
