"""Captures: the real tensors at chosen layers, from live traffic or a client input.

A :class:`CaptureSession` installs hooks for the duration of one ``Capture``
call. Hooks clone the (sliced, downcast) tensor on its device; the byte cap is
checked from shapes first, so an oversized pass copies nothing. The RPC
thread, not the model thread, moves the tensors to the host and chunks them.

Every clone also counts against the server-wide :class:`CaptureBudget` until
its pass is sent, dropped or its capture ends. Past the budget a passive
capture skips the pass (live traffic: another pass comes; the skip is counted
and the next header's ``pass_index`` shows the gap) while an active capture
fails with RESOURCE_EXHAUSTED (its one pass will not come again). A hook never
raises into the model's forward, which may be another client's ``Infer``: a
failed clone (out of memory included) fails only this capture.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from layertap.server.errors import (
    CAPTURE_BUDGET_EXHAUSTED,
    CAPTURE_OUT_OF_MEMORY,
    CAPTURE_TOO_LARGE,
    DeadlineExceeded,
    LayertapServerError,
    LimitExceeded,
    Unsupported,
    echo,
)
from layertap.server.host.hooks import CallArgs, HookHandle, ParamGrad
from layertap.server.host.model_host import ModelHost, PassContext, flatten_tensors
from layertap.server.taps.capture_limits import CaptureBudget, CaptureLimits, CaptureSlots, Reservation
from layertap.server.taps.capture_options import GRAD_POINTS, CaptureOptions, Selection, describe, parse_options
from layertap.v1 import telemetry_pb2 as pb

__all__ = [
    "CaptureBudget", "CaptureLimits", "CaptureOptions", "CaptureSession", "CaptureSlots", "CaptureTooLarge",
    "Selection", "check_all_ran", "describe", "parse_options",
]

log = logging.getLogger("layertap.server")

#: Passes one capture may hold clones for at once (one being sent, one queued).
MAX_HELD_PASSES = 2


class CaptureTooLarge(LimitExceeded):
    """A pass needs more bytes than ``--max-capture-bytes`` allows."""

    reason = CAPTURE_TOO_LARGE


class CaptureBudgetExhausted(LimitExceeded):
    """Captures in flight hold ``--capture-budget-bytes``; this capture's pass did not fit."""

    reason = CAPTURE_BUDGET_EXHAUSTED


class CaptureOutOfMemory(LimitExceeded):
    """The device ran out of memory cloning for this capture; the model's pass went on."""

    reason = CAPTURE_OUT_OF_MEMORY


class CaptureCopyFailed(LayertapServerError):
    """Cloning a captured tensor raised something other than out-of-memory (INTERNAL)."""

    reason = "CAPTURE_COPY_FAILED"


class CaptureWaitExceeded(DeadlineExceeded):
    """A passive capture saw no live pass within ``--max-capture-wait``."""


@dataclass
class CapturedTensor:
    layer: str
    call_index: int
    output_index: int
    output_key: str
    output_count: int
    is_container: bool
    tensor: torch.Tensor


@dataclass(eq=False)
class CapturedPass:
    ctx: PassContext
    ordinal: int
    #: This pass's share of the capture budget; returned once (``CaptureSession.release``).
    held: Reservation
    tensors: list[CapturedTensor] = field(default_factory=list)
    calls: dict[str, int] = field(default_factory=dict)
    nbytes: int = 0
    #: Why this pass cannot be sent (over the cap, out of memory...): the RPC raises it.
    error: LayertapServerError | None = None
    #: Over the budget in a passive capture: the pass is dropped, not sent.
    skipped: bool = False


#: Host clones from this size on go into numpy-allocated memory (see clone_for_capture).
HUGE_PAGE_CLONE_BYTES = 4 << 20


def clone_for_capture(src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The device copy a capture keeps (a seam: tests make it raise out-of-memory).

    A copy, so later in-place ops in the model cannot change what we send.
    A large host clone lands in fresh memory, and faulting it in 4 KiB pages
    cost more than the copy itself (48 MiB: ~35 ms against ~15 ms on a
    2-vCPU VM). numpy asks the kernel for transparent huge pages on
    allocations from 4 MiB, so such clones go into a numpy buffer, contiguous,
    ready for the encoder to send without another copy.
    """
    nbytes = src.numel() * torch.empty((), dtype=dtype).element_size()
    if src.device.type != "cpu" or nbytes < HUGE_PAGE_CLONE_BYTES:
        return src.to(dtype=dtype, copy=True) if dtype != src.dtype else src.clone()
    try:
        dst = torch.from_numpy(np.empty(nbytes, np.uint8)).view(dtype).view(src.shape)
    except MemoryError:
        raise torch.OutOfMemoryError(f"cannot allocate {nbytes} host bytes for a capture") from None
    return dst.copy_(src)


class CaptureSession:
    """Hooks for one Capture call; yields :class:`CapturedPass` objects.

    Threads: hooks and :meth:`pass_finished` run on the model thread, under
    the model lock; :meth:`next_pass` and :meth:`release` on the RPC thread;
    :meth:`close` on whichever ends the call (gRPC's callback thread when the
    client vanishes). ``_lock`` orders them: once closed, no hook reserves
    budget, and close returns every reservation still held.
    """

    def __init__(self, host: ModelHost, opts: CaptureOptions, *, max_bytes: int, active: bool,
                 budget: CaptureBudget | None = None) -> None:
        self.host = host
        self.opts = opts
        self.max_bytes = max_bytes
        self.active = active
        self.budget = budget if budget is not None else CaptureBudget(1 << 62)
        #: Passes this capture skipped over the budget.
        self.skipped = 0
        self._passes: queue.Queue[CapturedPass] = queue.Queue()
        self._pending: CapturedPass | None = None
        self._taken = 0
        self._handles: list[HookHandle] = []
        self._lock = threading.Lock()
        self._held: set[CapturedPass] = set()
        self._closed = False

    # -- lifecycle -----------------------------------------------------------
    def open(self) -> bool:
        """Install hooks between passes (the model lock keeps passes whole).

        False, installing nothing, when :meth:`close` came first: a client
        that cancels at once can end the call before its generator opens.
        """
        with self.host.pass_lock(), self._lock:
            if self._closed:
                return False
            for layer in self.opts.layers:
                self._handles.append(
                    self.host.hooks.add(layer, self.opts.point, functools.partial(self._on_hook, layer))
                )
            self.host.add_observer(self)
            return True

    def remove_hooks(self) -> None:
        """Stop watching passes; passes already captured stay. Safe from any thread, any number of times.

        Never takes the model lock, so gRPC's callback thread never waits for a pass.
        """
        self.host.remove_observer(self)
        for h in self._handles:
            h.remove()

    def close(self) -> None:
        """Remove every hook and return the budget of every pass still held; idempotent."""
        with self._lock:
            self._closed = True
            held, self._held = self._held, set()
            self._pending = None
        self.remove_hooks()
        for rec in held:
            rec.held.release()
            rec.tensors.clear()

    def release(self, rec: CapturedPass) -> None:
        """Free a pass's clones and return its budget (sent, failed or dropped); any thread."""
        rec.held.release()
        rec.tensors.clear()
        with self._lock:
            self._held.discard(rec)

    def __enter__(self) -> CaptureSession:
        if not self.open():
            raise RuntimeError("this capture session was closed before it opened")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- model thread --------------------------------------------------------
    def _wants(self, ctx: PassContext) -> bool:
        if self.active:
            return ctx.active_owner is self
        return not ctx.active and self._taken < self.opts.passes

    def _pass_for(self, ctx: PassContext) -> CapturedPass | None:
        with self._lock:
            if self._closed or not self._wants(ctx):
                return None
            if self._pending is None or self._pending.ctx is not ctx:
                self._pending = CapturedPass(ctx, self._taken, self.budget.reservation())
            return self._pending

    def _on_hook(self, layer: str, ctx: PassContext, value: Any) -> None:
        # Never raises: the forward this hook runs in may be another client's
        # Infer, which must not fail because this capture could not copy.
        rec = None
        try:
            rec = self._pass_for(ctx)
            if rec is None:
                return
            # A gradient arrives one tensor at a time: count calls per tensor position.
            key = f"{layer}\0{value.position}" if isinstance(value, ParamGrad) else layer
            call = rec.calls.get(key, 0)
            rec.calls[key] = call + 1
            if rec.error is None and not rec.skipped:
                self._copy(rec, layer, call, value)
        except Exception as exc:  # fails this capture, not the pass
            if rec is None:
                log.exception("capture hook failed at layer %r", layer)
                return
            rec.error = self._copy_failed(exc, layer, ctx)
            self.release(rec)

    def _copy_failed(self, exc: Exception, layer: str, ctx: PassContext) -> LayertapServerError:
        if isinstance(exc, torch.OutOfMemoryError):
            log.warning("capture: out of memory cloning layer %r in pass %d; only this capture fails",
                        layer, ctx.index)
            return CaptureOutOfMemory(
                f"the device ran out of memory copying layer {layer!r} of pass {ctx.index} for this capture "
                "(the model's pass itself went on); capture fewer layers, use max_batch or a "
                "float16/bfloat16 downcast, or retry", metadata={"layer": layer})
        log.exception("capture: copying layer %r in pass %d failed; only this capture fails", layer, ctx.index)
        return CaptureCopyFailed(
            f"copying layer {layer!r} of pass {ctx.index} failed ({type(exc).__name__}) and was logged on the "
            "server; the model's pass itself went on", metadata={"layer": layer})

    def _copy(self, rec: CapturedPass, layer: str, call: int, value: Any) -> None:
        ctx = rec.ctx
        items = flatten_tensors(value)
        # A gradient is one tensor of its module's outputs, inputs or
        # parameters: its place is its position; the structure is settled
        # when the pass ends (_settle_gradients).
        offset = value.position if isinstance(value, ParamGrad) else 0
        # Keyword tensors come back by name (a dict; positional ones keyed by
        # position); a call with no keyword tensor is read as its args tuple.
        keywords = isinstance(value, CallArgs) and value.positional < len(items)
        # A one-argument input comes back like an output; several as a list.
        is_container = not isinstance(value, (torch.Tensor, ParamGrad)) and not (
            self.opts.point == pb.POINT_INPUT and isinstance(value, (tuple, CallArgs)) and len(items) == 1
            and not keywords
        )
        # A parameter's first dimension is no batch.
        max_batch = 0 if self.opts.point == pb.POINT_PARAM_GRAD else self.opts.max_batch
        planned = []
        for key, t in items:
            shape = list(t.shape)
            if max_batch and shape:
                shape[0] = min(shape[0], max_batch)
            dtype = self.opts.dtype if (self.opts.dtype and t.dtype.is_floating_point) else t.dtype
            n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            planned.append((key, t, dtype, n))
        more = sum(p[3] for p in planned)
        need = rec.nbytes + more
        if need > self.max_bytes:
            matched = len(self.opts.layers)
            rec.error = CaptureTooLarge(
                f"capture too large: pass {ctx.index} needs at least {need} bytes by layer {layer!r} "
                f"({matched} layer{'s' if matched != 1 else ''} matched the request), over the server cap of "
                f"{self.max_bytes} bytes (--max-capture-bytes); capture fewer layers, or use max_batch or a "
                "float16/bfloat16 downcast",
                metadata={"max_bytes": str(self.max_bytes), "layers_matched": str(matched)})
            self.release(rec)  # free device copies already made for this pass
            return
        if not self._reserve(rec, layer, need, more):
            return
        rec.nbytes = need
        keyed = keywords or isinstance(value, (dict, ParamGrad))
        for i, (key, t, dtype, _n) in enumerate(planned):
            src = t.detach()
            if max_batch and src.dim():
                src = src[:max_batch]
            rec.tensors.append(CapturedTensor(layer, call, offset + i, key if keyed else "",
                                              len(planned), is_container, clone_for_capture(src, dtype)))

    def _reserve(self, rec: CapturedPass, layer: str, need: int, more: int) -> bool:
        """Take ``more`` bytes of the budget for this pass, or apply the policy past it.

        One capture holds at most ``MAX_HELD_PASSES`` passes (one being sent,
        one queued): a client that reads slowly must not pin the whole
        server-wide budget with passes queued ahead of it. A passive capture
        skips passes past that, as past the budget.
        """
        with self._lock:
            if self._closed:
                return False
            if rec not in self._held and len(self._held) >= MAX_HELD_PASSES and not self.active:
                rec.skipped = True
                return False
            if rec.held.grow(more):
                self._held.add(rec)
                return True
        budget = self.budget
        if need > budget.limit or self.active:
            why = (f"pass {rec.ctx.index} needs at least {need} bytes by layer {layer!r}, more than the whole "
                   if need > budget.limit else
                   f"captures in flight hold {budget.held} bytes and pass {rec.ctx.index} needs {need} more of the ")
            rec.error = CaptureBudgetExhausted(
                f"capture budget exhausted: {why}server-wide budget of {budget.limit} bytes "
                "(--capture-budget-bytes); retry when other captures finish, or capture less "
                "(max_batch, a float16/bfloat16 downcast)", metadata={"budget_bytes": str(budget.limit)})
        else:
            rec.skipped = True  # live traffic: a later pass will come
        self.release(rec)
        return False

    def pass_finished(self, ctx: PassContext) -> None:
        drop = None
        with self._lock:
            if self._closed or not self._wants(ctx):
                return
            rec = self._pending if self._pending is not None and self._pending.ctx is ctx else None
            self._pending = None
            if ctx.failed:
                # The forward raised: a passive capture waits for the next good pass.
                drop = rec
            elif rec is not None and rec.skipped:
                self.skipped += 1
            else:
                if rec is None:
                    rec = CapturedPass(ctx, self._taken, self.budget.reservation())
                elif self.opts.point in GRAD_POINTS:
                    _settle_gradients(rec, self.opts.point)
                self._taken += 1
                self._passes.put(rec)
        if drop is not None:
            self.release(drop)
        elif rec is not None and rec.skipped:
            self.budget.count_skipped()

    # -- RPC thread ----------------------------------------------------------
    def next_pass(self, timeout: float) -> CapturedPass | None:
        try:
            return self._passes.get(timeout=timeout)
        except queue.Empty:
            return None

    def wait_exceeded(self, waited: float, max_wait: float, skipped: int) -> LayertapServerError:
        """The error for a passive capture that got no pass in ``max_wait`` seconds.

        ``skipped`` passes came meanwhile but did not fit the budget: then it
        is the budget, not the traffic, that ran out.
        """
        if skipped:
            return CaptureBudgetExhausted(
                f"capture budget exhausted: waited {waited:.1f} s (--max-capture-wait {max_wait:g} s) and "
                f"skipped {skipped} live pass(es) because captures in flight held the server-wide budget of "
                f"{self.budget.limit} bytes (--capture-budget-bytes); retry later, or capture less "
                "(max_batch, a float16/bfloat16 downcast)",
                metadata={"budget_bytes": str(self.budget.limit), "skipped_passes": str(skipped)})
        return CaptureWaitExceeded(
            f"no live forward pass within {waited:.1f} s (--max-capture-wait {max_wait:g} s) for this passive "
            "capture; send Infer traffic while capturing, or pass inputs for an active capture",
            metadata={"max_wait_seconds": f"{max_wait:g}"})


def _settle_gradients(rec: CapturedPass, point: int) -> None:
    """Give a pass's gradient tensors their count and structure, known only once the step ended.

    Parameter gradients are a module's named parameters (a dict by name);
    output and input gradients a list when more than one tensor of a call got one.
    """
    counts: dict[tuple[str, int], int] = {}
    for t in rec.tensors:
        counts[t.layer, t.call_index] = counts.get((t.layer, t.call_index), 0) + 1
    for t in rec.tensors:
        t.output_count = counts[t.layer, t.call_index]
        t.is_container = point == pb.POINT_PARAM_GRAD or t.output_count > 1


def check_all_ran(rec: CapturedPass, opts: CaptureOptions) -> None:
    """Every requested layer produced a tensor in this pass, or FAILED_PRECONDITION.

    A module the forward never calls (an auxiliary head, a branch not taken)
    would otherwise end the stream with nothing for it. A glob or regex needs
    only one of its layers to run: ``**`` may well match modules that do not.
    """
    seen = {c.layer for c in rec.tensors}
    selections = opts.selections or tuple(Selection(f"layers[{i}]", n, (n,)) for i, n in enumerate(opts.layers))
    for sel in selections:
        missing = [layer for layer in sel.layers if layer not in seen]
        if sel.pattern and len(missing) == len(sel.layers):
            raise Unsupported(
                f"{sel.field}: none of the {len(sel.layers)} layer(s) selector {echo(sel.text)} matched ran in "
                f"pass {rec.ctx.index} (or gave a tensor at this point)", field=sel.field)
        if not sel.pattern and missing:
            raise Unsupported(
                f"{sel.field}: module {missing[0]!r} did not run in pass {rec.ctx.index} (or gave no tensor at "
                f"this point); the forward never calls it for this input", field=sel.field)
