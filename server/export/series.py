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
from typing import cast

from prometheus_client.utils import floatToGoString

__all__ = ["LabelSet", "Lines", "escape_label", "fmt_count", "fmt_value", "go_float"]

_INF = math.inf
#: Below this a float holds every int exactly and ``repr`` writes it as ``digits.0``.
_EXACT_INT = 2**53


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


def fmt_count(n: int) -> str:
    """A count (a Python ``int``) exactly as ``floatToGoString`` writes it, from its digits.

    Counts reach Go's exponent form (``1.2345e+08``) in steady state, and
    reading it off ``str(n)`` costs a third of :func:`fmt_value`'s float route.
    """
    if 0 <= n < 1_000_000:
        return f"{n}.0"
    if not 0 < n < _EXACT_INT:
        return fmt_value(float(n))
    digits = str(n)
    mantissa = digits.rstrip("0")
    exp = len(digits) - 1
    return f"{mantissa[0]}.{mantissa[1:]}e+{exp:02d}" if len(mantissa) > 1 else f"{mantissa}e+{exp:02d}"


def _fmt_slow(values: list[float]) -> list[str]:
    """:func:`fmt_value` of each value; a run of equal values is written once (layers of one pass share timestamps)."""
    out: list[str] = []
    prev, text = None, ""
    for v in values:
        if v != prev or v == 0:  # 0.0 and -0.0 are equal but written apart; NaN never equals
            prev, text = v, fmt_value(v)
        out.append(text)
    return out


def escape_label(v: str) -> str:
    """A label value as the text format and OpenMetrics both escape it."""
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class LabelSet:
    """The ``model, layer, point, tap, phase`` labels of one layer, escaped once and reused every scrape."""

    __slots__ = ("labels", "_parts")

    def __init__(self, model: str, layer: str, point: str, tap: str, phase: str) -> None:
        self.labels = {"model": model, "layer": layer, "point": point, "tap": tap, "phase": phase}
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
        self._values: list[float] | list[int] | None = None
        self._text = ""

    def fill(self, values: list[float]) -> str:
        """The lines with ``values`` (one per prefix, in order): floats, ints or numpy scalars."""
        if self._unchanged(values):
            return self._text
        if all(type(v) is int for v in values):
            # Counts (non-finite totals): an int prints from its digits.
            return self._set(values, [fmt_count(v) for v in cast("list[int]", values)])
        vals = list(map(float, values))  # ints print as floats; numpy scalars as their digits
        total = sum(vals)
        # A finite sum means no NaN or Inf among the values; then max() is exact.
        fast = total - total == 0.0 and max(vals, default=0.0) < 1e6
        return self._set(values, list(map(repr, vals)) if fast else _fmt_slow(vals))

    def fill_counts(self, counts: list[int]) -> str:
        """:meth:`fill` for values that are all Python ``int`` (e.g. from ``ndarray.tolist()``), unchecked.

        The histogram buckets are ~4,000 of a 200-layer scrape's ~9,000
        values; skipping the per-value type check and the float route makes
        them ~3× cheaper.
        """
        if self._unchanged(counts):
            return self._text
        if counts and (min(counts) < 0 or max(counts) >= 1_000_000):
            return self._set(counts, [fmt_count(v) for v in counts])
        return self._set(counts, [f"{v}.0" for v in counts])

    def _unchanged(self, values: list[float] | list[int]) -> bool:
        # Equal values print alike, except 0.0 and -0.0 (equal, written apart).
        if values == self._values and 0 not in values:
            return True
        if len(values) * 2 + 1 != len(self._parts) and (values or self._parts):
            raise ValueError(f"{len(values)} values for {len(self._parts) // 2} sample lines")
        return False

    def _set(self, values: list[float] | list[int], texts: list[str]) -> str:
        self._parts[1::2] = texts
        self._text = "".join(self._parts)
        self._values = values
        return self._text
