"""``--json``: the CLI's results as JSON lines, one object per line, for scripts.

Objects are the client's own dataclasses (:mod:`layertap._types`) with the
same field names, so a script reads what ``layertap.Client`` returns. Strict
JSON has no NaN or infinity, which ``jq`` and most parsers reject; those
floats are written as the strings Prometheus uses: ``"NaN"``, ``"+Inf"``,
``"-Inf"``. Datetimes are RFC 3339 strings.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from rich.console import Console, RenderableType

__all__ = ["add_json_flag", "jsonable", "show_rows", "write_json_lines"]


def _float(value: float) -> float | str:
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return "NaN"
    return "+Inf" if value > 0 else "-Inf"


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON types: dataclasses become objects keyed by field name."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, np.generic):
        return jsonable(value.item())
    if isinstance(value, float):
        return _float(value)
    return value


def write_json_lines(values: Iterable[Any]) -> None:
    """Writes each value as one line and flushes, so a reader downstream sees it at once."""
    for value in values:
        sys.stdout.write(json.dumps(jsonable(value), allow_nan=False, ensure_ascii=False) + "\n")
        sys.stdout.flush()


def add_json_flag(p: argparse.ArgumentParser) -> None:
    """``--json`` for a command that prints the client's own objects (``layers``, ``watch``, ``drift``...)."""
    p.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per line, with the client's field names (NaN/Inf as \"NaN\", \"+Inf\", \"-Inf\")",
    )


def show_rows(args: argparse.Namespace, rows: Sequence[Any], table: Callable[[int], RenderableType]) -> int:
    """A listing command's output: one JSON line per row with ``--json``, else ``table(width)`` on the console."""
    if args.json:
        write_json_lines(rows)
        return 0
    console = Console()
    console.print(table(console.width))
    return 0
