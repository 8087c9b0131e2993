"""The model host: one forward pass at a time, each with a pass context.

Passes are serialised by a lock, so every hook firing belongs to exactly one
pass (and one request). Observers (taps, passive captures) are told when a
pass finishes, still under the lock, so per-pass state never interleaves.
What a hook knows of its pass (:class:`~.context.PassContext`) is
:mod:`.context`'s; a request's inputs are checked by :mod:`.validate`.

A training host (``training=True``, see :mod:`layertap.server.train`) hosts a
model the user's training loop runs: that thread opens and closes its passes
with :meth:`ModelHost.begin_pass`/:meth:`ModelHost.end_pass` and never takes
the model lock, so it never waits for an RPC that holds it to add hooks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from layertap.server.errors import InvalidField, LimitExceeded, Unsupported
from layertap.server.host import probe
from layertap.server.host.context import PHASE_DECODE, PHASE_NONE, PHASE_PREFILL, PassContext, PassObserver, RequestRows
from layertap.server.host.graph_slot import GraphServing
from layertap.server.host.hooks import CallArgs, HookRegistry, ParamGrad
from layertap.server.host.inputs import ModelInputs, as_positional
from layertap.server.host.model_thread import ModelThread, PassLock
from layertap.server.host.padding import declares_mask, host_mask
from layertap.server.host.sources import InputSpec, LoadedModel
from layertap.server.host.step_aside import Passes
from layertap.server.host.validate import check_inputs

# The pass's types are importable from here, where most stages have always found them.
__all__ = ["MODEL_ERROR_CHARS", "PHASE_DECODE", "PHASE_NONE", "PHASE_PREFILL", "PROBE_SECONDS", "LayerShapes", "ModelHost",
           "PassContext", "PassObserver", "RequestRows", "flatten_tensors", "model_message", "model_raised"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: Most seconds between two shape recordings while traffic flows.
PROBE_SECONDS = 1.0


#: How much of a model's exception message reaches the client.
MODEL_ERROR_CHARS = 200


def model_message(exc: BaseException) -> str:
    """The first line of a model's exception message, cut short: it names the problem
    without echoing tensor data or internals at length."""
    return (str(exc).strip().splitlines() or [""])[0][:MODEL_ERROR_CHARS]


def model_raised(exc: BaseException) -> InvalidField:
    """The forward raised on the caller's input: say what, briefly.

    The first line of the message only, cut short: it names the problem
    without echoing tensor data or internals at length.
    """
    first = model_message(exc)
    log.info("forward raised %s on a request's input", type(exc).__name__)
    log.debug("the forward's traceback", exc_info=exc)
    return InvalidField("inputs", f"model raised {type(exc).__name__}: {first}".rstrip(": "))


@dataclass
class LayerShapes:
    inputs: list[tuple[int, ...]]
    outputs: list[tuple[int, ...]]
    #: Calls in the probed pass (a module called twice per pass, e.g. a shared ReLU, is 2).
    calls: int = 1


def flatten_tensors(value: Any) -> list[tuple[str, torch.Tensor]]:
    """Tensors in a hook value with their key: ``""`` for a bare tensor,
    ``"0"``, ``"1"``... for tuples/lists, the dict key for dicts, and for a call's
    arguments (:class:`CallArgs`) the positional ones by position, then the
    keyword ones by path (``position_embeddings.0``)."""
    if isinstance(value, torch.Tensor):
        return [("", value)]
    if isinstance(value, CallArgs):
        return value.named_tensors()
    if isinstance(value, ParamGrad):
        return [(value.name, value.grad)] if isinstance(value.grad, torch.Tensor) else []
    if isinstance(value, dict):
        return [(str(k), v) for k, v in value.items() if isinstance(v, torch.Tensor)]
    if isinstance(value, (tuple, list)):
        return [(str(i), v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    return []


def _shapes(value: Any) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for _, t in flatten_tensors(value)]


class ModelHost:
    """Hosts one model on one device and runs its forward passes one at a time."""

    def __init__(self, loaded: LoadedModel, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, training: bool = False, passes: Passes | None = None) -> None:
        """Args:
            passes: The process's pass registry (``app.py`` makes it): background compiles step aside
                while this host's model thread runs a pass. None: nothing compiles beside it.
            training: The model belongs to a training loop: it is not moved or
                cast, ``run`` is refused (it would change its state), and
                parameter gradients are read when the loop says they are ready
                (:meth:`read_param_grads`).
        """
        self.loaded = loaded
        self.device = torch.device(device)
        self.dtype = dtype
        self.training = training
        module = loaded.module
        if training:
            pass  # the user's model stays where and what it is
        elif loaded.hooks_supported:
            module = module.to(device=self.device, dtype=dtype)
        else:
            module = module.to(self.device)
        self.module: nn.Module = module
        self.inputs: list[InputSpec] = [
            dataclasses.replace(s, dtype=dtype if s.dtype.is_floating_point else s.dtype) for s in loaded.inputs
        ]
        #: Whether the model declares an attention mask: its passes may leave padding out of taps.
        self.masked = declares_mask(self.inputs)
        self._lock = PassLock()
        #: Runs the server's own passes (Infer, captures, replays, Explain): see model_thread.
        self.model_thread = ModelThread(passes=passes)
        self._counter = itertools.count()
        self._current: PassContext | None = None
        # Copy-on-write under its own small lock: observers can leave from
        # any thread (even gRPC's callback thread) without the model lock.
        self._observers: tuple[PassObserver, ...] = ()
        self._observers_lock = threading.Lock()
        self.passes = 0
        #: ``(rank, world_size)`` of a training agent's process; stamped on summaries and metadata.
        self.rank: tuple[int, int] | None = None
        #: While True, hooks ignore firings: an evaluation forward inside a training step.
        self.quiet = False
        self.hooks = HookRegistry(self.module, lambda: None if self.quiet else self._current,
                                  deferred_param_grads=training, raw_pass=lambda: self._current)
        self._probe: probe.ProbeHooks | None = None
        self._modules = dict(self.module.named_modules()) if loaded.hooks_supported else {"": self.module}
        self.layer_shapes: dict[str, LayerShapes] = {}
        self._probe_armed = loaded.hooks_supported
        self._last_probe = -math.inf
        #: Serves Infer passes compiled (``serve --compile-model``); None: eager only.
        self.graph: GraphServing | None = None

    def free_dims(self) -> dict[int | str, tuple[int, ...]]:
        """Each input's free dims (size -1), by position and by name: what a compiled graph keeps dynamic."""
        free: dict[int | str, tuple[int, ...]] = {}
        for i, spec in enumerate(self.inputs):
            free[i] = free[spec.name] = tuple(d for d, size in enumerate(spec.shape) if size == -1)
        return free

    def attach_graph(self, graph: GraphServing) -> None:
        """Serve Infer passes from compiled variants (``app.py`` builds them); the untapped graph compiles
        now, in the background. Explain, captures, replays and Generate keep the eager module."""
        self.graph = graph
        if any(d < -1 for spec in self.inputs for d in spec.shape):
            return  # no example to compile ahead from: the first pass queues it
        # Free dims as 2: torch specializes sizes 0 and 1, a traced 2 stays dynamic.
        zeros = {s.name: torch.zeros([2 if d == -1 else d for d in s.shape], dtype=s.dtype, device=self.device)
                 for s in self.inputs if s.required}
        # Bound as warm_up's and a client's passes are: one input by position, several by name.
        example = ModelInputs.positional(list(zeros.values())) if len(zeros) == 1 else ModelInputs((), zeros)
        if not self.loaded.keywords:
            example = as_positional(example, self.inputs)
        graph.prepare(example.args, example.kwargs)

    def graph_stats(self) -> dict[str, int]:
        """The compiled-serving fields of ``GetServerStatsResponse`` (none when serving eager)."""
        return {} if self.graph is None else self.graph.serving_stats()

    # -- introspection -------------------------------------------------------
    @property
    def layer_names(self) -> list[str]:
        """Qualified module names, ``""`` (the root) excluded."""
        return [n for n in self._modules if n]

    @property
    def modules(self) -> dict[str, nn.Module]:
        return self._modules

    @property
    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    def add_observer(self, observer: PassObserver) -> None:
        with self._observers_lock:
            self._observers = (*self._observers, observer)

    def remove_observer(self, observer: PassObserver) -> None:
        """Never waits for a running pass."""
        with self._observers_lock:
            self._observers = tuple(o for o in self._observers if o is not observer)

    def pass_lock(self) -> PassLock:
        """The lock that serialises passes; hold it to change hooks between passes."""
        return self._lock

    def model_wanted(self) -> bool:
        """Whether another pass or a hook change waits for the model: a generation's run of steps yields."""
        return self._lock.wanted or self.model_thread.waiting

    def arm_shape_probe(self) -> None:
        """Record every module's shapes on the next pass (cheap: one pass only)."""
        self._probe_armed = self.loaded.hooks_supported

    # -- passes --------------------------------------------------------------
    def validate_inputs(self, inputs: Sequence[torch.Tensor | tuple[str, torch.Tensor]] | ModelInputs,
                        field_name: str = "inputs") -> ModelInputs:
        """Bind the tensors to the declared inputs (see :mod:`.inputs`) and
        check count, names, dtype and shape against them.

        ``inputs`` are bare tensors (positional), ``(name, tensor)`` pairs
        (``""`` is positional), or already bound :class:`ModelInputs`.

        Raises:
            InvalidField: A missing, unexpected or repeated name, a wrong
                count, dtype or shape; the field names ``inputs[i]`` (or the
                input's name, for a named one).
            Unsupported: On a training host (FAILED_PRECONDITION): a pass of a
                client's input would run the training model, changing its
                BatchNorm statistics, dropout's RNG and its autograd graph.
        """
        if self.training:
            raise Unsupported(f"{field_name}: this is a training agent (layertap.attach); it observes the training "
                              "loop's own steps only, and Infer or an active capture would change the training "
                              "model's state", reason="TRAINING_AGENT", field=field_name)
        return check_inputs(inputs, self.inputs, field_name)

    def _spec_of(self, inputs: ModelInputs) -> list[InputSpec]:
        """The declared spec of each tensor, in :meth:`ModelInputs.tensors` order."""
        by_name = {s.name: s for s in self.inputs}
        return [*self.inputs[:len(inputs.args)], *(by_name[k] for k in inputs.kwargs)]

    def to_device(self, inputs: ModelInputs, *, copy: bool = False) -> ModelInputs:
        """The inputs on the model's device in their declared dtypes, ready for :meth:`forward`."""
        specs = self._spec_of(inputs)
        return inputs.map(lambda t, i: t.to(self.device, dtype=specs[i].dtype, non_blocking=True, copy=copy))

    def forward(self, inputs: ModelInputs) -> Any:
        """Call the module: positional, then keyword inputs (in declared order for a positional-only model)."""
        if not self.loaded.keywords:
            inputs = as_positional(inputs, self.inputs)
        return inputs.call(self.module)

    @contextlib.contextmanager
    def pass_context(self, *, step: int | None = None, active_owner: object | None = None,
                     inputs: ModelInputs | None = None, phase: int = PHASE_NONE,
                     requests: tuple[RequestRows, ...] = (), tokens: int = 0,
                     attention_mask: torch.Tensor | None = None) -> Iterator[PassContext]:
        """Hold the model for one pass. In-process users (training loops) run
        forward and backward inside; observers are told when it exits.

        ``phase``, ``requests`` and ``tokens`` place a generation's step (see
        :class:`PassContext`). ``attention_mask`` is the pass's mask on the
        host when ``inputs`` do not hold it (a Generate prefill's); it is
        ignored for a model that declares none."""
        with self._lock:
            ctx = self.begin_pass(step=step, active_owner=active_owner)
            ctx.inputs = inputs
            ctx.phase, ctx.requests, ctx.tokens = phase, requests, tokens
            if self.masked:
                ctx.attention_mask = attention_mask if attention_mask is not None else host_mask(inputs, self.inputs)
            try:
                yield ctx
            except BaseException:
                ctx.failed = True
                raise
            finally:
                self.end_pass(ctx)

    def current_pass_index(self) -> int | None:
        """The index of the pass running now, if any (any thread: a snapshot)."""
        ctx = self._current
        return None if ctx is None else ctx.index

    def begin_pass(self, *, step: int | None = None, active_owner: object | None = None) -> PassContext:
        """Make a new pass current. The caller serialises passes: the model
        lock (:meth:`pass_context`), or being the training loop's thread."""
        ctx = PassContext(next(self._counter), active_owner=active_owner, step=step)
        # Observers that arrive mid-pass (a training step runs while RPCs add
        # captures) start with the next pass, as their hooks do.
        ctx.observers = self._observers
        self._current = ctx
        # Shapes are recorded on one pass per PROBE_SECONDS (or the next
        # pass after ListLayers): one pass's hooks (host.probe), cheap on average.
        now = time.monotonic()
        # Not on a compiled host: a probing pass runs eager (only armed ones: warm-up, ListLayers).
        due = self.loaded.hooks_supported and self.graph is None and now - self._last_probe >= PROBE_SECONDS
        self._probe = self._start_probe() if (self._probe_armed or due) else None
        return ctx

    def end_pass(self, ctx: PassContext) -> None:
        """Finish the current pass and tell the observers that were there when it began."""
        if self._probe is not None:
            self._probe.remove()
            self._probe = None
        self._current = None
        self.passes += 1
        current = self._observers
        for obs in ctx.observers:
            if obs in current:  # one that left meanwhile is not told
                obs.pass_finished(ctx)

    def read_param_grads(self) -> None:
        """A training step's gradients are final: fire the ``param_grad`` hooks."""
        self.hooks.read_param_grads()

    def on_model_thread(self, fn: Callable[..., _T], *args: object) -> _T:
        """``fn(*args)`` on the model thread (see :mod:`.model_thread`), for every
        server-side pass; inline for a caller already holding the model lock."""
        return self.model_thread.call(fn, *args, inline=self._lock._is_owned())

    def run(self, inputs: Sequence[torch.Tensor | tuple[str, torch.Tensor]] | ModelInputs, *,
            active_owner: object | None = None) -> tuple[Any, PassContext]:
        """Validate, then move to the device and run one inference pass on the model thread.

        The move happens under the model lock: requests waiting for the model
        hold host tensors only, not a device copy each.

        Raises:
            Unsupported: On a training host (FAILED_PRECONDITION): a pass of
                the client's input would run the training model, changing
                BatchNorm statistics, dropout's RNG and the autograd graph.
        """
        bound = self.validate_inputs(inputs)
        return self.on_model_thread(self._run_here, bound, active_owner)

    def _run_here(self, inputs: ModelInputs, active_owner: object | None) -> tuple[Any, PassContext]:
        try:
            with self.pass_context(active_owner=active_owner, inputs=inputs) as ctx, torch.inference_mode():
                out = self._forward_pass(self.to_device(inputs), ctx)
        except torch.OutOfMemoryError:
            raise LimitExceeded("the device ran out of memory for this pass; send a smaller batch") from None
        except Exception as exc:  # noqa: BLE001 - the caller's input made the model raise
            raise model_raised(exc) from None
        return out, ctx

    def _forward_pass(self, inputs: ModelInputs, ctx: PassContext) -> Any:
        """A compiled variant when one serves this pass (:meth:`CompiledServing.serve`), else the eager module.

        Active captures' passes and shape-probing passes run eager: their hooks are on the eager module."""
        graph = self.graph
        if graph is not None and ctx.active_owner is None and self._probe is None:
            bound = inputs if self.loaded.keywords else as_positional(inputs, self.inputs)
            served, out = graph.serve(bound.args, bound.kwargs, ctx)
            if served:
                return out
        return self.forward(inputs)

    def _start_probe(self) -> probe.ProbeHooks:
        self._probe_armed = False
        self._last_probe = time.monotonic()
        shapes = self.layer_shapes
        calls: dict[str, int] = {}

        def record(name: str, _module: nn.Module, args: Any, kwargs: dict[str, Any], out: Any) -> None:
            calls[name] = calls.get(name, 0) + 1
            shapes[name] = LayerShapes(_shapes(CallArgs(args, kwargs) if kwargs else args), _shapes(out), calls[name])

        return probe.install(self._modules, record)  # for this pass only, under the model lock

    def warm_up(self) -> None:
        """Run one batch-1 pass on zeros so shapes are known before traffic."""
        if self.training:
            return  # the training loop's first step records them
        if any(d < -1 for spec in self.inputs for d in spec.shape):
            return
        zeros = {s.name: torch.zeros([1 if d == -1 else d for d in s.shape], dtype=s.dtype)
                 for s in self.inputs if s.required}
        # One input goes positionally, as before names existed; several by name, as a client sends them.
        dummy = ModelInputs.positional(list(zeros.values())) if len(zeros) == 1 else ModelInputs((), zeros)
        self._probe_armed = self.loaded.hooks_supported
        self.on_model_thread(self._warm_up_here, dummy)

    def _warm_up_here(self, dummy: ModelInputs) -> None:
        with self.pass_context(active_owner="warm-up"), torch.inference_mode():
            self.forward(self.to_device(dummy))


