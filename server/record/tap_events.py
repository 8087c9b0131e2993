"""What the recorder asks of the tap engine: the host it replays on, and a tap event to send.

Why a protocol: the recorder is a sink of the engine and must not reach into
its publisher. The engine implements this; ``record.wiring`` hands it over.
"""

from __future__ import annotations

from typing import Protocol

from layertap.server.host.model_host import ModelHost
from layertap.server.stream.sinks import TapView

__all__ = ["TapEvents"]


class TapEvents(Protocol):
    """The engine as the recorder sees it."""

    #: The model host: its passes, the inputs the recorder keeps and replays.
    host: ModelHost

    def event(self, tap: TapView, kind: str, message: str) -> None:
        """Tells the tap's subscribers now (never blocks)."""
