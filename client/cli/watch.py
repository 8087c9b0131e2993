"""``layertap watch``: a stream tap's summaries, as a live table on a terminal and lines elsewhere.

A live table redraws in place, which a pipe or a file cannot show: a reader
downstream would get nothing until the end, and then only the last frame. So
when stdout is not a terminal (or ``--json`` asks for it) each summary is one
flushed line, and ``--count N`` means exactly N lines.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from rich.console import Console
from rich.live import Live

from .._errors import LayertapError
from .._taps import SummaryStream
from .._types import DEFAULT_REDUCERS, Summary, TapEvent
from .args import PROG, CommandFactory, connect, positive_float, positive_int
from .json_lines import add_json_flag, write_json_lines
from .view import SPARK_WIDTH, WatchRow, update_row, watch_line, watch_table

__all__ = ["WatchOptions", "add_watch_command", "run_watch"]


def _reducer_list(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected a comma-separated list of reducers")
    return names


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


def _cmd_watch(args: argparse.Namespace) -> int:
    with connect(args) as client, client.watch(
        args.selector,
        reducers=args.reducers,
        every=args.every,
        point=args.point,
        keep_padding=args.keep_padding or None,
        derive=args.derive or None,
        queue_size=args.queue_size,
        timeout=args.duration,
    ) as stream:
        try:
            run_watch(stream, WatchOptions(
                title=f"{args.selector} @ {args.host} ({','.join(args.reducers)})",
                count=args.count,
                duration=args.duration,
                json=args.json,
            ))
        except LayertapError as exc:
            if exc.code != "DEADLINE_EXCEEDED" or args.duration is None:
                raise  # Reaching --duration is the normal end.
        except KeyboardInterrupt:
            pass
    return 0


def add_watch_command(command: CommandFactory) -> None:
    """Register ``watch`` with the CLI's ``command(name, help)`` factory (which adds HOST and the connection flags)."""
    p = command(
        "watch",
        "Live table of summaries from a stream tap (Ctrl-C to stop); "
        "one line per summary when stdout is not a terminal.",
    )
    add_json_flag(p)
    p.add_argument("selector", metavar="SELECTOR", help="module name, glob ('layer*') or re:regex")
    p.add_argument(
        "--reducers",
        type=_reducer_list,
        default=list(DEFAULT_REDUCERS),
        help=f"comma-separated reducers (default {','.join(DEFAULT_REDUCERS)})",
    )
    p.add_argument("--every", type=positive_int, help="summarize every N-th pass")
    p.add_argument("--point", default="output", help="output, input, grad_output, grad_input, param_grad")
    p.add_argument("--keep-padding", action="store_true",
                   help="keep the positions an attention_mask marks as padding in the statistics "
                        "(default: left out for (batch, tokens, ...) tensors)")
    p.add_argument("--derive", default="", choices=("", "entropy", "top1_prob"),
                   help="reduce the per-row softmax entropy or top-1 probability of the tensor's last axis")
    p.add_argument("--queue-size", type=positive_int, help="server-side queue length")
    p.add_argument("--count", type=positive_int, help="stop after this many summaries")
    p.add_argument("--duration", type=positive_float, help="stop after this many seconds")
    p.set_defaults(func=_cmd_watch)
