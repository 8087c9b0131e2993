"""Input retention: the last passes' inputs, bounded in bytes (``--record-inputs``).

An input is kept from the moment its pass starts until the host-transfer
thread has evaluated that pass's summaries (it is *pinned*): only then is it
known whether a trigger fired and a replay needs it. Passes are evaluated in
the order they ran, so when pass N is evaluated every older pass still held
was lost on the way (the transfer queue dropped it); those, and pinned inputs
pushed out by the byte bound, are counted as lost.

An input taken for a replay stays counted against the bound until the replay
is done (:meth:`InputRetention.release`): queued replays hold memory too.
The caller keeps a copy, not the request's tensors: a model may write to its
input in place. An input is a pass's positional and keyword tensors
(:class:`ModelInputs`), so a replay calls the model as the pass did.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from layertap.server.host.inputs import ModelInputs


def as_inputs(inputs: ModelInputs | Sequence[torch.Tensor]) -> ModelInputs:
    """Bare tensors are positional inputs."""
    return inputs if isinstance(inputs, ModelInputs) else ModelInputs.positional(inputs)


class InputRetention:
    """Pass index -> input tensors, at most ``max_bytes`` held together."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._held: OrderedDict[int, tuple[ModelInputs, int]] = OrderedDict()
        self._bytes = 0
        #: Bytes of inputs taken for a replay and not yet released.
        self._queued = 0
        self._lock = threading.Lock()
        #: Pinned passes released before their summaries were evaluated.
        self.lost = 0

    @property
    def held_bytes(self) -> int:
        """Pinned inputs, not yet evaluated."""
        return self._bytes

    @property
    def queued_bytes(self) -> int:
        """Inputs taken for a replay and not yet released; the bound covers both."""
        return self._queued

    def keep(self, index: int, tensors: ModelInputs | Sequence[torch.Tensor]) -> None:
        """Pin pass ``index``'s inputs (model thread): the oldest go when over the bound."""
        inputs = as_inputs(tensors)
        size = inputs.nbytes
        with self._lock:
            if size + self._queued > self.max_bytes:
                self.lost += 1  # cannot be held (queued replays keep their inputs): lost before evaluation
                return
            while self._held and self._bytes + self._queued + size > self.max_bytes:
                _, (_, old) = self._held.popitem(last=False)
                self._bytes -= old
                self.lost += 1
            self._held[index] = (inputs.map(lambda t, _i: t.detach()), size)
            self._bytes += size

    def forget(self, index: int) -> None:
        """Pass ``index`` will never be evaluated (it published nothing): not a loss."""
        with self._lock:
            entry = self._held.pop(index, None)
            if entry is not None:
                self._bytes -= entry[1]

    def take(self, index: int) -> ModelInputs | None:
        """Unpin pass ``index`` now that it is evaluated; older passes still held were lost.

        The input stays counted until :meth:`release`.
        """
        with self._lock:
            while self._held:
                first = next(iter(self._held))
                if first >= index:
                    break
                _, (_, old) = self._held.popitem(last=False)
                self._bytes -= old
                self.lost += 1
            entry = self._held.pop(index, None)
            if entry is None:
                return None
            self._bytes -= entry[1]
            self._queued += entry[1]
            return entry[0]

    def release(self, tensors: ModelInputs | Sequence[torch.Tensor] | None) -> None:
        """An input from :meth:`take` is no longer needed (its replay is done, or never ran)."""
        if tensors is None:
            return
        size = as_inputs(tensors).nbytes
        with self._lock:
            self._queued -= size

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)
