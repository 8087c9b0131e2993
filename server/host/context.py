"""What a hook knows about the pass it fires in: :class:`PassContext`, a generation's rows and phase.

Apart from :mod:`.model_host` because every stage reads these (taps,
reducers, the publisher, drift, the recorder) while only the host makes them:
they are plain data, with no lock and no model behind them. A pass's
observers (:class:`PassObserver`) are told when it finishes, under the model
lock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from layertap.server.host.inputs import ModelInputs

__all__ = ["PHASE_DECODE", "PHASE_NONE", "PHASE_PREFILL", "PassContext", "PassObserver", "RequestRows"]

#: ``PassContext.phase`` values: ``layertap.v1.Phase`` numbers (the host stage reads no proto).
PHASE_NONE, PHASE_PREFILL, PHASE_DECODE = 0, 1, 2


@dataclass(frozen=True)
class RequestRows:
    """One Generate request's place in a batched pass: which rows are its own.

    Per-request views (a request's inline taps and captures) slice these rows
    out on the device, and for a prefill also the left padding its rows share.
    """

    request_id: str
    #: Its rows of the batch, contiguous.
    rows: slice
    #: Per row: the position of the token this pass produces in that sequence.
    positions: tuple[int, ...]
    #: Token positions at the left that are padding in every one of its rows
    #: (prefill only; 0 for decode).
    pad: int = 0

    @property
    def position(self) -> int | None:
        """The one position all its rows produce, or None when they differ."""
        return self.positions[0] if len(set(self.positions)) == 1 else None


@dataclass
class PassContext:
    """What a hook knows about the pass it fires in."""

    index: int
    #: Set for active captures: the pass ran a client's own input. Taps,
    #: baselines and passive captures ignore such passes.
    active_owner: object | None = None
    step: int | None = None
    wall_time: float = field(default_factory=time.time)
    #: ``time.perf_counter()`` at its start: the overhead budget's pass time (``taps.budget``).
    started: float = field(default_factory=time.perf_counter)
    #: Set when the forward (or backward) raised: observers drop the pass.
    failed: bool = False
    #: The inputs of a server-side pass (Infer, an active capture, a replay);
    #: None for a training loop's pass.
    inputs: ModelInputs | None = field(default=None, repr=False)
    #: The host's observers when the pass began: only they are told it finished.
    observers: tuple[PassObserver, ...] = field(default=(), repr=False)
    #: Its place in a generation (``PHASE_*``); PHASE_NONE for a plain forward.
    phase: int = PHASE_NONE
    #: The Generate requests whose rows this pass holds, in row order.
    requests: tuple[RequestRows, ...] = ()
    #: Length of the pass's token axis (the padded prompt length for a
    #: prefill, 1 for a decode step); 0 for a plain forward.
    tokens: int = 0
    #: The pass's ``(batch, tokens)`` attention mask on the host, when the
    #: model declares one and the pass has it: taps leave its padding out
    #: (:mod:`.padding`). None otherwise.
    attention_mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def position(self) -> int | None:
        """The one position every row produces, or None (several, or no generation)."""
        positions = {p for r in self.requests for p in r.positions}
        return positions.pop() if len(positions) == 1 else None

    @property
    def active(self) -> bool:
        return self.active_owner is not None


class PassObserver(Protocol):
    """Told about every finished pass, under the model lock."""

    def pass_finished(self, ctx: PassContext) -> None: ...
