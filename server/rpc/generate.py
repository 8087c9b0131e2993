"""``InferenceService.Generate``: checks the request, owns its inline taps and
captures, and streams the generator's steps (:mod:`layertap.server.generate.generator`).

Summaries of the call's inline taps travel through the broker like any
stream tap's (a slow client loses them, counted in ``dropped``); tokens never
are lost. Everything the call holds goes when the client does: its generation
stops at the next step, its taps and subscription are removed.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from layertap.server.codec import TORCH_BY_WIRE, tensor_to_proto
from layertap.server.errors import InvalidField, LayerNotFound, Unsupported
from layertap.server.generate.request import FINISH_STOP, Finished, GenerationRequest, Reserve, Sampling, StepEvent
from layertap.server.rpc.auth import require
from layertap.server.rpc.ownership import create_owned
from layertap.server.rpc.state import ServerState
from layertap.server.stream.broker import Subscription
from layertap.server.taps.capture_limits import CaptureBudget, CaptureSlot
from layertap.server.taps.capture_options import MAX_CAPTURE_LAYERS
from layertap.server.taps.selectors import select_layers
from layertap.server.taps.tap import Tap
from layertap.v1 import inference_pb2 as ipb
from layertap.v1 import telemetry_pb2 as pb
from layertap.v1 import tensor_pb2

log = logging.getLogger(__name__)

#: New tokens per sequence when the request says 0.
DEFAULT_NEW_TOKENS = 16
#: Seconds between two looks at the call's summaries while no step arrives.
POLL_SECONDS = 0.05
#: Longest prompt text accepted, in characters, before tokenizing.
MAX_TEXT_CHARS = 1 << 20
#: Most stop ids and inline taps one request may name (captures: Capture's own cap).
MAX_STOP_IDS = 1024
MAX_REQUEST_TAPS = 16
_CAPTURE_DTYPES = {tensor_pb2.DATA_TYPE_FLOAT16, tensor_pb2.DATA_TYPE_BFLOAT16}
_FINISH = {FINISH_STOP: ipb.FINISH_REASON_STOP}


def _prompts(request: ipb.GenerateRequest, tokenizer: Any, max_rows: int, max_positions: int | None
             ) -> list[list[int]]:
    """Each prompt's ids, after bounds that keep the work before a refusal small (counts, lengths)."""
    if request.prompts and request.texts:
        raise InvalidField("texts", "give prompts (token ids) or texts, not both")
    field, count = ("texts", len(request.texts)) if request.texts else ("prompts", len(request.prompts))
    if count > max_rows:
        raise InvalidField(field, f"at most {max_rows} sequences per request (serve --max-generate-rows), got {count}")
    if not request.texts:
        for i, p in enumerate(request.prompts):
            if max_positions is not None and len(p.ids) >= max_positions:
                raise InvalidField(f"prompts[{i}]", f"{len(p.ids)} tokens: the model has {max_positions} positions, "
                                                    "and a prompt must leave room for one new token")
        return [list(p.ids) for p in request.prompts]
    if tokenizer is None:
        raise Unsupported("texts: the model directory holds no tokenizer; send prompts as token ids",
                          reason="NO_TOKENIZER", field="texts")
    for i, text in enumerate(request.texts):  # every length before any tokenizing
        if len(text) > MAX_TEXT_CHARS:
            raise InvalidField(f"texts[{i}]", f"at most {MAX_TEXT_CHARS} characters, got {len(text)}")
    return [[int(t) for t in tokenizer(text)["input_ids"]] for text in request.texts]


def _sampling(request: ipb.GenerateRequest) -> Sampling:
    sampling = Sampling(do_sample=request.do_sample, temperature=request.temperature or 1.0,
                        top_k=request.top_k, top_p=request.top_p or 1.0,
                        seed=request.seed if request.has_seed else None)
    sampling.check()  # NaN or out of range is an error even for greedy: the caller meant something
    return sampling


def _reserver(budget: CaptureBudget) -> Reserve:
    """Takes a step's capture bytes from the server-wide capture budget while they wait for the client."""
    def reserve(nbytes: int) -> Callable[[], object] | None:
        reservation = budget.reservation()
        if reservation.grow(nbytes):
            return reservation.release
        budget.count_skipped()
        return None

    return reserve


class _Pieces:
    """Each new token's text, decoded incrementally per sequence (what it adds to the text so far)."""

    def __init__(self, tokenizer: Any, sequences: int) -> None:
        self._tokenizer = tokenizer
        self._ids: list[list[int]] = [[] for _ in range(sequences)]
        self._text = ["" for _ in range(sequences)]

    def piece(self, sequence: int, token: int) -> str:
        if self._tokenizer is None:
            return ""
        ids = self._ids[sequence]
        ids.append(token)
        text = self._tokenizer.decode(ids, skip_special_tokens=False)
        # A token that ends inside a multi-byte character decodes to U+FFFD until the next one completes it.
        if text.endswith("\ufffd"):
            return ""
        before, self._text[sequence] = self._text[sequence], text
        return text[len(before):] if text.startswith(before) else text


class GenerateCall:
    """One Generate call's resources; :meth:`finish` runs once, from either the stream or gRPC's callback."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.taps: list[Tap] = []
        self.sub: Subscription | None = None
        self.request: GenerationRequest | None = None
        #: A --max-concurrent-captures slot, for a call with captures.
        self.slot: CaptureSlot | None = None
        self._done = threading.Event()

    def finish(self) -> None:
        if self._done.is_set():
            return
        self._done.set()
        if self.request is not None:
            self.request.cancel()
            self.request.close()
        if self.slot is not None:
            self.slot.release()
        if self.sub is not None:
            self.state.broker.unsubscribe(self.sub)
        for tap in self.taps:
            try:
                self.state.taps.delete(tap.id, reason="ended")
            except Exception:  # noqa: BLE001 - already gone
                pass

    def summaries(self) -> list[pb.Summary]:
        """Every summary waiting in the call's queue, without blocking."""
        out: list[pb.Summary] = []
        while self.sub is not None:
            batch = self.sub.get(timeout=0)
            if batch is None:
                break
            out.extend(batch.summaries)
        return out


def generate(state: ServerState, request: ipb.GenerateRequest,
             context: grpc.ServicerContext) -> Iterator[ipb.GenerateResponse]:
    """The Generate stream: started, one message per step, finished (see the proto)."""
    generator = state.generator
    if generator is None:
        raise Unsupported(f"this model cannot generate: {state.cannot_generate}", reason="CANNOT_GENERATE")
    for what, count, cap in (("stop_token_ids", len(request.stop_token_ids), MAX_STOP_IDS),
                             ("capture", len(request.capture), MAX_CAPTURE_LAYERS),
                             ("taps", len(request.taps), MAX_REQUEST_TAPS)):
        if count > cap:
            raise InvalidField(what, f"at most {cap} per request, got {count}")
    prompts = _prompts(request, generator.tokenizer, generator.max_rows, generator.max_positions)
    max_new = request.max_new_tokens or min(DEFAULT_NEW_TOKENS, generator.max_new_tokens)
    generator.check_prompts(prompts, max_new, "texts" if request.texts else "prompts")
    sampling = _sampling(request)
    for i, token in enumerate(request.stop_token_ids):
        generator.check_ids([token], f"stop_token_ids[{i}]")
    if request.capture_dtype and request.capture_dtype not in _CAPTURE_DTYPES:
        raise InvalidField("capture_dtype", "DATA_TYPE_FLOAT16 or DATA_TYPE_BFLOAT16 (or unset: as computed)")
    layers: list[str] = []
    chosen: set[str] = set()
    if request.capture:
        require(context, "capture", "Generate with capture")
        for i, selector in enumerate(request.capture):
            try:
                found = select_layers(selector, state.host.layer_names, f"capture[{i}]")
            except LayerNotFound as exc:
                raise LayerNotFound(f"capture[{i}]: {exc}", layer=selector, field=f"capture[{i}]",
                                    suggestions=exc.metadata.get("suggestions", "").split(",")) from None
            layers += [n for n in found if n not in chosen]
            chosen.update(found)
    if request.taps:
        require(context, "tap", "Generate with taps")
    request_id = f"gen-{secrets.token_hex(6)}"
    call = GenerateCall(state)
    try:
        for i, spec in enumerate(request.taps):
            call.taps.append(create_owned(state.taps, spec, context, kind=pb.TAP_KIND_STREAM,
                                          field_prefix=f"taps[{i}]", request_id=request_id))
        if call.taps:
            call.sub = state.broker.subscribe([t.id for t in call.taps])
        if layers:
            call.slot = state.captures.acquire()  # counts against --max-concurrent-captures, as Capture does
        call.request = GenerationRequest(
            request_id, prompts, max_new_tokens=max_new, sampling=sampling, stop_ids=list(request.stop_token_ids),
            capture_layers=layers, capture_dtype=TORCH_BY_WIRE[request.capture_dtype] if request.capture_dtype else None,
            capture_bytes=state.config.max_capture_bytes, reserve=_reserver(state.capture_budget))
    except Exception:
        call.finish()
        raise
    if not context.add_callback(call.finish):
        call.finish()  # the client left already
        return
    try:
        generator.submit(call.request)
        yield ipb.GenerateResponse(started=ipb.GenerationStarted(
            request_id=request_id, tap_ids=[t.id for t in call.taps],
            prompts=[ipb.TokenIds(ids=p) for p in prompts]))
        yield from _stream(state, call, call.request, generator.tokenizer, context)
    finally:
        call.finish()


def _stream(state: ServerState, call: GenerateCall, gen: GenerationRequest, tokenizer: Any,
            context: grpc.ServicerContext) -> Iterator[ipb.GenerateResponse]:
    pieces = _Pieces(tokenizer, len(gen.prompts))
    lost = 0  # step captures dropped while the client lagged
    for item in gen.events(POLL_SECONDS, alive=context.is_active):
        if item is None:
            waiting = call.summaries()
            if waiting:
                yield ipb.GenerateResponse(summaries=waiting)
            continue
        if isinstance(item, StepEvent):
            lost += item.dropped_captures
            yield ipb.GenerateResponse(
                phase=item.phase, step=item.step, summaries=call.summaries(),
                tokens=[ipb.GeneratedToken(sequence=t.sequence, id=t.id, position=t.position, logprob=t.logprob,
                                           text=pieces.piece(t.sequence, t.id)) for t in item.tokens],
                captures=[ipb.StepCapture(layer=layer, tensor=tensor_to_proto(tensor, layer), call_index=call_index,
                                          output_key=key)
                          for layer, call_index, key, tensor in item.captures])
            continue
        assert isinstance(item, Finished)
        if call.taps:
            state.taps.flush()  # the last steps' summaries are published before the final message
        yield ipb.GenerateResponse(summaries=call.summaries(), finished=ipb.GenerationFinished(
            prompt_tokens=item.prompt_tokens, generated_tokens=item.generated_tokens,
            time_to_first_token_seconds=item.time_to_first_token,
            time_per_output_token_seconds=item.time_per_output_token,
            finish_reasons=[_FINISH.get(r, ipb.FINISH_REASON_LENGTH) for r in item.reasons],
            dropped=lost + (call.sub.dropped if call.sub is not None else 0)))
