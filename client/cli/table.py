"""Tables that fit the terminal: the other columns give way so names stay whole.

Users copy layer names and tap ids out of these tables into selectors, so such
a column is never cut. On a narrow terminal the other columns give way in the
order each declares: cut to a narrower width (with an ellipsis), then dropped.
Rows never wrap, so one row is one line for ``grep`` and the eye.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.cells import cell_len
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from .._types import LayerDrift, LayerInfo, ServerStats, TapInfo

__all__ = ["Column", "drift_table", "fit_table", "layers_table", "shape_text", "stats_table", "taps_table"]

_RIGHT = "right"


@dataclass(frozen=True)
class Column:
    """One column and how it gives way when the table is too wide.

    Steps of all columns run in rank order, lowest first, until the table fits.
    A column with neither ``drop`` nor ``shrink`` always keeps its full width.

    Attributes:
        header: The column's title.
        justify: ``"left"`` or ``"right"``.
        drop: The rank at which the column is dropped (None: never).
        shrink: ``(rank, width)``: at that rank the column is cut to ``width`` cells.
    """

    header: str
    justify: str = "left"
    drop: int | None = None
    shrink: tuple[int, int] | None = None

    @property
    def keeps_width(self) -> bool:
        return self.drop is None and self.shrink is None


def _table_width(widths: Sequence[int]) -> int:
    # The default box with padding (0, 1): two padding cells and one rule per
    # column, plus the closing rule.
    return sum(widths) + 3 * len(widths) + 1


def fit_table(
    columns: Sequence[Column],
    rows: Sequence[Sequence[str]],
    width: int,
    *,
    title: str,
    caption: str | None = None,
) -> Table:
    """A rich table of ``rows`` (cells may hold rich markup) no wider than ``width``, if it can be.

    When even the columns that keep their width do not fit, those fold over
    lines instead of being cut: every character survives.
    """
    natural = [
        max([cell_len(column.header), *(Text.from_markup(row[i]).cell_len for row in rows)])
        for i, column in enumerate(columns)
    ]
    kept: dict[int, int] = dict(enumerate(natural))
    steps: list[tuple[int, int, int, int]] = []  # (rank, shrink before drop, column, width)
    for i, column in enumerate(columns):
        if column.shrink is not None:
            steps.append((column.shrink[0], 0, i, column.shrink[1]))
        if column.drop is not None:
            steps.append((column.drop, 1, i, 0))
    for _rank, is_drop, i, narrow in sorted(steps):
        if _table_width(list(kept.values())) <= width:
            break
        if i in kept:
            if is_drop:
                del kept[i]
            else:
                kept[i] = min(kept[i], narrow)
    fits = _table_width(list(kept.values())) <= width
    table = Table(title=title, caption=caption)
    for i, w in kept.items():
        column = columns[i]
        whole = column.keeps_width
        table.add_column(
            column.header,
            justify="right" if column.justify == _RIGHT else "left",
            no_wrap=fits or not whole,
            overflow="ellipsis" if fits or not whole else "fold",
            min_width=w if whole and fits else None,
            max_width=None if whole else w,
        )
    for row in rows:
        table.add_row(*(row[i] for i in kept))
    return table


def shape_text(shapes: Sequence[tuple[int, ...]]) -> str:
    return ", ".join("(" + ", ".join(str(d) for d in s) + ")" for s in shapes) or "-"


_LAYER_COLUMNS = (
    Column("name"),
    Column("type", shrink=(1, 12), drop=4),
    Column("params", _RIGHT, drop=2),
    Column("input shapes", drop=0),
    Column("output shapes", shrink=(3, 16), drop=5),
)


def layers_table(layers: Sequence[LayerInfo], width: int, title: str) -> Table:
    rows = [
        (
            escape(layer.name) or "(root)",
            escape(layer.type),
            f"{layer.parameter_count:,}",
            shape_text(layer.input_shapes),
            shape_text(layer.output_shapes),
        )
        for layer in layers
    ]
    return fit_table(_LAYER_COLUMNS, rows, width, title=title)


_DRIFT_COLUMNS = (
    Column("layer"),
    Column("state", drop=3),
    Column("baseline", _RIGHT, drop=1),
    Column("window", _RIGHT, drop=2),
    Column("psi", _RIGHT, drop=7),
    Column("js", _RIGHT, drop=6),
    Column("w1/σ", _RIGHT, drop=5),
    Column("shift σ", _RIGHT, drop=4),
    Column("channels", _RIGHT, drop=0),
    Column("alarm by", drop=8),
    Column("score/thr", _RIGHT, drop=9),
    Column("detected in", _RIGHT, drop=10),
    Column("alarm", _RIGHT),
)


def _alarm_by(d: LayerDrift) -> str:
    """The calibration state; uncalibrated with its reason (cut), so the table says why it never fires."""
    if d.calibration == "uncalibrated" and d.calibration_reason:
        return escape(f"uncalibrated: {d.calibration_reason[:60]}")
    return d.calibration or "-"


def _ratio(d: LayerDrift) -> str:
    r = d.ratio
    if r != r:  # NaN: no completed window yet, or not calibrated
        return "-"
    return f"[bold red]{r:.2f}[/]" if r > 1 else f"{r:.2f}"


def _score(value: float, threshold: float) -> str:
    return f"[bold red]{value:.3f}[/]" if threshold > 0 and value > threshold else f"{value:.3f}"


def drift_table(rows: Sequence[LayerDrift], width: int, title: str) -> Table:
    cells = [
        (
            escape(d.layer + (f" ({d.phase})" if d.phase else "") + (f" [{d.derive}]" if d.derive else "")),
            d.state,
            str(d.baseline_passes),
            str(d.window_passes),
            _score(d.psi, d.thresholds.psi),
            _score(d.js, d.thresholds.js),
            _score(d.wasserstein, d.thresholds.wasserstein),
            _score(d.mean_shift, d.thresholds.mean_shift),
            "-" if d.channel_drift_fraction is None else f"{d.channel_drift_fraction:.0%}",
            _alarm_by(d),
            _ratio(d),
            f"{d.detection_passes} passes" if d.drifted and d.detection_passes else "-",
            "[bold red]yes[/]" if d.drifted else "no",
        )
        for d in rows
    ]
    return fit_table(_DRIFT_COLUMNS, cells, width, title=title)


#: ``TapInfo.serving`` as a cell: where a compiled server runs the tap (see docs/operations.md).
_SERVING = {"in_graph": "in graph", "compiling_eager": "eager (compiling)", "pending": "[yellow]pending[/]",
            "compile_failed": "[red]compile failed[/]"}

_TAP_COLUMNS = (
    Column("id"),
    Column("name", shrink=(3, 12), drop=8),
    Column("owner", drop=2),
    Column("kind", drop=5),
    Column("selector", shrink=(7, 24)),
    Column("point", drop=1),
    Column("layers", _RIGHT, drop=4),
    Column("hits", _RIGHT, drop=9),
    Column("drops", _RIGHT, drop=6),
    Column("errors", _RIGHT),
    Column("serving", drop=3),
    Column("expires", drop=0),
)


def taps_table(taps: Sequence[TapInfo], width: int, title: str) -> Table:
    rows = [
        (
            escape(tap.id),
            escape(tap.spec.name),
            escape(tap.owner) or "(server)",
            tap.kind + (" [red](disabled)[/]" if tap.disabled else ""),
            escape(tap.spec.selector),
            tap.spec.point,
            str(len(tap.layers)),
            str(tap.hits),
            str(tap.drops),
            f"[red]{tap.errors}[/]" if tap.errors else "0",
            _SERVING.get(tap.serving, tap.serving or "-"),
            "never" if tap.expires_at is None else tap.expires_at.isoformat(timespec="seconds"),
        )
        for tap in taps
    ]
    return fit_table(_TAP_COLUMNS, rows, width, title=title)


def stats_table(stats: ServerStats, title: str) -> Table:
    table = Table(title=title, show_header=False)
    for key, value in vars(stats).items():
        table.add_row(key, str(value))
    return table
