"""A Generate request as the generator sees it: prompts, settings, and the
events it sends back to the RPC thread (:mod:`.generate` runs it).

Its own module so the RPC layer names these types without the step loop.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from layertap.server.errors import InvalidField

__all__ = [
    "FINISH_LENGTH", "FINISH_STOP", "Finished", "GenerationListener", "GenerationRequest", "NoListener",
    "Sampling", "StepEvent", "TokenEvent", "log_normalizer",
]

FINISH_LENGTH, FINISH_STOP = "length", "stop"
#: Takes ``nbytes`` from the server's capture budget: a function that gives them back, or None when over it.
Reserve = Callable[[int], "Callable[[], object] | None"]


@dataclass(frozen=True)
class Sampling:
    """How a request picks its tokens: greedy unless ``do_sample``."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def check(self) -> None:
        """Raises InvalidField naming the request field that is NaN or out of range."""
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise InvalidField("temperature", f"must be a finite number > 0, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise InvalidField("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidField("top_k", f"must be >= 0, got {self.top_k}")

    def pick(self, logits: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy argmax, or a draw after transformers' own temperature, top-k and top-p warpers; and
        which rows had a finite distribution (a row that did not is drawn from a placeholder, then ended)."""
        if not self.do_sample:
            return logits.argmax(dim=-1), torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
        from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper  # noqa: PLC0415 - hf: models only

        scores = logits
        if self.temperature != 1.0:
            scores = TemperatureLogitsWarper(self.temperature)(None, scores)
        if self.top_k:
            scores = TopKLogitsWarper(self.top_k)(None, scores)
        if self.top_p < 1.0:
            scores = TopPLogitsWarper(self.top_p)(None, scores)
        probs = torch.softmax(scores, dim=-1)
        ok = torch.isfinite(probs).all(dim=-1)
        probs = torch.where(ok[:, None], probs, torch.ones_like(probs))  # no sync: multinomial never sees NaN
        return torch.multinomial(probs, 1, generator=generator)[:, 0], ok


@dataclass(frozen=True)
class TokenEvent:
    sequence: int
    id: int
    position: int
    logprob: float


@dataclass
class StepEvent:
    """One step of one request: its new tokens and what its captures took."""

    phase: int
    step: int
    tokens: list[TokenEvent]
    #: ``(layer, call_index, output_key, tensor)``: the request's rows, on the host; the key
    #: is ``""`` for a tensor output, its position or dict key in a tuple or dict output.
    captures: list[tuple[str, int, str, torch.Tensor]] = field(default_factory=list)
    #: Captures lost because the request's client had not taken earlier ones.
    dropped_captures: int = 0
    #: Gives the captures' bytes back to the server's capture budget once sent.
    release: Callable[[], object] | None = None


@dataclass
class Finished:
    reasons: list[str]
    prompt_tokens: int
    generated_tokens: int
    time_to_first_token: float
    time_per_output_token: float


class GenerationListener(Protocol):
    """Told about generations for the server's self-metrics (export's ``GenerationMetrics``)."""

    def first_token(self, seconds: float) -> None: ...

    def inter_token(self, seconds: float, count: int) -> None: ...

    def tokens(self, n: int) -> None: ...

    def started(self) -> None: ...

    def finished(self, cancelled: bool) -> None: ...


class NoListener:
    """Listens to nothing: a generator built without metrics."""

    def first_token(self, seconds: float) -> None:
        pass

    def inter_token(self, seconds: float, count: int) -> None:
        pass

    def tokens(self, n: int) -> None:
        pass

    def started(self) -> None:
        pass

    def finished(self, cancelled: bool) -> None:
        pass


class GenerationRequest:
    """One Generate call: its prompts, settings and the events it is sent.

    The RPC thread reads :meth:`events`; the generator thread writes them.
    """

    def __init__(self, request_id: str, prompts: list[list[int]], *, max_new_tokens: int,
                 sampling: Sampling = Sampling(), stop_ids: Sequence[int] = (),
                 capture_layers: Sequence[str] = (), capture_dtype: torch.dtype | None = None,
                 capture_bytes: int = 0, reserve: Reserve | None = None) -> None:
        self.id = request_id
        self.prompts = prompts
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.stop_ids = frozenset(stop_ids)
        self.capture_layers = list(capture_layers)
        self.capture_dtype = capture_dtype
        #: Most capture bytes waiting for the client; later steps' captures are dropped.
        self.capture_bytes = capture_bytes
        #: Takes queued capture bytes from the server's capture budget; None: no server-wide bound.
        self._reserve = reserve
        self.arrived = time.monotonic()
        #: Passes this request took part in (a test reads it after a cancel).
        self.passes = 0
        self.generated: list[list[int]] = [[] for _ in prompts]
        self.reasons: list[str | None] = [None for _ in prompts]
        self._events: queue.SimpleQueue[StepEvent | Finished | BaseException] = queue.SimpleQueue()
        self._cancelled = threading.Event()
        self._held = 0  # capture bytes in the queue
        self._closed = False
        self._held_lock = threading.Lock()
        self._first: float | None = None
        self._last: float | None = None
        self._gaps = 0.0
        self._gap_count = 0
        self.generator: torch.Generator | None = None
        self.done = threading.Event()

    # -- the RPC side ----------------------------------------------------------
    def cancel(self) -> None:
        """Stop at the next step boundary (the client left or cancelled)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def events(self, poll: float = 0.1, alive: Callable[[], bool] = lambda: True
               ) -> Iterator[StepEvent | Finished | None]:
        """Steps as they come, then the :class:`Finished`; None each ``poll``
        seconds without news (the caller drains other queues then). Raises
        the error that ended the generation."""
        while alive():
            try:
                item = self._events.get(timeout=poll)
            except queue.Empty:
                yield None
                continue
            if isinstance(item, BaseException):
                raise item
            self._taken(item)
            yield item
            if isinstance(item, Finished):
                return

    def _taken(self, item: StepEvent | Finished | BaseException) -> None:
        """A step's captures left the queue: their bytes no longer count."""
        if isinstance(item, StepEvent) and item.captures:
            with self._held_lock:
                self._held -= sum(t.nbytes for *_, t in item.captures)
            if item.release is not None:
                item.release()

    def close(self) -> None:
        """The call ended: steps nobody will read give their capture bytes back, and later ones take none."""
        with self._held_lock:
            self._closed = True
        while True:
            try:
                self._taken(self._events.get_nowait())
            except queue.Empty:
                return

    # -- the generator side ----------------------------------------------------
    def _put(self, item: StepEvent | Finished | BaseException) -> None:
        # Reserved and queued under the lock close() takes: a step is either drained by
        # close() or queued after it with no bytes held (SimpleQueue.put never blocks).
        with self._held_lock:
            if isinstance(item, StepEvent) and item.captures:
                size = sum(t.nbytes for *_, t in item.captures)
                release = None
                fits = not self._closed and self._held + size <= self.capture_bytes
                if fits and self._reserve is not None:
                    release = self._reserve(size)
                    fits = release is not None  # None: over the server's --capture-budget-bytes
                if fits:
                    self._held += size
                    item.release = release
                else:
                    item.dropped_captures, item.captures = len(item.captures), []
            self._events.put(item)

    def _finish(self, listener: GenerationListener, error: BaseException | None = None) -> None:
        if self.done.is_set():
            return
        self.done.set()
        listener.finished(self.cancelled)
        if error is not None:
            self._put(error)
            return
        first = (self._first - self.arrived) if self._first is not None else 0.0
        self._put(Finished(
            reasons=[r or FINISH_LENGTH for r in self.reasons],
            prompt_tokens=sum(len(p) for p in self.prompts),
            generated_tokens=sum(len(g) for g in self.generated),
            time_to_first_token=first,
            time_per_output_token=self._gaps / self._gap_count if self._gap_count else 0.0,
        ))


def log_normalizer(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logits - max, logsumexp of that, whether the row can choose)`` per row: log_softmax in parts.

    NaN or +inf anywhere, or nothing finite, leaves no token to choose (-inf
    alone is a banned token): exactly the rows whose max plus log-sum-exp is
    not finite. The max comes off first, so a logprob's error does not grow
    with the logits' magnitude.
    """
    top = logits.amax(dim=-1, keepdim=True)
    shifted = logits - top
    lse = torch.logsumexp(shifted, dim=-1)
    return shifted, lse, torch.isfinite(top[:, 0] + lse)
