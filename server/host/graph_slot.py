"""The host's slot for compiled serving: what a pass asks of it.

Why a protocol: compilation (:mod:`layertap.server.compile`) sits downstream
of the host (it compiles the host's module, on the host's threads), so the
host never imports it. ``app.py`` builds a ``CompiledServing`` and hands it to
:meth:`~layertap.server.host.model_host.ModelHost.attach_graph`.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["GraphServing"]


class GraphServing(Protocol):
    """Serves a pass from a compiled variant when one fits (``serve --compile-model``)."""

    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Compiles the untapped graph ahead, from an example input, in the background."""

    def serve(self, args: tuple[Any, ...], kwargs: dict[str, Any], ctx: Any) -> tuple[bool, Any]:
        """``(True, output)`` when a compiled variant ran this pass, else ``(False, None)``: run eager."""

    def serving_stats(self) -> dict[str, int]:
        """The compiled-serving fields of ``GetServerStatsResponse``."""
