"""Padded positions left out of a pass's ``(batch, tokens, ...)`` tensors: read on the host, selected on the device.

A model that declares an ``attention_mask`` input (:data:`MASK_INPUT`) gets a
pass's mask on the host: the request's own CPU copy for an Infer pass
(``PassContext.inputs``), the mask the Generate loop built from its prompts'
left padding for a prefill (:func:`left_padding_mask`). A tap that leaves
padding out (``TapSpec.keep_padding`` false, the default) then reduces, in
place of each tensor whose two leading dimensions are the mask's
``(batch, tokens)``, the ``(valid, ...)`` tensor
``t.flatten(0, 1).index_select(0, index)``: one gather on the device, whose
index was computed once per pass on the host and copied to the device
without waiting (pinned, ``non_blocking``). Nothing here reads a device value,
so no hook ever syncs. Tensors of other shapes are reduced whole, as are
all tensors of a pass without padding.

The same guess as ``host.rows``: a tensor whose leading dims happen to equal
``(batch, tokens)`` without being those axes (attention weights
``(batch, heads, q, k)`` with as many heads as tokens) is selected too.

A Generate request's inline tap first cuts its rows and the left padding
they share (``host.rows.RequestCut``), then leaves out what padding is left
in its rows: :meth:`PassPadding.cut` takes the same rows and shared padding,
so the mask is cut exactly as the tensor was, and a request whose rows share
all their padding has nothing left to leave out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from layertap.server.host.inputs import ModelInputs
from layertap.server.host.sources import InputSpec

__all__ = ["MASK_INPUT", "PaddingCut", "PassPadding", "declares_mask", "host_mask", "left_padding_mask"]

#: The input that marks a sequence's valid positions (1) and its padding (0), as transformers names it.
MASK_INPUT = "attention_mask"


def declares_mask(specs: Sequence[InputSpec]) -> bool:
    """Whether the model takes an attention mask, so its passes may leave padding out."""
    return any(s.name == MASK_INPUT for s in specs)


def host_mask(inputs: ModelInputs | None, specs: Sequence[InputSpec]) -> torch.Tensor | None:
    """The pass's ``(batch, tokens)`` attention mask when it is given and on the host, else None.

    A mask on a device is not read (that would sync); no server-side pass has one.
    """
    if inputs is None:
        return None
    mask = inputs.kwargs.get(MASK_INPUT)
    if mask is None:
        at = next((i for i, s in enumerate(specs) if s.name == MASK_INPUT), len(inputs.args))
        mask = inputs.args[at] if at < len(inputs.args) else None
    if mask is None or mask.dim() != 2 or mask.device.type != "cpu":
        return None
    return mask


def left_padding_mask(pads: Sequence[int], tokens: int) -> torch.Tensor | None:
    """The mask of rows left-padded by ``pads`` positions each, on the host; None when no row is padded."""
    if not any(pads):
        return None
    return torch.from_numpy(np.arange(tokens)[None, :] >= np.asarray(pads)[:, None])


class PaddingCut:
    """Selects the valid positions of the tensors whose leading dims are ``lead``.

    Attributes:
        lead: ``(batch, tokens)`` of the mask (the request's rows and columns, for a request's cut).
        valid: How many positions are kept.
        key: Tells this selection from the whole tensor in a reuse key (``taps.reuse``).
    """

    __slots__ = ("lead", "valid", "key", "_host", "_index", "_valid", "_mask")

    def __init__(self, lead: tuple[int, int], index: np.ndarray, key: tuple[object, ...], valid: np.ndarray) -> None:
        self.lead = lead
        self.valid = int(index.size)
        self.key = key
        self._host = torch.from_numpy(index)
        self._index: dict[torch.device, torch.Tensor] = {}
        #: The ``(batch, tokens)`` mask itself, for ``layertap::tap_stats``'s mask input.
        self._valid = valid
        self._mask: dict[torch.device, torch.Tensor] = {}

    @property
    def excluded(self) -> int:
        """Positions left out."""
        return self.lead[0] * self.lead[1] - self.valid

    def fits(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s leading dims are ``(batch, tokens)``: it is selected, else reduced whole."""
        return t.dim() >= 2 and t.shape[0] == self.lead[0] and t.shape[1] == self.lead[1]

    def shape(self, t: torch.Tensor) -> tuple[int, ...]:
        """The shape :meth:`__call__` gives ``t``, without selecting."""
        return (self.valid, *t.shape[2:])

    def index(self, device: torch.device) -> torch.Tensor:
        """The flat indices of the valid positions on ``device``, copied there once per pass without waiting."""
        index = self._index.get(device)
        if index is None:
            host = self._host.pin_memory() if device.type == "cuda" else self._host
            index = self._index[device] = host.to(device, non_blocking=True)
        return index

    def mask(self, device: torch.device) -> torch.Tensor:
        """The ``(batch, tokens)`` bool mask of the valid positions on ``device``, copied once per pass
        without waiting: the op leaves the rest out where it reads the tensor, with no gather."""
        mask = self._mask.get(device)
        if mask is None:
            host = torch.from_numpy(np.ascontiguousarray(self._valid))
            host = host.pin_memory() if device.type == "cuda" else host
            mask = self._mask[device] = host.to(device, non_blocking=True)
        return mask

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s valid positions as one ``(valid, ...)`` tensor (``t`` must :meth:`fit <fits>`)."""
        return t.flatten(0, 1).index_select(0, self.index(t.device))


class PassPadding:
    """One pass's padding: the valid positions of its mask, as cuts for the whole batch or a request's rows.

    Args:
        mask: The pass's ``(batch, tokens)`` attention mask on the host; nonzero marks a valid position.
    """

    def __init__(self, mask: torch.Tensor) -> None:
        self._valid = mask.numpy() != 0
        self._cuts: dict[tuple[int, int, int] | None, PaddingCut | None] = {}

    def cut(self, rows: slice | None = None, pad: int = 0) -> PaddingCut | None:
        """The selection for the whole mask, or for ``rows`` without their first ``pad`` columns
        (a request's cut, ``host.rows``); None when nothing there is padding."""
        key = None if rows is None else (rows.start, rows.stop, pad)
        if key in self._cuts:
            return self._cuts[key]
        valid = self._valid if rows is None else self._valid[rows, pad:]
        cut = None
        if not valid.all():
            lead = (int(valid.shape[0]), int(valid.shape[1]))
            cut = PaddingCut(lead, np.flatnonzero(valid).astype(np.int64), ("padding", *lead, key), valid)
        self._cuts[key] = cut
        return cut
