"""How ``layertap watch`` and ``capture`` draw: the live table, its lines, progress.

Rendering only (rich); :mod:`layertap.cli.watch` and :mod:`layertap.cli.capture`
parse arguments and talk to the server. The one-shot tables live in
:mod:`layertap.cli.table`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from .._types import Summary, TapEvent
from .table import Column, fit_table

__all__ = ["CaptureProgress", "SPARK_WIDTH", "WatchRow", "sparkline", "update_row", "watch_line", "watch_table"]

#: Captures at least this large get a progress bar.
PROGRESS_MIN_BYTES = 8 << 20
SPARK_CHARS = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 30


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}"


def sparkline(values: Sequence[float], width: int = SPARK_WIDTH) -> str:
    """Renders the last ``width`` values as unicode block characters.

    Non-finite values show as spaces; a flat series sits mid-height.
    """
    tail = list(values)[-width:]
    finite = [v for v in tail if math.isfinite(v)]
    if not finite:
        return " " * len(tail)
    lo, hi = min(finite), max(finite)
    top = len(SPARK_CHARS) - 1
    out = []
    for v in tail:
        if not math.isfinite(v):
            out.append(" ")
        elif hi == lo:
            out.append(SPARK_CHARS[top // 2])
        else:
            out.append(SPARK_CHARS[round((v - lo) / (hi - lo) * top)])
    return "".join(out)


class CaptureProgress:
    """Progress callback that shows a bar once a capture turns out to be large."""

    def __init__(self, console: Console) -> None:
        self._console = console
        self._progress: Progress | None = None
        self._task: Any = None

    def __call__(self, received: int, total: int) -> None:
        if self._progress is None:
            if total < PROGRESS_MIN_BYTES:
                return
            self._progress = Progress(
                TextColumn("capture"),
                BarColumn(),
                DownloadColumn(binary_units=True),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=self._console,
                transient=True,
            )
            self._progress.start()
            self._task = self._progress.add_task("capture", total=total)
        self._progress.update(self._task, completed=received, total=total)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


@dataclass
class WatchRow:
    summary: Summary
    means: deque[float] = field(default_factory=lambda: deque(maxlen=SPARK_WIDTH))
    nan: int = 0
    inf: int = 0
    stats: dict[str, float] = field(default_factory=dict)


def _result(reducer: str, attr: str, scale: float = 1.0) -> Callable[[Summary], float | None]:
    def read(s: Summary) -> float | None:
        result = s.results.get(reducer)
        return None if result is None else float(getattr(result, attr)) * scale
    return read


def _median(s: Summary) -> float | None:
    q = s.results.get("quantiles")
    if q is None:
        return None
    probs, values = getattr(q, "probabilities"), getattr(q, "values")
    return next((float(v) for p, v in zip(probs, values) if abs(p - 0.5) < 1e-9), None)


#: Every statistic the watch view shows: key (the line's ``key=``), table header,
#: drop rank (lower drops first when the terminal is narrow), and its reader.
#: A table shows the columns of the statistics some row has.
_STATS: tuple[tuple[str, str, int, Callable[[Summary], float | None]], ...] = (
    ("mean", "mean", 6, _result("moments", "mean")),
    ("std", "std", 2, _result("moments", "std")),
    ("min", "min", 4, _result("minmax", "min")),
    ("max", "max", 5, _result("minmax", "max")),
    ("absmax", "|max|", 1, _result("abs_max", "value")),
    ("zero", "zero", 1, _result("zero_fraction", "fraction")),
    ("l2", "l2", 1, _result("norm", "l2")),
    ("p50", "p50", 1, _median),
    ("ms", "ms", 7, _result("latency", "seconds", 1e3)),
)
#: Columns every table has, whatever the taps compute.
_ALWAYS = frozenset({"mean", "std", "min", "max", "ms"})


def _watch_columns(spark_width: int, stats: Sequence[tuple[str, str, int]]) -> tuple[Column, ...]:
    return (
        Column("layer"),
        Column("pass", "right", drop=1),
        *(Column(header, "right", drop=rank) for _key, header, rank in stats),
        Column("nan", "right"),
        Column("inf", "right", drop=3),
        Column(f"mean (last {spark_width})", drop=0),
    )


def _row_name(layer: str, output_index: int) -> str:
    return layer if output_index == 0 else f"{layer}[{output_index}]"


def watch_table(
    title: str,
    rows: dict[tuple[str, int], WatchRow],
    dropped: int,
    events: Sequence[TapEvent],
    spark_width: int,
    width: int,
) -> Table:
    """The live view: one row per tensor, fitted to ``width`` (the sparkline gives way first)."""
    shown = [(key, header, rank) for key, header, rank, _ in _STATS
             if key in _ALWAYS or any(key in row.stats for row in rows.values())]
    cells = [
        (
            escape(_row_name(layer, index)),
            str(row.summary.pass_index),
            *(_fmt(row.stats.get(key)) for key, _, _ in shown),
            f"[bold red]{row.nan}[/]" if row.nan else "0",
            f"[bold red]{row.inf}[/]" if row.inf else "0",
            sparkline(row.means, spark_width),
        )
        for (layer, index), row in sorted(rows.items())
    ]
    return fit_table(
        _watch_columns(spark_width, shown), cells, width, title=escape(title), caption=_watch_caption(dropped, events)
    )


def watch_line(s: Summary) -> str:
    """One summary as one plain ``key=value`` line, for a pipe or a log.

    Unsampled passes (only the always-on NaN/Inf counter ran) say so instead
    of repeating stale statistics.
    """
    parts = [_row_name(s.layer, s.output_index), f"pass={s.pass_index}"]
    if s.phase:  # a generation's pass (Client.generate)
        parts.append(f"phase={s.phase}" if s.position is None else f"phase={s.phase} pos={s.position}")
    if s.unsampled:
        parts.append("unsampled")
    else:
        parts += [f"{key}={_fmt(value)}" for key, _, _, read in _STATS if (value := read(s)) is not None]
    nonfinite = s.results.get("nonfinite")
    if nonfinite is not None:
        parts += [f"nan={getattr(nonfinite, 'nan_count')}", f"inf={getattr(nonfinite, 'inf_count')}"]
    return " ".join(parts)


def _watch_caption(dropped: int, events: Sequence[TapEvent]) -> str:
    parts = [f"dropped {dropped}"]
    if events:
        last = events[-1]
        parts.append(f"[yellow]{escape(last.kind)}[/] {escape(last.tap)}: {escape(last.message)}")
    return " · ".join(parts)


def update_row(rows: dict[tuple[str, int], WatchRow], s: Summary) -> None:
    row = rows.setdefault((s.layer, s.output_index), WatchRow(summary=s))
    row.summary = s
    nonfinite = s.results.get("nonfinite")
    if nonfinite is not None:
        row.nan += getattr(nonfinite, "nan_count", 0)
        row.inf += getattr(nonfinite, "inf_count", 0)
    if s.unsampled:
        return  # Only the always-on NaN counter ran on this pass.
    for key, _, _, read in _STATS:
        value = read(s)
        if value is not None:
            row.stats[key] = value
    if s.results.get("moments") is not None:
        row.means.append(row.stats["mean"])
