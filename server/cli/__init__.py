"""The server's command lines: ``layertap serve`` and ``layertap demo drift``.

The client's ``layertap`` entry point (``layertap.cli``) dispatches here only
when the server extra is installed, so the thin client never imports torch.
Assemblers (``app``, the training agent) never import this package.
"""

from __future__ import annotations

import sys

__all__ = ["settled"]


def settled(timeout: float) -> bool:
    """Whether the servers this process ran have no background compile left, waiting up to ``timeout`` s.

    The client's console script asks this after ``serve`` or ``demo`` returns:
    a cold reducer compile (~20 s) cannot be interrupted, and a thread left
    inside inductor's C++ at interpreter exit aborts the process, so while one
    still runs the script leaves with ``os._exit`` instead.
    """
    app = sys.modules.get("layertap.server.app")  # never imported here: a thin install has no torch
    return app is None or bool(app.wait_compiles(timeout))
