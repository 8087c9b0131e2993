"""The slot for a compiled basic-statistics kernel: what a plan asks of it.

Why a protocol: the kernel is compiled off the pass by
:class:`layertap.server.compile.stats.CompiledStats`, which sits downstream
of the reducers (it compiles their math), so the reducers never import it.
``app.py`` builds one and the tap engine hands it to each plan and batch.
"""

from __future__ import annotations

from typing import Protocol

import torch

from layertap.server.reducers.kernels import StatNeeds
from layertap.server.reducers.workspace import Workspace

__all__ = ["StatsKernel"]


class StatsKernel(Protocol):
    """Basic statistics from a compiled kernel once ready; None means: compute them eagerly."""

    def stats(self, ws: Workspace, needs: StatNeeds) -> torch.Tensor | None:
        """One tensor's basic-statistics vector (``fused_basic_stats``' layout), or None."""

    def batch_stats(self, x: torch.Tensor, rnd: torch.Tensor) -> torch.Tensor | None:
        """Row-wise basic statistics of a ``(rows, n)`` stack (``batched_stats_body``' layout), or None."""
