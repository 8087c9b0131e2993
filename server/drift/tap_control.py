"""What drift asks of the tap engine: its own baseline taps, made, reshaped and removed.

Why a protocol: drift is a sink of the engine, downstream of it; it must not
steer the engine through its internals. The engine implements this, and
``app.py`` hands it to :class:`~layertap.server.drift.monitor.DriftMonitor`.
"""

from __future__ import annotations

from typing import Protocol

from layertap.server.host.model_host import ModelHost
from layertap.server.taps.tap import Tap
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["TapControl"]


class TapControl(Protocol):
    """The engine as drift sees it."""

    #: The model host: its layers and their shapes.
    host: ModelHost
    #: Whether 3-d tensors are ``(batch, tokens, hidden)`` (the feature axis is the last).
    token_model: bool

    def all_taps(self) -> list[Tap]:
        """Every live tap."""

    def create(self, spec: pb.TapSpec, *, forever: bool = False, trusted_selector: bool = False) -> Tap:
        """A durable server-owned tap (a baseline's)."""

    def delete(self, tap_id: str, reason: str = "deleted") -> Tap:
        """Removes a tap and its hooks."""

    def set_layer_reducers(self, tap_id: str, layer: str, reducers: list[pb.ReducerSpec], *,
                           tap: Tap | None = None) -> None:
        """Replaces one layer's reducers of a baseline tap (a new phase's)."""
