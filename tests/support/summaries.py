"""Summaries a tap engine published, drained from a broker subscription (test support)."""

from __future__ import annotations

from dataclasses import dataclass, field
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


@dataclass
class FakeTap:
    """A tap as the publisher reads it (``PublishedTap``), with no engine behind it."""

    id: str
    spec: pb.TapSpec = field(default_factory=lambda: pb.TapSpec(point=pb.POINT_OUTPUT))
    owner: str = ""
    durable: bool = True
    hits: int = 0
    disabled: bool = False
    throttle: int = 1
    published_seconds: float = 0.0
    published_always_seconds: float = 0.0
