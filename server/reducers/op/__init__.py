"""``layertap::tap_stats``: a tap's firing as one op call into a row of a preallocated buffer.

    from layertap.server.reducers.op import new_rows, tap_stats
    out = new_rows(4, device)                     # 4 rows holding the identity
    tap_stats(x, out, row, flag)                  # row, flag: device tensors
    reset_rows(out)                               # once per pass, after the copy back

Each row is ``reducers.kernels``' basic layout, so a basic plan decodes it as
it decodes its own vector.
"""

from __future__ import annotations

import torch

from layertap.server.reducers.op.reference import IDENTITY, MAX_ATEN_OPS, MAX_DIMS, SAMPLE
from layertap.server.reducers.op.registry import FLOAT_DTYPES, ROW_WIDTH, tap_stats_op, triton_available

__all__ = ["FLOAT_DTYPES", "IDENTITY", "MAX_ATEN_OPS", "MAX_DIMS", "ROW_WIDTH", "SAMPLE", "new_rows", "reset_rows",
           "tap_stats", "tap_stats_op", "triton_available"]


def tap_stats(x: torch.Tensor, out: torch.Tensor, row: torch.Tensor, flag: torch.Tensor,
              mask: torch.Tensor | None = None) -> None:
    """Merges x's basic statistics into ``out[row]`` when ``flag`` is non-zero (one op call).

    Args:
        x: A float tensor (``FLOAT_DTYPES``), any strides, any device.
        out: A contiguous ``(rows, ROW_WIDTH)`` float64 buffer on x's device.
        row: One int64 element: the row to merge into.
        flag: One int32 element: 0 skips the work, not the launch.
        mask: Optional bool or uint8 tensor over x's leading dims: elements under 0 are left out.

    Raises:
        ValueError: An argument the kernels would misread (the message names it).
    """
    tap_stats_op(x, out, row, flag, mask)


def new_rows(rows: int, device: torch.device | str) -> torch.Tensor:
    """A ``(rows, ROW_WIDTH)`` float64 buffer on ``device``, every row the identity."""
    return torch.tensor([IDENTITY] * rows, dtype=torch.float64).reshape(rows, ROW_WIDTH).to(device)


def reset_rows(out: torch.Tensor, identity: torch.Tensor | None = None) -> None:
    """Puts every row of ``out`` back to the identity: one copy (``identity``: a ``(ROW_WIDTH,)`` tensor on its device)."""
    if identity is None:
        identity = torch.tensor(IDENTITY, dtype=torch.float64, device=out.device)
    out.copy_(identity.expand_as(out))
