"""Derived tensors: what a tap reads in place of a layer's tensor (``TapSpec.derive``).

Each derivation softmaxes the last axis of the tensor, one value per row, on
the device and without a host sync: a ``(batch, tokens, vocab)`` logits
tensor gives a ``(batch, tokens)`` tensor of per-token entropy (nats) or
top-1 probability, which the tap then cuts, folds and reduces like any other
tensor. Drift over such a tap scores the model's confidence.

The numerics are the ``logits`` reducer's (:func:`log_probs`, shared): float32
for half-precision input, float64 kept; a row with a NaN or +Inf logit, or only
-Inf ones, has no softmax and gives NaN (reducers count it as non-finite,
baselines skip it); a -Inf logit alone (a masked class) has probability 0.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType
from typing import Final

import torch

from layertap.server.reducers.spec import SpecError
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["DERIVE_NAMES", "Derivation", "derivation", "derive", "entropy", "log_probs", "top1_prob"]

#: The wire value of each derivation by its name (``entropy``, ``top1_prob``): client, CLI, labels.
DERIVE_NAMES: Final = MappingProxyType({pb.DERIVE_ENTROPY: "entropy", pb.DERIVE_TOP1_PROB: "top1_prob"})

Derivation = Callable[[torch.Tensor], torch.Tensor]


def log_probs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x``'s rows over its last axis as log-probabilities, and which rows have a softmax.

    Returns:
        ``(logp, valid)``: ``logp`` a private ``(rows, classes)`` float32 (float64
        for float64 input) copy, -Inf logits clamped to the dtype's lowest value
        so that ``p * log p`` is 0 there; ``valid`` a ``(rows,)`` bool tensor, False
        for a row with a NaN/+Inf logit or only -Inf ones.
    """
    classes = int(x.shape[-1])
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    # A private copy: the clamp below must not touch the model's tensor.
    z = x.to(dtype, copy=True).reshape(-1, classes)
    lse = torch.logsumexp(z, dim=1)  # NaN for a NaN row, +inf for a +Inf row, -inf for an all -Inf row
    valid = torch.isfinite(lse)
    z.clamp_(min=torch.finfo(dtype).min)  # -inf -> lowest: p = 0 and p * log p = 0 (NaN stays NaN)
    return z.sub_(lse.unsqueeze(1)), valid  # in place: log-probabilities, the one copy reused


def _rows(x: torch.Tensor, per_row: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    logp, valid = log_probs(x)
    out = torch.where(valid, per_row(logp), torch.nan)  # a row without a softmax is NaN, never a number
    return out.reshape(x.shape[:-1])


def entropy(x: torch.Tensor) -> torch.Tensor:
    """Softmax entropy ``-sum p log p`` (nats) over the last axis, per row."""
    return _rows(x, lambda logp: -torch.linalg.vecdot(torch.exp(logp), logp))


def top1_prob(x: torch.Tensor) -> torch.Tensor:
    """The largest softmax probability over the last axis, per row."""
    return _rows(x, lambda logp: logp.amax(dim=1).exp())


_BY_VALUE: dict[int, Derivation] = {pb.DERIVE_ENTROPY: entropy, pb.DERIVE_TOP1_PROB: top1_prob}


def derivation(value: int, field: str) -> Derivation | None:
    """The function of a ``Derive`` value; None for ``DERIVE_UNSPECIFIED`` (the tensor itself).

    Raises:
        SpecError: An unknown value, naming ``field``.
    """
    if value == pb.DERIVE_UNSPECIFIED:
        return None
    fn = _BY_VALUE.get(value)
    if fn is None:
        raise SpecError(field, f"unknown derive {value}; use DERIVE_UNSPECIFIED (the tensor), DERIVE_ENTROPY "
                               "or DERIVE_TOP1_PROB")
    return fn


def derive(fn: Derivation, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)``, once ``x`` is known to be a floating tensor with at least 2 classes on its last axis.

    Raises:
        ValueError: It is not (the tap that asked is then disabled, inference goes on).
    """
    if not x.is_floating_point():
        raise ValueError(f"derive needs a floating-point tensor of logits, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] < 2:
        raise ValueError(f"derive needs at least 2 classes on the last axis, got shape {tuple(x.shape)}")
    return fn(x)
