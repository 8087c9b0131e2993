"""The fused plan: validated reducers run on a tensor as one unit of device work.

A tap asks for reducers by :class:`~layertap.v1.telemetry_pb2.ReducerSpec`.
:func:`build_reducers` validates the specs once, host-side, and a
:class:`ReducerPlan` runs them all on a tensor as one fused plan whose output is
ONE 1-D float64 tensor on the tensor's device (the "slots"). The transfer
thread (:mod:`layertap.server.reducers.transfer`) copies a whole pass's slots
to the host in one asynchronous copy, and :meth:`ReducerPlan.decode` turns the
host array back into ``ReducerResult`` messages off the model thread.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from layertap.server.limits import MAX_REDUCERS_PER_TAP, MAX_SAMPLED_ELEMENTS
from layertap.server.reducers.base import Reducer
from layertap.server.reducers.basic import BASIC_REDUCERS, BasicReducer
from layertap.server.reducers.distribution import HistogramReducer, PerChannelReducer, QuantilesReducer
from layertap.server.reducers.kernel_slot import StatsKernel
from layertap.server.reducers.kernels import BASIC_WIDTH, StatNeeds, fused_basic_stats
from layertap.server.reducers.latency import LatencyReducer
from layertap.server.reducers.logits import LogitsReducer
from layertap.server.reducers.spec import SpecError, check_histogram, check_kind, check_per_channel, check_quantiles
from layertap.server.reducers.workspace import F64, DeviceCache, Workspace, device_constant
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["BasicLayout", "ReducerPlan", "ReuseKey", "build_reducers"]


class ReuseKey:
    """What makes two plans compute the same slots from one tensor, interned: equal plans hold the same
    key, so it hashes and compares by identity.

    Why: the key holds every reducer's parameters (a histogram's edges among them), and a tuple hashes
    itself anew on every lookup: with thirty taps sharing 67 layers' reductions, hashing it on each
    firing and each published piece cost more than the sharing saved.
    """

    __slots__ = ("parts", "__weakref__")

    def __init__(self, parts: tuple[object, ...]) -> None:
        self.parts = parts

    def __repr__(self) -> str:
        return f"ReuseKey({self.parts!r})"

    @classmethod
    def of(cls, parts: tuple[object, ...]) -> ReuseKey:
        """The one live key for these parts (kept while a plan holds it)."""
        with _KEYS_LOCK:
            key = _KEYS.get(parts)
            if key is None:
                key = _KEYS[parts] = cls(parts)
            return key


_KEYS: weakref.WeakValueDictionary[tuple[object, ...], ReuseKey] = weakref.WeakValueDictionary()
_KEYS_LOCK = threading.Lock()

#: A basic-only plan's results: (reducer, first slot, end slot) each, in the summary's order.
BasicLayout = tuple[tuple[BasicReducer, int, int], ...]

_SUPPORTED_DTYPES = frozenset(
    {
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int8, torch.int16, torch.int32, torch.int64,
        torch.uint8, torch.bool,
    }
)  # fmt: skip  (uint16/32/64 lack min/max kernels in torch)


def _build_one(spec: pb.ReducerSpec, field: str, tokens: bool) -> Reducer:
    """Builds one reducer; :mod:`~layertap.server.reducers.spec` validates its kind and parameters."""
    kind = check_kind(spec, field)
    if kind == pb.REDUCER_KIND_HISTOGRAM:
        return HistogramReducer(field, *check_histogram(field, spec.histogram))
    if kind == pb.REDUCER_KIND_QUANTILES:
        return QuantilesReducer(field, *check_quantiles(field, spec.quantiles))
    if kind == pb.REDUCER_KIND_PER_CHANNEL:
        return PerChannelReducer(field, *check_per_channel(field, spec.per_channel), tokens=tokens)
    if kind == pb.REDUCER_KIND_LATENCY:
        return LatencyReducer(field)
    if kind == pb.REDUCER_KIND_LOGITS:
        return LogitsReducer(field)
    return BASIC_REDUCERS[kind](field)


def build_reducers(specs: Sequence[pb.ReducerSpec], field_prefix: str = "reducers", *,
                   tokens: bool = False) -> list[Reducer]:
    """Validates reducer specs and builds the reducers, host-side and once.

    Args:
        specs: The requested reducers, in the order results will come back.
        field_prefix: Field path of ``specs`` in the request, for errors.
        tokens: Whether the model is a token model (its 3-d tensors are
            ``(batch, tokens, hidden)``): per-channel reducers without a dim
            then reduce over its last axis (:func:`~.spec.default_feature_axis`).

    Returns:
        One reducer per spec, in order.

    Raises:
        SpecError: On an unknown kind, a parameter out of range, parameters
            given for a kind that takes none (or another kind's), or a
            duplicate reducer (same kind and same effective parameters).
    """
    if len(specs) > MAX_REDUCERS_PER_TAP:
        raise SpecError(field_prefix, f"at most {MAX_REDUCERS_PER_TAP} reducers per tap, got {len(specs)}")
    reducers: list[Reducer] = []
    seen: dict[tuple[object, ...], int] = {}
    for i, spec in enumerate(specs):
        field = f"{field_prefix}[{i}]"
        reducer = _build_one(spec, field, tokens)
        key = reducer.key()
        if key in seen:
            raise SpecError(field, f"duplicate of {field_prefix}[{seen[key]}] ({reducer.name})")
        seen[key] = i
        reducers.append(reducer)
    # Reducers that sample at the same size share one sample (see Workspace).
    sampled = sum({r.sample_size for r in reducers if isinstance(r, (HistogramReducer, QuantilesReducer))})
    if sampled > MAX_SAMPLED_ELEMENTS:
        raise SpecError(field_prefix, f"the reducers sample {sampled} elements per tensor together, "
                                      f"the limit is {MAX_SAMPLED_ELEMENTS}; use fewer or smaller sample_size")
    return reducers


class ReducerPlan:
    """Runs a list of reducers on a tensor as one fused unit of device work.

    Args:
        reducers: Validated reducers, from :func:`build_reducers`.
        seed: Seed of the plan's private sampling generators (one per device);
            sampling never touches the global RNG, so taps do not change a
            model's dropout or data order.
    """

    def __init__(self, reducers: Sequence[Reducer], seed: int = 0, kernel: StatsKernel | None = None) -> None:
        self.reducers: tuple[Reducer, ...] = tuple(reducers)
        self.seed = seed
        #: The compiled basic-statistics kernel (the tap engine's, from ``app.py``); None: always eager.
        self.kernel = kernel
        needs = StatNeeds()
        for r in self.reducers:
            needs = needs | r.needs
        self._needs = needs
        self._needs_any = needs.any()  # dataclasses.astuple per run costs ~30 us on the hot path
        #: Whether runs compute the basic-statistics vector (the compiled kernel's work).
        self.needs_basic_stats = self._needs_any
        self._share_xd = any(r.reads_upcast for r in self.reducers)
        # Only shape-dependent reducers (per_channel) check anything per tensor.
        self._checked = tuple(r for r in self.reducers if type(r).check is not Reducer.check)
        basic = [r for r in self.reducers if isinstance(r, BasicReducer)]
        #: For a plan of basic reducers only, whose :meth:`run` returns the basic
        #: vector itself (no gather on the hot path: the host-transfer thread picks the
        #: slots): each reducer with its slice of it, for decoding and the wire path.
        self.basic_layout: BasicLayout | None = None
        if basic and len(basic) == len(self.reducers):
            self.basic_layout = tuple((r, *r.slots) for r in basic)
        self._slot_cache: DeviceCache = {}
        #: Whether the tap must time its layers (see :mod:`.latency`).
        self.timed = any(isinstance(r, LatencyReducer) for r in self.reducers)
        # Only latency: no device work at all (its value is a time, not a slot).
        self._slotless = bool(self.reducers) and all(isinstance(r, LatencyReducer) for r in self.reducers)
        self._generators: dict[torch.device, torch.Generator] = {}
        #: Equal for plans that compute the same slots from the same tensor
        #: (see :mod:`layertap.server.taps.reuse`); None for timed plans.
        self.reuse_key: ReuseKey | None = (
            None if self.timed else ReuseKey.of(tuple(r.key() for r in self.reducers)))
        self._folded: ReducerPlan | None = None

    def __len__(self) -> int:
        return len(self.reducers)

    def __repr__(self) -> str:
        return f"ReducerPlan([{', '.join(r.name for r in self.reducers)}])"

    def nonfinite_only(self) -> ReducerPlan | None:
        """The sub-plan to run on unsampled passes: just ``nonfinite``, or None."""
        kept = [r for r in self.reducers if r.kind == pb.REDUCER_KIND_NONFINITE]
        return ReducerPlan(kept, self.seed, self.kernel) if kept else None

    def folded(self) -> ReducerPlan:
        """The plan for ``(valid, ...)`` tensors a tap folded from ``(batch, tokens, ...)`` (``host.padding``).

        Only per-channel axes change (:meth:`PerChannelReducer.folded`); a plan
        without a per-channel reducer is its own folded plan. Made once.

        Raises:
            SpecError: A per-channel dim that names the batch or token axis.
        """
        if self._folded is None:
            if any(isinstance(r, PerChannelReducer) for r in self.reducers):
                self._folded = ReducerPlan([r.folded() if isinstance(r, PerChannelReducer) else r
                                            for r in self.reducers], self.seed, self.kernel)
            else:
                self._folded = self
        return self._folded

    def width(self, shape: Sequence[int]) -> int:
        """Total float64 slots of :meth:`run`'s output for a tensor of ``shape``.

        Raises:
            SpecError: When a reducer cannot apply to the shape (per_channel dim).
        """
        if self.basic_layout is not None:
            return BASIC_WIDTH
        return sum(r.width(shape) for r in self.reducers)

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._generators[device] = gen
        return gen

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """Reduces ``x`` on its device, without any host sync.

        Args:
            x: Any strided real, integer or bool tensor: any layout, 0-d or empty.

        Returns:
            A 1-D float64 tensor on ``x.device`` of ``width(x.shape)`` slots:
            for a plan of basic reducers only, the basic-statistics vector
            itself (each reducer reads its slice, :attr:`basic_layout`); else
            the reducers' slots concatenated in plan order.

        Raises:
            TypeError: For complex, quantized or non-strided tensors.
            SpecError: When a reducer cannot apply to ``x``'s shape.
        """
        if x.layout != torch.strided or x.is_quantized or x.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(f"reducers need a strided real, integer or bool tensor, got {x.dtype} ({x.layout})")
        for r in self._checked:
            r.check(x.shape)
        if not self.reducers:
            return x.new_zeros((0,), dtype=F64)
        if self._slotless:
            return device_constant(self._slot_cache, (), x.device)
        if x.requires_grad:
            x = x.detach()
        if torch.is_grad_enabled():  # a training step's hook: nothing here may join its graph
            with torch.no_grad():
                return self._reduce(x)
        return self._reduce(x)  # a server pass (inference mode): the context manager would only cost time

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        ws = Workspace(x, self._generator(x.device), self._share_xd)
        if self._needs_any:
            # The compiled kernel once its signature is ready, else eager.
            basic = self.kernel.stats(ws, self._needs) if self.kernel is not None else None
            ws.basic = basic if basic is not None else fused_basic_stats(ws, self._needs)
            if self.basic_layout is not None:
                return ws.basic
        return torch.cat([r.compute(ws) for r in self.reducers])

    def decode(self, values: np.ndarray, shape: Sequence[int]) -> list[pb.ReducerResult]:
        """Turns :meth:`run`'s output, copied to the host, into result messages.

        Args:
            values: The float64 slots of one tensor.
            shape: The shape of the tensor that was reduced.

        Returns:
            One ``ReducerResult`` per reducer, in plan order.

        Raises:
            ValueError: When ``values`` does not have ``width(shape)`` slots.
        """
        values = np.asarray(values, dtype=np.float64)
        if self.basic_layout is not None:
            if values.shape != (BASIC_WIDTH,):
                raise ValueError(f"expected the {BASIC_WIDTH} basic slots, got {values.shape}")
            return [r.decode(values[a:b], shape) for r, a, b in self.basic_layout]
        widths = [r.width(shape) for r in self.reducers]
        if values.shape != (sum(widths),):
            raise ValueError(f"expected {sum(widths)} slots for shape {list(shape)}, got {values.shape}")
        bounds = list(itertools.accumulate(widths, initial=0))
        return [r.decode(values[a:b], shape) for r, a, b in zip(self.reducers, bounds, bounds[1:])]
