"""Sample lines of the per-layer families, written the way prometheus-client writes them.

prometheus-client builds a ``Sample`` per series and escapes, sorts and joins
its labels on every scrape. Here a layer's label text is escaped once
(:class:`LabelSet`), the ``name{labels} `` prefixes of a family are laid out
once (:class:`Lines`), and a scrape only formats the values. Sample lines are
the same in the text format 0.0.4 and OpenMetrics 1.0, so one rendering
serves both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from prometheus_client.utils import floatToGoString

__all__ = ["LabelSet", "Lines", "escape_label", "fmt_value", "go_float"]

_INF = math.inf


def go_float(v: float) -> str:
    """Go's float formatting for ``le``/``quantile`` labels, as prometheus-client writes them."""
    return str(floatToGoString(v))  # type: ignore[no-untyped-call]


def fmt_value(f: float) -> str:
    """A sample value exactly as ``floatToGoString`` writes it, without its checks on the common path.

    ``f`` must be a Python float: ``repr`` of a numpy scalar is not its digits.
    """
    if -_INF < f < 1e6:  # NaN fails the comparison
        return repr(f)
    if f != f:
        return "NaN"
    if f == _INF:
        return "+Inf"
    if f == -_INF:
        return "-Inf"
    s = repr(f)
    dot = s.find(".")
    if dot > 6:  # Go switches to an exponent from 1e6 up (Python only from 1e16)
        return f"{s[0]}.{s[1:dot]}{s[dot + 1:]}".rstrip("0.") + f"e+{dot - 1:02d}"
    return s


def escape_label(v: str) -> str:
    """A label value as the text format and OpenMetrics both escape it."""
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class LabelSet:
    """The ``model, layer, point, tap`` labels of one layer, escaped once and reused every scrape."""

    __slots__ = ("labels", "_parts")

    def __init__(self, model: str, layer: str, point: str, tap: str) -> None:
        self.labels = {"model": model, "layer": layer, "point": point, "tap": tap}
        self._parts: dict[str, tuple[str, str]] = {}

    def prefix(self, name: str, key: str = "", value: str = "") -> str:
        """``name{labels} `` of one sample line; ``key="value"`` goes in sorted position, as prometheus-client puts it.

        ``value`` must already be escaped (``le``/``quantile``/``kind``/``metric`` values need none).
        """
        parts = self._parts.get(key)
        if parts is None:
            names = sorted(self.labels)
            i = sum(1 for n in names if n < key)
            esc = [f'{n}="{escape_label(self.labels[n])}"' for n in names]
            if not key:
                parts = (",".join(esc), "")
            else:
                before, after = ",".join(esc[:i]), ",".join(esc[i:])
                parts = (before + "," if before else "", "," + after if after else "")
            self._parts[key] = parts
        if not key:
            return f"{name}{{{parts[0]}}} "
        return f'{name}{{{parts[0]}{key}="{value}"{parts[1]}}} '


class Lines:
    """The sample lines of one family: prefixes fixed, values formatted per scrape.

    The prefixes sit in a list with a slot after each; a scrape drops the
    value strings into the slots (one C-level slice assignment) and joins,
    so no template is scanned and no per-sample object is built. Values that
    are finite and below 1e6 (Go's switch to exponent form) print as
    ``repr``; a family holding any other value goes through :func:`fmt_value`.
    Unchanged values reuse the last text.
    """

    __slots__ = ("_parts", "_values", "_text")

    def __init__(self, prefixes: Sequence[str]) -> None:
        parts: list[str] = []
        for i, p in enumerate(prefixes):
            parts += (p if i == 0 else "\n" + p, "")
        if parts:
            parts.append("\n")
        self._parts = parts
        self._values: list[float] | None = None
        self._text = ""

    def fill(self, values: list[float]) -> str:
        """The lines with ``values`` (one per prefix, in order)."""
        # Equal values print alike, except 0.0 and -0.0 (equal, written apart).
        if values == self._values and 0 not in values:
            return self._text
        if len(values) * 2 + 1 != len(self._parts) and (values or self._parts):
            raise ValueError(f"{len(values)} values for {len(self._parts) // 2} sample lines")
        if all(type(v) is int for v in values) and 0 <= min(values, default=0) and max(values, default=0) < 1_000_000:
            # Counts (histogram buckets, non-finite totals): an int below
            # Go's exponent switch prints as repr(float(v)) does, at a third
            # of the cost (~4,600 of a 200-layer scrape's ~9,000 values).
            self._parts[1::2] = [f"{v}.0" for v in values]
            self._text = "".join(self._parts)
            self._values = values
            return self._text
        vals = list(map(float, values))  # ints (counts) print as floats; numpy scalars as their digits
        total = sum(vals)
        # A finite sum means no NaN or Inf among the values; then max() is exact.
        fast = total - total == 0.0 and max(vals, default=0.0) < 1e6
        self._parts[1::2] = map(repr if fast else fmt_value, vals)
        self._text = "".join(self._parts)
        self._values = values
        return self._text
