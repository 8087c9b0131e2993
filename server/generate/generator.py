"""Generation: a step loop over the model's own KV cache, one forward pass per step.

Why a loop of our own rather than ``model.generate``: every step must be a
pass of its own, so that taps, captures and ``/metrics`` see each token with
its phase and position, Infer calls run between two steps, a cancelled
request leaves at the next step, and new requests join a running batch at a
step boundary (continuous batching). The inputs are built as transformers'
``generate`` builds them: left padding with a 2-D attention mask, position
ids from the mask's running sum, the model's own ``DynamicCache`` (passed as
``cache=``), ``logits_to_keep=1``; sampling uses transformers' own logits
warpers. So greedy tokens equal ``model.generate(do_sample=False)``'s.

A joining request's prefill is a pass of its own (phase prefill); its cache
rows are then left-padded to the running batch's length and concatenated,
and one decode pass serves every running row. A pass is never part prefill,
part decode. A cache whose layers are not all plain ``DynamicLayer`` (sliding
windows, quantized caches) cannot be concatenated this way: requests then
join only an empty batch.

Reading each step's chosen ids back to the host is one synchronisation per
step, as in transformers' own loop (its stopping criteria read them too): the
tokens are what the client streams. Tap hooks stay sync-free.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from layertap.server.errors import InvalidField, LayertapServerError, LimitExceeded, NonfiniteLogits, Unavailable
from layertap.server.generate.batch import Batch, Row, groups, left_pad
from layertap.server.generate.request import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationListener,
    GenerationRequest,
    NoListener,
    StepEvent,
    TokenEvent,
    log_normalizer,
)
from layertap.server.host.model_host import (
    PHASE_DECODE,
    PHASE_PREFILL,
    ModelHost,
    PassContext,
    RequestRows,
    flatten_tensors,
    model_message,
)
from layertap.server.host.padding import left_padding_mask
from layertap.server.host.rows import RequestCut, find_request

__all__ = ["Generator"]

log = logging.getLogger(__name__)

#: Rows decoded together at most; more wait for rows to free. Decode steps one model-thread call runs at most.
DEFAULT_MAX_ROWS, MAX_RUN = 16, 32


class Generator:
    """Runs every Generate request of one model: one thread, a step at a time.

    Steps run on the host's model thread, back to back while nothing else
    wants the model; a queued Infer call, a thread waiting for the model
    lock (a tap change) or a new request ends the run, so they go between
    two steps, never starved by a long generation.
    """

    def __init__(self, host: ModelHost, *, max_new_tokens: int, max_rows: int = DEFAULT_MAX_ROWS,
                 listener: GenerationListener | None = None, tokenizer: Any = None) -> None:
        self.host = host
        self.max_new_tokens = max_new_tokens
        self.max_rows = max_rows
        self.listener: GenerationListener = listener or NoListener()
        self.tokenizer = tokenizer
        module = host.module
        self._params = set(inspect.signature(module.forward).parameters)
        self._cache_arg = "cache" if "cache" in self._params else "past_key_values"
        config = getattr(module, "config", None)
        self.max_positions: int | None = next(
            (v for v in (getattr(config, n, None) for n in ("max_position_embeddings", "n_positions"))
             if isinstance(v, int)), None)
        self.vocab: int | None = getattr(config, "vocab_size", None)
        gen_config = getattr(module, "generation_config", None)
        eos = getattr(gen_config, "eos_token_id", None)
        self.eos_ids: frozenset[int] = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self._pending: list[GenerationRequest] = []
        self._cond = threading.Condition()
        self._closed = False
        self._batch: Batch | None = None
        self._capture_hooks: dict[str, list[Any]] = {}
        self._step_captures: dict[str, list[tuple[str, int, str, torch.Tensor]]] = {}
        self._thread = threading.Thread(target=self._loop, name="layertap-generate", daemon=True)
        self._thread.start()

    # -- admission --------------------------------------------------------------
    @staticmethod
    def can_generate(host: ModelHost) -> str | None:
        """None when the model can generate here, else why not."""
        module = host.module
        if host.training:
            return "this is a training agent (layertap.attach); it does not serve generation"
        can = getattr(module, "can_generate", None)
        if not callable(can) or not can():
            return (f"the model ({type(module).__name__}, source {host.loaded.source!r}) has no language-model "
                    "head that generates; serve a causal LM with --model hf:DIR")
        if not host.loaded.keywords:
            return "the model takes positional inputs only, so it cannot be given a KV cache"
        return None

    def check_prompts(self, prompts: list[list[int]], max_new_tokens: int, field_name: str = "prompts") -> None:
        """Raises InvalidField naming the prompt or field that cannot be served."""
        if not prompts:
            raise InvalidField(field_name, "give at least one prompt (prompts or texts)")
        if len(prompts) > self.max_rows:
            raise InvalidField(field_name, f"at most {self.max_rows} sequences per request, got {len(prompts)}")
        if max_new_tokens > self.max_new_tokens:
            raise InvalidField("max_new_tokens", f"at most {self.max_new_tokens} (serve --max-new-tokens), "
                                                 f"got {max_new_tokens}")
        for i, ids in enumerate(prompts):
            if not ids:
                raise InvalidField(f"{field_name}[{i}]", "a prompt needs at least one token")
            if self.max_positions is not None and len(ids) >= self.max_positions:
                raise InvalidField(f"{field_name}[{i}]", f"{len(ids)} tokens: the model has "
                                                         f"{self.max_positions} positions, and a prompt must leave "
                                                         "room for one new token")
            self.check_ids(ids, f"{field_name}[{i}]")

    def check_ids(self, ids: Sequence[int], field_name: str) -> None:
        """Raises InvalidField naming ``field_name`` when a token id is outside the model's vocabulary."""
        if self.vocab is None:
            return
        bad = next((t for t in ids if not 0 <= t < self.vocab), None)
        if bad is not None:
            raise InvalidField(field_name, f"token id {bad} is outside the model's vocabulary [0, {self.vocab})")

    def submit(self, request: GenerationRequest) -> None:
        """Queue ``request``; it joins the running batch at the next step."""
        if request.sampling.seed is not None:
            request.generator = torch.Generator(device=self.host.device)
            request.generator.manual_seed(request.sampling.seed)
        with self._cond:
            if self._closed:
                raise Unavailable("the server is shutting down; retry on another replica")
            self.listener.started()  # before the loop can see it, so it is never finished before it started
            self._pending.append(request)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)

    # -- the loop ---------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._pending and self._batch is None:
                    self._cond.wait()
                if self._closed:
                    pending, self._pending = self._pending, []
                    break
                for request in [r for r in self._pending if r.cancelled]:  # left while waiting for rows
                    self._pending.remove(request)
                    request._finish(self.listener)
                running = len(self._batch.rows) if self._batch is not None else 0
                joinable = self._batch is None or self._joinable(self._batch)
                take: list[GenerationRequest] = []
                while self._pending and joinable and running + len(self._pending[0].prompts) <= self.max_rows:
                    request = self._pending.pop(0)
                    running += len(request.prompts)
                    take.append(request)
            try:
                self.host.on_model_thread(self._iteration, take)
            except BaseException as exc:
                log.exception("generation step failed")
                self._fail_all(take, exc)
        closing = Unavailable("the server is shutting down; its generations stopped")
        for request in pending:
            request._finish(self.listener, closing)
        if self._batch is not None:
            for request in {id(r.request): r.request for r in self._batch.rows}.values():
                self._remove_captures(request)
                request._finish(self.listener, closing)

    def _fail_all(self, joining: list[GenerationRequest], exc: BaseException) -> None:
        error = exc if isinstance(exc, LayertapServerError) else _model_fault(exc)
        requests = {id(r): r for r in joining}
        if self._batch is not None:
            requests.update({id(r.request): r.request for r in self._batch.rows})
        for request in requests.values():
            self._remove_captures(request)
            request._finish(self.listener, error)
        self._batch = None

    def _joinable(self, batch: Batch) -> bool:
        layers = getattr(batch.cache, "layers", None)
        return layers is not None and all(type(layer).__name__ == "DynamicLayer" for layer in layers)

    def _iteration(self, joining: list[GenerationRequest]) -> None:
        """One step boundary: drop cancelled rows, decode the running rows, then prefill the joining
        requests and stack them on. Running rows advance in every iteration: arrivals never stall them."""
        joining = [r for r in joining if not self._left(r)]
        if self._batch is not None:
            self._drop_finished(self._batch)
            # Steps back to back while nothing else wants the model (a hand-off per step cost ~0.5-1 ms).
            for _ in range(MAX_RUN):
                if not self._batch.rows:
                    break
                self._decode(self._batch)
                self._drop_finished(self._batch)
                if joining or self._closed or self.host.model_wanted() or self._stop_run(self._batch):
                    break
            if not self._batch.rows:
                self._batch = None
        if joining:
            self._add_captures(joining)
            try:
                fresh = self._prefill(joining)
            except Exception as exc:  # noqa: BLE001 - the joining requests end; the running ones go on
                error = exc if isinstance(exc, LayertapServerError) else _model_fault(exc)
                for request in joining:
                    self._remove_captures(request)
                    request._finish(self.listener, error)
                return
            self._drop_finished(fresh)
            if fresh.rows:
                self._batch = fresh if self._batch is None else self._merge(self._batch, fresh)

    def _stop_run(self, batch: Batch) -> bool:
        """Whether a run of steps ends here: a pending request can join (or was cancelled), or a running
        request streams step captures (their bytes are charged until its client takes them: one step a call)."""
        pending = list(self._pending)
        if any(r.capture_layers for r in {id(row.request): row.request for row in batch.rows}.values()):
            return True
        return bool(pending) and (any(r.cancelled for r in pending) or (
            self._joinable(batch) and len(batch.rows) + len(pending[0].prompts) <= self.max_rows))

    def _left(self, request: GenerationRequest) -> bool:
        if request.cancelled:
            request._finish(self.listener)
            return True
        return False

    def _drop_finished(self, batch: Batch) -> None:
        """Rows that finished or were cancelled leave; a request whose rows all left is finished."""
        for row in batch.rows:
            if row.request.cancelled or row.request.done.is_set():  # a sibling row's NaN ended the request
                row.done = True
        for request, group in groups(batch.rows):
            if all(row.done for row in group):
                self._remove_captures(request)
                request._finish(self.listener)
        batch.keep([i for i, row in enumerate(batch.rows) if not row.done])

    # -- passes -----------------------------------------------------------------
    def _forward(self, phase: int, rows: list[Row], ids: torch.Tensor, mask: torch.Tensor,
                 position_ids: torch.Tensor, cache: Any, pads: list[int]) -> tuple[torch.Tensor, Any]:
        """One pass: the logits of each row's last position, and the cache."""
        requests: list[RequestRows] = []
        start = 0
        for request, group in groups(rows):
            n = len(group)
            positions = tuple(r.length for r in group)
            pad = min(pads[start:start + n]) if phase == PHASE_PREFILL else 0
            requests.append(RequestRows(request.id, slice(start, start + n), positions, pad))
            request.passes += 1
            start += n
        kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, self._cache_arg: cache,
                                  "use_cache": True}
        if "position_ids" in self._params:
            kwargs["position_ids"] = position_ids
        if "logits_to_keep" in self._params:
            kwargs["logits_to_keep"] = 1
        try:
            with self.host.pass_context(phase=phase, requests=tuple(requests), tokens=ids.shape[1],
                                        attention_mask=left_padding_mask(pads, ids.shape[1])), \
                    torch.inference_mode():
                out = self.host.module(**kwargs)
        except torch.OutOfMemoryError:
            raise LimitExceeded("the device ran out of memory for this generation step") from None
        except LayertapServerError:
            raise
        except Exception as exc:  # noqa: BLE001 - the prompts made the model raise
            raise _model_fault(exc) from None
        logits = out["logits"][:, -1, :]
        new_cache = out.get("cache", None) or out.get("past_key_values", None)
        return logits, new_cache

    def _prefill(self, joining: list[GenerationRequest]) -> Batch:
        rows = [Row(r, i, len(p)) for r in joining for i, p in enumerate(r.prompts)]
        width = max(row.length for row in rows)
        device = self.host.device
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        pads = []
        for i, row in enumerate(rows):
            prompt = row.request.prompts[row.sequence]
            pad = width - len(prompt)
            ids[i, pad:] = torch.tensor(prompt, dtype=torch.long)
            mask[i, pad:] = 1
            pads.append(pad)
        ids, mask = ids.to(device), mask.to(device)
        position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        logits, cache = self._forward(PHASE_PREFILL, rows, ids, mask, position_ids, None, pads)
        batch = Batch(rows, cache, mask, ids[:, -1:])
        self._choose(batch, logits, PHASE_PREFILL, step_of=lambda _row: 0)
        return batch

    def _decode(self, batch: Batch) -> None:
        ones = torch.ones((len(batch.rows), 1), dtype=batch.mask.dtype, device=batch.mask.device)
        batch.mask = torch.cat([batch.mask, ones], dim=1)
        position_ids = batch.mask.sum(-1, keepdim=True) - 1
        logits, cache = self._forward(PHASE_DECODE, batch.rows, batch.last, batch.mask, position_ids, batch.cache,
                                      [0] * len(batch.rows))
        batch.cache = cache
        self._choose(batch, logits, PHASE_DECODE, step_of=lambda row: len(row.request.generated[row.sequence]))

    def _merge(self, running: Batch, fresh: Batch) -> Batch:
        """The fresh rows join the running ones: both left-padded to one length, then stacked."""
        width = max(running.mask.shape[1], fresh.mask.shape[1])
        parts = []
        for b in (running, fresh):
            extra = width - b.mask.shape[1]
            parts.append((b, extra))
        mask = torch.cat([left_pad(b.mask, extra, 1) for b, extra in parts])
        last = torch.cat([running.last, fresh.last])
        for mine, theirs in zip(running.cache.layers, fresh.cache.layers):
            (_, ea), (_, eb) = parts
            mine.keys = torch.cat([left_pad(mine.keys, ea, -2), left_pad(theirs.keys, eb, -2)])
            mine.values = torch.cat([left_pad(mine.values, ea, -2), left_pad(theirs.values, eb, -2)])
        return Batch(running.rows + fresh.rows, running.cache, mask, last)

    def _choose(self, batch: Batch, logits: torch.Tensor, phase: int, step_of: Callable[[Row], int]) -> None:
        """Pick each row's next token, read them back (the step's one sync) and send each request its step."""
        logits = logits.float()
        chosen = torch.empty(len(batch.rows), dtype=torch.long, device=logits.device)
        shifted, lse, finite = log_normalizer(logits)
        start = 0
        for request, group in groups(batch.rows):
            part = slice(start, start + len(group))
            chosen[part], ok = request.sampling.pick(logits[part], request.generator)
            finite[part] &= ok
            start += len(group)
        logprob = shifted.gather(1, chosen[:, None])[:, 0] - lse  # log_softmax at the chosen token
        host = torch.stack([chosen.double(), logprob.double(), finite.double()], dim=1).tolist()
        now = time.monotonic()
        batch.last = chosen[:, None]
        captures = self._step_captures
        self._step_captures = {}
        tokens_out = 0
        events: dict[int, StepEvent] = {}
        for i, row in enumerate(batch.rows):
            request = row.request
            token, lp, ok = int(host[i][0]), host[i][1], host[i][2] == 1.0
            if not ok:
                row.done = True
                if not request.done.is_set():
                    self._remove_captures(request)
                    request._finish(self.listener, NonfiniteLogits(
                        f"the model's logits for sequence {row.sequence} held NaN or infinity at position "
                        f"{row.length}; the generation stopped"))
                continue
            if request.done.is_set():
                row.done = True
                continue
            step = step_of(row)
            event = events.get(id(request))
            if event is None:
                event = events[id(request)] = StepEvent(phase, step, [], captures.pop(request.id, []))
            event.tokens.append(TokenEvent(row.sequence, token, row.length, lp))
            request.generated[row.sequence].append(token)
            row.length += 1
            tokens_out += 1
            if token in request.stop_ids or token in self.eos_ids:
                row.done, request.reasons[row.sequence] = True, FINISH_STOP
            elif (len(request.generated[row.sequence]) >= request.max_new_tokens
                  or (self.max_positions is not None and row.length >= self.max_positions)):
                row.done, request.reasons[row.sequence] = True, FINISH_LENGTH
        for request, _group in groups(batch.rows):
            event = events.get(id(request))
            if event is None or request.done.is_set():
                continue
            event.captures = [(layer, call, key, t.cpu()) for layer, call, key, t in event.captures]
            if request._first is None:
                request._first = now
                self.listener.first_token(now - request.arrived)
            else:
                gap = now - (request._last or now)
                request._gaps += gap
                request._gap_count += 1
                self.listener.inter_token(gap, len(event.tokens))
            request._last = now
            request._put(event)
        if tokens_out:
            self.listener.tokens(tokens_out)

    # -- captures ----------------------------------------------------------------
    def _add_captures(self, joining: list[GenerationRequest]) -> None:
        from layertap.v1 import telemetry_pb2 as pb  # noqa: PLC0415 - the hook point's number only

        for request in joining:
            if not request.capture_layers:
                continue
            handles = []
            for layer in request.capture_layers:
                handles.append(self.host.hooks.add(layer, pb.POINT_OUTPUT, self._capturer(request, layer)))
            self._capture_hooks[request.id] = handles

    def _capturer(self, request: GenerationRequest, layer: str) -> Callable[[PassContext, Any], None]:
        seen = [-1, 0]  # pass index, calls of the layer in it

        def capture(ctx: PassContext, value: Any) -> None:
            rows = find_request(ctx, request.id)
            if rows is None:
                return
            if seen[0] != ctx.index:
                seen[:] = [ctx.index, 0]
            call, seen[1] = seen[1], seen[1] + 1
            cut = RequestCut(ctx, rows)
            taken = self._step_captures.setdefault(request.id, [])
            # A tuple or dict output (an attention block's) gives one capture per tensor, keyed as Capture keys them.
            for key, tensor in flatten_tensors(value):
                view = cut(tensor)
                if view is None:
                    continue  # it mixes this request's rows with others'
                dtype = request.capture_dtype if view.is_floating_point() and request.capture_dtype else view.dtype
                # A device copy now; it reaches the host after the step's token read-back.
                taken.append((layer, call, key, view.to(dtype=dtype, copy=True)))

        return capture

    def _remove_captures(self, request: GenerationRequest) -> None:
        self._step_captures.pop(request.id, None)  # device copies of a step it will never send
        for handle in self._capture_hooks.pop(request.id, []):
            handle.remove()


def _model_fault(exc: BaseException) -> LayertapServerError:
    """The model raised during a generation step: INTERNAL, since the prompts were checked before it ran."""
    first = model_message(exc)
    log.warning("generation step raised %s: %s", type(exc).__name__, first)
    return LayertapServerError(f"the model raised {type(exc).__name__} during generation: {first}".rstrip(": "))
