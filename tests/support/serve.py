"""Reading a ``layertap serve`` subprocess's start-up lines (tests and benchmarks)."""

from __future__ import annotations

import re
from collections.abc import Iterable

_SERVING = re.compile(r"serving on [^\s]+:(\d+)")
_METRICS = re.compile(r"metrics on https?://[^:]+:(\d+)/metrics")


def read_startup(stdout: Iterable[str], lines: list[str] | None = None) -> tuple[int, int | None]:
    """``(gRPC port, metrics port)`` from the lines up to serve's ``layertap: try`` hint.

    The port is -1 and the metrics port None when the process ended or never
    said them. ``lines``: where to keep every line read, for error messages.
    """
    port, metrics_port = -1, None
    for line in stdout:
        if lines is not None:
            lines.append(line)
        if m := _SERVING.search(line):
            port = int(m.group(1))
        if m := _METRICS.search(line):
            metrics_port = int(m.group(1))
        if line.startswith("layertap: try"):
            break
    return port, metrics_port
