"""Summaries a tap engine published, drained from a broker subscription (test support)."""

from __future__ import annotations

from typing import Any

from layertap.server.taps.engine import TapEngine
from layertap.v1 import telemetry_pb2 as pb


def drain(engine: TapEngine, sub: Any) -> list[pb.Summary]:
    """Every summary published so far: the engine's transfer thread flushed, then the subscription emptied."""
    assert engine.flush(10)
    out = []
    while (b := sub.get(timeout=0)) is not None:
        out.extend(b.summaries)
    return out


def results(s: pb.Summary) -> dict[str, pb.ReducerResult]:
    """A summary's results by reducer kind."""
    return {r.WhichOneof("value"): r for r in s.results}
