"""One Generate request's own part of a batched pass: the view its inline taps reduce.

A Generate pass stacks several requests' sequences along dim 0, each request
a contiguous run of rows (``RequestRows.rows``). A request's inline tap sees
only its rows, cut out as a view on the device: basic slicing, no copy and no
host sync, so the hot path stays as cheap as a whole-batch tap. In a prefill
the prompts are left-padded to one length; the columns that are padding in
every one of the request's rows (``RequestRows.pad``) are cut off too.

What counts as "the batch" is read from the shapes alone, which is a guess
that holds for a decoder's activations and no further:

- a tensor whose dim 0 is the pass's batch (the largest ``rows.stop``) is
  sliced ``t[rows]``;
- a tensor whose dim 0 is ``batch * tokens`` (the flattened tokens of a
  mixture-of-experts block) is viewed as ``(batch, tokens, ...)``, cut the
  same way and flattened back;
- any other tensor holds no row of anyone's that can be told apart. When the
  request owns every row of the pass, or the tensor's dim 0 is 1 (rotary
  ``cos``/``sin``), it is the request's whole; otherwise it is withheld
  (None): another request's activations never reach this one's taps and
  captures. (A cache object is no tensor and never reaches a reducer.)
- in a prefill, a sliced tensor of 2 or more dims whose dim 1 is the token
  axis (``PassContext.tokens``) loses its first ``pad`` columns. A tensor
  whose dim 1 happens to equal the token count without being the token axis
  (attention weights ``(batch, heads, q, k)`` with as many heads as tokens)
  is cut there too.

A tap that leaves padding out (``host.padding``) then drops what padding is
left in the request's rows (prompts of one request that differ in length)
from the cut view, with the mask cut the same way: the shared columns are
never cut twice.
"""

from __future__ import annotations

import torch

from layertap.server.host.model_host import PHASE_PREFILL, PassContext, RequestRows

__all__ = ["RequestCut", "find_request"]


def find_request(ctx: PassContext, request_id: str) -> RequestRows | None:
    """The request's rows in this pass, or None when the pass does not hold it."""
    for rows in ctx.requests:
        if rows.request_id == request_id:
            return rows
    return None


class RequestCut:
    """Cuts one request's part out of each tensor of a pass.

    Args:
        ctx: The pass (its requests, phase and token axis length).
        rows: The request's rows in it (:func:`find_request`).
    """

    __slots__ = ("rows", "_slice", "_batch", "pad", "_tokens", "_owns_all", "key")

    def __init__(self, ctx: PassContext, rows: RequestRows) -> None:
        self.rows = rows
        self._slice = rows.rows
        self._batch = max(r.rows.stop for r in ctx.requests)
        #: Columns cut at the left: the prefill padding its rows share (0 for a decode step).
        self.pad = rows.pad if ctx.phase == PHASE_PREFILL else 0
        self._tokens = ctx.tokens
        self._owns_all = rows.rows.start == 0 and rows.rows.stop == self._batch
        #: Tells this cut from the whole tensor and from other requests' cuts in a reuse key.
        self.key = (rows.rows.start, rows.rows.stop, self.pad, self._tokens)

    def __call__(self, t: torch.Tensor) -> torch.Tensor | None:
        """The request's view of ``t``, or None when ``t`` mixes its rows with others' beyond telling apart."""
        if self._owns_all and not self.pad:
            return t  # every row is the request's and none is padding: any cut below would be all of t
        if t.dim() > 0 and t.shape[0] == self._batch:
            view = t[self._slice]
            if self.pad and view.dim() >= 2 and view.shape[1] == self._tokens:
                view = view[:, self.pad:]
            return view
        if t.dim() > 0 and self._tokens > 1 and t.shape[0] == self._batch * self._tokens:
            rows = t.reshape(self._batch, self._tokens, *t.shape[1:])[self._slice, self.pad:]
            return rows.flatten(0, 1)
        if self._owns_all or t.dim() == 0 or t.shape[0] == 1:
            return t
        return None
