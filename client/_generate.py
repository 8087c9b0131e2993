"""Generation: the request, the stream of steps and the result of ``Client.generate``.

A Generate stream sends a GenerationStarted (the request's id, its inline
taps' ids, each prompt's token ids), then one message per step (the step's
tokens, and its summaries and captures as they are ready), then a
GenerationFinished (counts, timings, each sequence's finish reason).
:class:`Generation` reads the first message before ``Client.generate``
returns, so a request the server refuses raises there; iterating it yields a
:class:`GenerationStep` per step message, and :meth:`Generation.result`
drains the rest into a :class:`GenerationResult`.

``Client.generate`` calls :func:`generate` with its transport; the call lives
here so that the client module keeps to its size.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeGuard, Union

import numpy as np
import numpy.typing as npt

from ._capture import downcast_code
from ._codec import TensorValue, decode_tensor, require_torch
from ._convert import phase_name, summary_from_proto, tap_spec_to_proto
from ._errors import InvalidArgument, LayertapError, ProtocolError
from ._taps import tap_spec
from ._transport import ServerStream, Streaming, Transport
from ._types import Summary, TapSpec
from .v1 import inference_pb2

__all__ = ["GeneratedToken", "Generation", "GenerationResult", "GenerationStep", "Prompt", "StepCapture",
           "generate", "generate_request", "step_from_proto"]

GENERATE = Streaming.of("InferenceService", "Generate", inference_pb2.GenerateRequest, inference_pb2.GenerateResponse)

#: One text, one prompt's token ids, or a list of either (several sequences,
#: lengths may differ); a 1-D or 2-D integer array too (a torch tensor works
#: as well: anything with ``tolist()``).
Prompt: TypeAlias = Union[str, Sequence[int], Sequence[str], Sequence[Sequence[int]], npt.NDArray[Any]]

_FINISH_REASONS = {code: name.removeprefix("FINISH_REASON_").lower()
                   for name, code in inference_pb2.FinishReason.items() if code}
_UINT64 = 1 << 64


@dataclass(frozen=True)
class GeneratedToken:
    """One new token of one sequence.

    Attributes:
        sequence: The sequence: its prompt's index in the request.
        id: The token id.
        position: Its position in the sequence (the prompt's length for the first new token).
        logprob: Its log-probability under the model's distribution, before
            temperature, top-k and top-p.
        text: Its text piece; "" when the model directory has no tokenizer.
    """

    sequence: int
    id: int
    position: int
    logprob: float
    text: str = ""


@dataclass(frozen=True)
class StepCapture:
    """One layer's output at one step, the request's own rows only.

    ``tensor`` is a numpy array (bfloat16 widened to float32), or a torch
    tensor with ``as_torch=True``, as ``Client.capture`` returns them.
    """

    layer: str
    tensor: TensorValue
    #: 0 for the module's first call in the pass, 1 for a second...
    call_index: int = 0


@dataclass(frozen=True)
class GenerationStep:
    """One message of a generation: a step's tokens, summaries and captures.

    Summaries are reduced off the model thread, so they may come a step late,
    or in a message of their own (between steps, or with the end): such a
    message has no tokens, ``phase`` "" and ``step`` 0.

    Attributes:
        phase: ``"prefill"`` (the pass that reads the prompts) or ``"decode"``.
        step: 0 for the prefill's token, k for the k-th decode step.
        tokens: One per sequence still running at this step.
        summaries: The inline taps' summaries that were ready (their own
            ``phase`` and ``position`` say which pass each describes).
        captures: The ``capture=`` layers' outputs at this step.
    """

    phase: str
    step: int
    tokens: list[GeneratedToken]
    summaries: list[Summary]
    captures: list[StepCapture]


@dataclass(frozen=True)
class GenerationResult:
    """A whole generation, per sequence in prompt order.

    Attributes:
        request_id: The id the server gave the request (``Summary.request_ids``).
        prompts: Each prompt's token ids (the tokenizer's, for texts).
        sequences: Each sequence's generated ids, a stop token included.
        texts: Each sequence's text pieces joined; "" without a tokenizer.
        finish_reasons: ``"length"`` (``max_new_tokens``, or the model's
            positions) or ``"stop"`` (an end-of-sequence or stop token).
        prompt_tokens: Prompt tokens, summed over the sequences.
        generated_tokens: Generated tokens, summed over the sequences.
        time_to_first_token: Seconds from the call's arrival to its first token.
        time_per_output_token: Mean seconds between two tokens after the first.
        dropped: Inline tap summaries and step captures lost while the
            client lagged (a full queue, or captures over the server's byte cap waiting).
    """

    request_id: str
    prompts: list[list[int]]
    sequences: list[list[int]]
    texts: list[str]
    finish_reasons: list[str]
    prompt_tokens: int
    generated_tokens: int
    time_to_first_token: float
    time_per_output_token: float
    dropped: int


# --------------------------------------------------------------------------- the request


def _is_id(x: object) -> TypeGuard[int | np.integer[Any]]:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _ids(values: Any, what: str) -> list[int]:
    """``values`` as a list of token ids: integers, from a sequence or an array."""
    if hasattr(values, "tolist"):  # a numpy array or torch tensor
        values = values.tolist()
    if isinstance(values, str) or not isinstance(values, Sequence):
        raise InvalidArgument(f"{what}: expected a sequence of token ids, got {type(values).__name__}")
    ids = []
    for x in values:
        if not _is_id(x):
            raise InvalidArgument(f"{what}: token ids are integers, got {x!r}")
        ids.append(int(x))
    return ids


def _prompt_ids(seq: Any, what: str) -> list[int]:
    ids = _ids(seq, what)
    if not ids:
        raise InvalidArgument(f"{what} is empty: a prompt needs at least one token")
    return ids


def prompt_fields(prompt: Prompt) -> tuple[list[list[int]], list[str]]:
    """A prompt as the request's ``prompts`` (token ids) and ``texts``: one of the two is empty.

    Raises:
        InvalidArgument: No prompt, an empty id sequence, texts mixed with ids,
            or ids that are not integers.
    """
    if isinstance(prompt, str):
        return [], [prompt]
    if hasattr(prompt, "tolist"):  # a numpy array or torch tensor: nested lists of Python ints
        prompt = prompt.tolist()
    if not isinstance(prompt, Sequence):
        raise InvalidArgument(f"prompt: expected a text, token ids or a list of them, got {type(prompt).__name__}")
    items = list(prompt)
    if not items:
        raise InvalidArgument("prompt is empty: give a text, token ids, or a list of them")
    ids = [int(x) for x in items if _is_id(x)]
    texts = [x for x in items if isinstance(x, str)]
    if len(ids) == len(items):
        return [ids], []
    if len(texts) == len(items):
        return [], texts
    if ids or texts:
        raise InvalidArgument("prompt mixes texts, token ids and sequences: give texts or token id sequences")
    return [_prompt_ids(x, f"prompt[{i}]") for i, x in enumerate(items)], []


def _listed(value: str | TapSpec | Sequence[str | TapSpec]) -> list[str | TapSpec]:
    return [value] if isinstance(value, (str, TapSpec)) else list(value)


def generate_request(
    prompt: Prompt,
    *,
    max_new_tokens: int = 16,
    do_sample: bool = False,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop_token_ids: Sequence[int] = (),
    taps: str | TapSpec | Sequence[str | TapSpec] = (),
    capture: str | Sequence[str] = (),
    capture_dtype: str | None = None,
) -> inference_pb2.GenerateRequest:
    """Builds a GenerateRequest (see ``Client.generate`` for the arguments).

    A zero on the wire means the server's default, so the client refuses the
    values it could not send (``max_new_tokens=0``, ``temperature=0``,
    ``top_p=0``); everything else is the server's to judge.

    Raises:
        InvalidArgument: A malformed prompt, or one of those values; a bad
            tap spec or capture dtype.
    """
    ids, texts = prompt_fields(prompt)
    if not _is_id(max_new_tokens) or max_new_tokens < 1:
        raise InvalidArgument(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if temperature is not None and not temperature > 0:
        raise InvalidArgument(f"temperature must be > 0, got {temperature}")
    if top_k is not None and (not _is_id(top_k) or top_k < 0):
        raise InvalidArgument(f"top_k must be an integer >= 0 (0 keeps every token), got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise InvalidArgument(f"top_p must be in (0, 1], got {top_p}")
    if seed is not None and (not _is_id(seed) or not 0 <= seed < _UINT64):
        raise InvalidArgument(f"seed must be an integer in [0, 2**64), got {seed!r}")
    layers = [capture] if isinstance(capture, str) else list(capture)
    if any(not isinstance(name, str) or not name for name in layers):
        raise InvalidArgument("capture takes non-empty layer names or selectors")
    req = inference_pb2.GenerateRequest(
        prompts=[inference_pb2.TokenIds(ids=p) for p in ids],
        texts=texts,
        max_new_tokens=int(max_new_tokens),
        do_sample=do_sample,
        temperature=temperature or 0.0,
        top_k=int(top_k or 0),
        top_p=top_p or 0.0,
        seed=int(seed or 0),
        has_seed=seed is not None,
        stop_token_ids=_ids(stop_token_ids, "stop_token_ids"),
        taps=[tap_spec_to_proto(tap_spec(t, {})) for t in _listed(taps)],
        capture=layers,
    )
    if capture_dtype is not None:
        req.capture_dtype = downcast_code(capture_dtype)
    return req


# --------------------------------------------------------------------------- the response


def step_from_proto(msg: inference_pb2.GenerateResponse, *, as_torch: bool = False) -> GenerationStep:
    """Converts one step message of a Generate stream."""
    return GenerationStep(
        phase=phase_name(msg.phase),
        step=msg.step,
        tokens=[GeneratedToken(t.sequence, t.id, t.position, t.logprob, t.text) for t in msg.tokens],
        summaries=[summary_from_proto(s) for s in msg.summaries],
        captures=[StepCapture(c.layer, decode_tensor(c.tensor, as_torch=as_torch), c.call_index)
                  for c in msg.captures],
    )


def _hint(exc: LayertapError) -> None:
    """What the caller can change, for the errors a generation is likely to meet."""
    if exc.reason == "NO_TOKENIZER":
        exc.hint = "the model directory has no tokenizer: send token ids as prompt= instead of text"
    elif exc.code == "DEADLINE_EXCEEDED":
        exc.hint = "the generation outlasted its deadline: pass a longer timeout= or fewer max_new_tokens="


class Generation(Iterator[GenerationStep]):
    """A running generation: iterate it for each :class:`GenerationStep`.

    ``Client.generate`` returns it once the server accepted the request (its
    first message arrived), so ``request_id``, ``tap_ids`` and ``prompts``
    are set from the start. Iteration ends after the server's last message;
    :meth:`result` reads whatever is left and returns the whole generation,
    however much of it was iterated. Use it in a ``with`` block, or call
    :meth:`cancel`, to stop a generation early.

    Attributes:
        request_id: The id the server gave this request; its taps' summaries
            name it in ``Summary.request_ids``.
        tap_ids: The ids of the inline taps, in ``taps=`` order.
        prompts: Each prompt's token ids (the tokenizer's, for texts).

    Raises:
        LayertapError: From iteration: the server failed the generation (e.g.
            ``NONFINITE_LOGITS``), or its deadline passed.
        ProtocolError: The stream broke the Generate contract.
    """

    def __init__(
        self,
        call: ServerStream[Any],  # of GenerateResponse: kept out of the public signature
        translating: Callable[[], AbstractContextManager[None]],
        *,
        as_torch: bool = False,
    ) -> None:
        self._call = call
        self._translating = translating
        self._as_torch = as_torch
        self._steps: deque[GenerationStep] = deque()
        self._finished: inference_pb2.GenerationFinished | None = None
        self._ended = False  # the stream ended: finished, failed or cancelled
        self._cancelled = False
        first = self._read()
        if first is None or not first.HasField("started"):
            self.cancel()
            raise ProtocolError("the Generate stream did not start with a GenerationStarted")
        started = first.started
        self.request_id: str = started.request_id
        self.tap_ids: list[str] = list(started.tap_ids)
        self.prompts: list[list[int]] = [list(p.ids) for p in started.prompts]
        self._sequences: list[list[int]] = [[] for _ in self.prompts]
        self._pieces: list[list[str]] = [[] for _ in self.prompts]
        first.ClearField("started")
        self._take(first)

    def _take(self, msg: inference_pb2.GenerateResponse) -> None:
        """Files one message's parts; a message that breaks the contract ends the call."""
        try:
            self._file(msg)
        except ProtocolError:
            self.cancel()
            raise

    def _read(self) -> inference_pb2.GenerateResponse | None:
        """The next message; None once the stream ended (our own cancel included)."""
        if self._ended:
            return None
        try:
            with self._translating():
                msg: inference_pb2.GenerateResponse = next(self._call)
                return msg
        except StopIteration:
            self._ended = True
            return None
        except LayertapError as exc:
            cancelled, self._ended = self._cancelled, True
            if cancelled:  # our own cancel() surfaces as CANCELLED: a clean end
                return None
            self._call.cancel()
            _hint(exc)
            raise

    def _file(self, msg: inference_pb2.GenerateResponse) -> None:
        if msg.HasField("started"):
            raise ProtocolError(f"the Generate stream of {self.request_id} sent a second GenerationStarted")
        if msg.HasField("finished"):
            self._finished = msg.finished
        if not (msg.tokens or msg.summaries or msg.captures):
            return
        step = step_from_proto(msg, as_torch=self._as_torch)
        for token in step.tokens:
            if token.sequence >= len(self._sequences):
                raise ProtocolError(f"a token of sequence {token.sequence}, of {len(self._sequences)} prompts")
            self._sequences[token.sequence].append(token.id)
            self._pieces[token.sequence].append(token.text)
        self._steps.append(step)

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> GenerationStep:
        while not self._steps:
            msg = None if self._cancelled else self._read()
            if msg is None:
                if self._finished is None and not self._cancelled:
                    raise ProtocolError(f"the Generate stream of {self.request_id} ended before its "
                                        "GenerationFinished")
                raise StopIteration
            self._take(msg)
        return self._steps.popleft()

    @property
    def done(self) -> bool:
        """Whether the server's GenerationFinished arrived."""
        return self._finished is not None

    def cancel(self) -> None:
        """Stops the generation: the server ends it at its next step. Idempotent.

        Iteration then ends; :meth:`result` raises unless the generation had
        already finished.
        """
        if self._finished is None:
            self._cancelled = True
            self._steps.clear()
        if not self._ended:
            self._ended = True
            self._call.cancel()

    def result(self) -> GenerationResult:
        """Reads the rest of the stream and returns the whole generation.

        Raises:
            LayertapError: Code ``CANCELLED`` after :meth:`cancel`; any error
                the stream raises (see the class).
        """
        for _ in self:
            pass
        f = self._finished
        if f is None:
            raise LayertapError(f"generation {self.request_id} was cancelled before it finished", code="CANCELLED")
        return GenerationResult(
            request_id=self.request_id,
            prompts=[list(p) for p in self.prompts],
            sequences=[list(s) for s in self._sequences],
            texts=["".join(pieces) for pieces in self._pieces],
            finish_reasons=[_FINISH_REASONS.get(r, "unspecified") for r in f.finish_reasons],
            prompt_tokens=f.prompt_tokens,
            generated_tokens=f.generated_tokens,
            time_to_first_token=f.time_to_first_token_seconds,
            time_per_output_token=f.time_per_output_token_seconds,
            dropped=f.dropped,
        )

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cancel()

    def __repr__(self) -> str:
        state = "done" if self.done else "cancelled" if self._cancelled else "running"
        return f"<layertap.Generation {self.request_id} {len(self.prompts)} sequence(s) {state}>"


def generate(
    transport: Transport,
    prompt: Prompt,
    *,
    as_torch: bool = False,
    timeout: float | None = None,
    **options: Any,
) -> Generation:
    """Makes the Generate call of ``Client.generate`` (see there) on ``transport``.

    ``options`` are :func:`generate_request`'s keywords.
    """
    req = generate_request(prompt, **options)
    if as_torch:
        require_torch()  # before the server does any work
    call = transport.stream(GENERATE, req, timeout=timeout, open_ended=True, layer_hint=True)
    return Generation(call, lambda: transport.translating(layer_hint=True), as_torch=as_torch)
