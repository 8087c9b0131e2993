"""How ``layertap watch`` shows a stream: a live table on a terminal, lines elsewhere.

A live table redraws in place, which a pipe or a file cannot show: a reader
downstream would get nothing until the end, and then only the last frame. So
when stdout is not a terminal (or ``--json`` asks for it) each summary is one
flushed line, and ``--count N`` means exactly N lines.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from rich.console import Console
from rich.live import Live

from ._cli_json import write_json_lines
from ._cli_view import SPARK_WIDTH, WatchRow, update_row, watch_line, watch_table
from ._taps import SummaryStream
from ._types import Summary, TapEvent

__all__ = ["WatchOptions", "run_watch"]

PROG = "layertap"


@dataclass(frozen=True)
class WatchOptions:
    """What the command line asked of ``watch``."""

    title: str
    count: int | None = None
    duration: float | None = None
    json: bool = False


class _Budget:
    """Stops after ``count`` summaries or ``duration`` seconds, whichever comes first."""

    def __init__(self, options: WatchOptions) -> None:
        self.left = options.count
        self._deadline = None if options.duration is None else time.monotonic() + options.duration

    def take(self, batch: list[Summary]) -> list[Summary]:
        if self.left is None:
            return batch
        taken = batch[: self.left]
        self.left -= len(taken)
        return taken

    @property
    def spent(self) -> bool:
        return self.left == 0 or (self._deadline is not None and time.monotonic() >= self._deadline)


def run_watch(stream: SummaryStream, options: WatchOptions) -> None:
    """Shows ``stream`` until the budget is spent or the stream ends.

    Raises:
        LayertapError: From the stream, e.g. ``DEADLINE_EXCEEDED`` at ``--duration``.
    """
    batches = stream.batches()
    # The server's first message says whether the stream tap was accepted: an
    # error surfaces here, on its own line, before any output starts.
    first = next(batches, [])
    chained = itertools.chain([first], batches)
    if options.json or not sys.stdout.isatty():
        try:
            _lines(stream, chained, options)
        finally:
            if stream.dropped:
                print(f"{PROG}: the server dropped {stream.dropped} messages for this slow reader", file=sys.stderr)
    else:
        _live(stream, chained, options)


def _lines(stream: SummaryStream, batches: Iterator[list[Summary]], options: WatchOptions) -> None:
    budget = _Budget(options)
    last_event: TapEvent | None = None
    for batch in batches:
        if stream.events and stream.events[-1] is not last_event:
            last_event = stream.events[-1]
            print(f"{PROG}: {last_event.kind} {last_event.tap}: {last_event.message}", file=sys.stderr, flush=True)
        taken = budget.take(batch)
        if options.json:
            write_json_lines(taken)
        else:
            for summary in taken:
                print(watch_line(summary), flush=True)
        if budget.spent:
            return


def _live(stream: SummaryStream, batches: Iterator[list[Summary]], options: WatchOptions) -> None:
    rows: dict[tuple[str, int], WatchRow] = {}
    console = Console()
    budget = _Budget(options)
    # Wide terminals get a longer sparkline; on narrow ones it gives way first.
    spark_width = SPARK_WIDTH if console.width >= 100 else 12
    with Live(watch_table(options.title, rows, 0, (), spark_width, console.width), console=console,
              refresh_per_second=4) as live:
        for batch in batches:
            for summary in budget.take(batch):
                update_row(rows, summary)
            live.update(watch_table(options.title, rows, stream.dropped, stream.events, spark_width, console.width))
            if budget.spent:
                return
