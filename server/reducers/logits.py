"""The ``logits`` reducer: how confident a classifier or language-model head is.

Each row of the tensor (every index of the leading dimensions: a token of a
``(batch, tokens, vocab)`` tensor, a sample of ``(batch, classes)``) is
softmaxed over the last dimension, on the device and without a host sync:

* entropy ``H = -sum(p * log p)`` in nats, with ``log p = x - logsumexp(x)``;
* top-1 probability ``exp(max log p)``;
* margin ``p1 - p2`` (``p1`` itself for a single class).

The math runs in float32 even for bfloat16/float16 input (float64 stays
float64): half-precision softmax of a 100k vocabulary loses the small
probabilities that entropy sums. Rows are then summarized as a mean and the
least confident row, weighted by a finiteness mask (``torch.where``, never
boolean indexing), so a row with a NaN/+Inf logit or only -Inf ones is left
out without a sync. -Inf logits (masked classes) are clamped to the dtype's
lowest value after ``lse``, so they get probability 0 and add 0 to the
entropy instead of ``0 * -inf = NaN``.

The cost is one float32 copy of the tensor (turned into log-probabilities in
place) and one probability tensor of the same size per firing: meant for the head, not for every layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from layertap.server.reducers.base import Reducer
from layertap.server.reducers.derive import log_probs
from layertap.server.reducers.spec import SpecError
from layertap.server.reducers.workspace import F64, Workspace
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["LogitsReducer"]

#: [rows, entropy mean, entropy max, top-1 mean, top-1 min, margin mean, margin min]
_WIDTH = 7


class LogitsReducer(Reducer):
    """Softmax entropy, top-1 probability and top-1/top-2 margin per row, summarized over rows."""

    kind = pb.REDUCER_KIND_LOGITS

    def width(self, shape: Sequence[int]) -> int:
        return _WIDTH

    def check(self, shape: Sequence[int]) -> None:
        if len(shape) == 0:
            raise SpecError(f"{self.field}.kind", "logits needs a tensor whose last dimension is the classes, "
                                                  "got a 0-d tensor")

    def compute(self, ws: Workspace) -> torch.Tensor:
        x = ws.x
        classes = int(x.shape[-1])
        if ws.numel == 0:
            return torch.cat([x.new_zeros((1,), dtype=F64), x.new_full((_WIDTH - 1,), math.nan, dtype=F64)])
        logp, valid = log_probs(x)  # shared with the derived taps (``derive``)
        entropy = -torch.linalg.vecdot(torch.exp(logp), logp)  # as -sum p log p: no lse - E[x] cancellation
        # Top-2 as two linear passes, not topk (a selection the sync referee keeps
        # to bounded samples): the row's max, then the max with that one class
        # knocked out, so a tie for first gives margin 0.
        lp1, first = logp.max(dim=1)
        p1 = lp1.exp()
        if classes > 1:
            margin = p1 - logp.scatter_(1, first.unsqueeze(1), -math.inf).amax(dim=1).exp()
        else:
            margin = p1
        # Rows as float64 before the means, so many rows add up exactly enough.
        rows = torch.stack([entropy, p1, margin]).to(F64)
        count = valid.sum(dtype=F64)
        means = torch.where(valid, rows, 0.0).sum(dim=1) / count  # 0 / 0 = NaN without a valid row
        # The least confident row: the largest entropy, the smallest top-1 and margin.
        # Signs by stacking, not a new_tensor: a tensor built from a Python list is a host-to-device copy (a sync).
        flip = torch.stack([-rows[0], rows[1], rows[2]])
        worst = torch.where(valid, flip, math.inf).amin(dim=1)
        worst = torch.stack([-worst[0], worst[1], worst[2]])
        return torch.cat([count.reshape(1), torch.stack([means, worst], dim=1).reshape(-1)])

    def decode(self, values: np.ndarray, shape: Sequence[int]) -> pb.ReducerResult:
        rows = int(round(float(values[0])))
        stats = values[1:].tolist() if rows else [math.nan] * (_WIDTH - 1)
        classes = int(shape[-1]) if len(shape) else 0
        return pb.ReducerResult(logits=pb.Logits(rows=rows, classes=classes, entropy_mean=stats[0],
                                                 entropy_max=stats[1], top1_mean=stats[2], top1_min=stats[3],
                                                 margin_mean=stats[4], margin_min=stats[5]))
