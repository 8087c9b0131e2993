"""The running rows of a generation: their cache, attention mask and last tokens, and their grouping by request.

Why a module of its own: the step loop (:mod:`.generate`) decides when rows
run, join and leave; this is what a batch of rows is and how it shrinks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from layertap.server.generate.request import GenerationRequest

__all__ = ["Batch", "Row", "groups", "left_pad"]


@dataclass
class Row:
    request: GenerationRequest
    sequence: int
    #: Tokens of the sequence so far (prompt and generated).
    length: int
    done: bool = False


class Batch:
    """The running rows: their cache, attention mask and last tokens, on the device."""

    def __init__(self, rows: list[Row], cache: Any, mask: torch.Tensor, last: torch.Tensor) -> None:
        self.rows, self.cache, self.mask, self.last = rows, cache, mask, last

    def keep(self, keep: list[int]) -> None:
        """Keep only these rows (finished and cancelled ones leave; their cache goes with them)."""
        if len(keep) == len(self.rows):
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache = None
            return
        self.cache.batch_select_indices(index)
        self.mask, self.last = self.mask[index], self.last[index]
        # Columns that are padding in every remaining row go too.
        empty = int((self.mask.sum(0) == 0).long().cumprod(0).sum())
        # Only plain DynamicLayer keys line up with the mask's columns: a sliding layer keeps its last
        # window-1 keys and counts cumulative_length, so trimming it desynchronises mask and cache.
        if empty and all(type(layer).__name__ == "DynamicLayer" for layer in self.cache.layers):
            self.mask = self.mask[:, empty:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[..., empty:, :], layer.values[..., empty:, :]


def left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    if width == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [width, 0]
    return F.pad(t, pad)


def groups(rows: list[Row]) -> Iterator[tuple[GenerationRequest, list[Row]]]:
    """Consecutive rows of one request (a request's rows are always contiguous)."""
    start = 0
    while start < len(rows):
        request = rows[start].request
        end = start
        while end < len(rows) and rows[end].request is request:
            end += 1
        yield request, rows[start:end]
        start = end
