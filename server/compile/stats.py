"""The basic statistics from one compiled (inductor) kernel, never compiled inside a pass.

Why: the eager :func:`~layertap.server.reducers.kernels.fused_basic_stats`
reads a tensor once per statistic; one inductor kernel
(:mod:`~layertap.server.compile.kernel`) reads it once for all
eight (issue 10: 1.26x step time against 1.53x on the CPU demo).

A compile costs seconds, so a pass never waits for one, nor triggers one:

* Kernels are compiled per :class:`~layertap.server.compile.kernel.Signature`
  on a background thread, off the model lock
  (:mod:`~layertap.server.compile.worker`). Until a signature is
  ready, :meth:`CompiledStats.stats` returns None and the caller runs the
  eager path; a first sighting queues the compile.
* A ready kernel is called without dynamo's compile path at all: its one
  compiled entry's guard tree is checked by us (the same guards dynamo would
  check, ~2 us instead of its ~30 us per-call wrapper) and the compiled
  bytecode run directly; a failed check returns None and the call goes
  eager. Where that introspection is unavailable, dynamo's run-only mode
  (``torch._dynamo.run``) is used instead: on a guard miss it runs the Python
  body uncompiled rather than compiling, and the body flags it. Either way a
  miss is counted, never silent, and a signature that keeps missing goes
  back to eager.
* ``torch.compiler.set_stance("fail_on_recompile")`` is not used: the stance is
  one process-wide global (``torch._dynamo.eval_frame._stance``) read whenever
  any thread enters any compiled function. A hook setting it would make a
  concurrent background compile fail and would change every other compiled
  function in the process (and set_stance raises inside a compile region).
  Both calls above are per call and per thread (dynamo's frame callback
  is thread-local).
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Any

import torch

from layertap.server.compile import aoti
from layertap.server.compile.kernel import BATCH, DENSE, SHIFT_SAMPLE, Signature, alias, canonical_form, signature_of
from layertap.server.compile.worker import Compiler, Entry
from layertap.server.host.step_aside import Passes
from layertap.server.reducers.kernels import StatNeeds
from layertap.server.reducers.workspace import F64, Workspace

__all__ = ["MAX_GUARD_MISSES", "CompiledStats", "supported"]

log = logging.getLogger("layertap.server.compiled")

#: Guard misses after which a ready signature goes back to eager for good.
MAX_GUARD_MISSES = 3


def supported() -> bool:
    """Whether this torch has what the hot path reads (per-device autocast state, mode stacks)."""
    return hasattr(torch, "get_autocast_dtype") and hasattr(torch._C, "_len_torch_function_stack")


class CompiledStats:
    """The hot-path entry: the basic statistics from a ready kernel, or None.

    Args:
        enabled: When False (``--no-compile``), :meth:`stats` returns None at
            once and nothing is ever compiled.
        max_signatures: At most this many signatures are ever compiled (each
            costs seconds of CPU and some memory); others stay eager.
        direct: Call ready kernels past dynamo's per-call wrapper, checking
            its guards ourselves (faster); False uses dynamo's run-only mode.
        gate: A lock held around each background compile: pass the model lock
            when passes draw from the global RNG (dynamo restores it after a
            compile; see :mod:`~layertap.server.compile.worker`).
        passes: The process's pass registry: a background compile steps aside
            while passes run (``app.py`` makes one per process).

    Counters, for self-metrics (plain ints; each is written by one thread):
    ``compiles`` and ``compile_failures`` (the background thread),
    ``compiled_calls``, ``eager_calls`` (calls that fell back: signature not
    ready yet, failed or stale, tensor unsupported, or a guard miss) and
    ``guard_misses`` (a ready kernel's guards did not hold; never a compile)
    and ``bad_packages`` (cached AOTInductor packages that did not load).
    Calls declined up front (disabled, an active torch mode, counts-only
    needs where no AOTInductor kernel applies) count in neither.
    """

    def __init__(self, *, enabled: bool = True, max_signatures: int = 16, direct: bool = True,
                 gate: AbstractContextManager[Any] | None = None, aoti: bool = True,
                 passes: Passes | None = None) -> None:
        self._enabled = False
        self._compiler = Compiler(max_signatures, gate=gate, direct=direct, aoti=aoti, passes=passes)
        self._consts: dict[tuple[torch.device, bool], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.compiled_calls = 0
        self.eager_calls = 0
        self.guard_misses = 0
        #: Compile in the background (a first sighting, a tap's ahead-compile).
        #: A training process turns it off: a compile saves and restores the
        #: global RNG, so one overlapping a step would change its dropout
        #: draws. It compiles with :meth:`compile_now` before its loop instead.
        self.background = True
        self.set_enabled(enabled)

    # -- control ---------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self._enabled

    def set_enabled(self, enabled: bool) -> None:
        """Turns compiling on or off; off also drops compiles not yet started."""
        if enabled and not supported():
            log.warning("compiled basic statistics need torch >= 2.4 (this is %s); using eager", torch.__version__)
            enabled = False
        self._enabled = enabled
        if not enabled:
            self._compiler.drop_queued()

    @property
    def compiles(self) -> int:
        return self._compiler.compiles

    @property
    def compile_failures(self) -> int:
        return self._compiler.failures

    def counters(self) -> dict[str, int]:
        """Every counter by name."""
        return {"compiles": self.compiles, "compile_failures": self.compile_failures,
                "compiled_calls": self.compiled_calls, "eager_calls": self.eager_calls,
                "guard_misses": self.guard_misses, "bad_packages": self._compiler.bad_packages}

    def states(self) -> dict[Signature, str]:
        """Each known signature's state: queued, compiling, ready, failed or stale."""
        return self._compiler.states()

    def compile_ahead(self, what: torch.Tensor | Signature, *, grad: bool | None = None,
                      inference: bool | None = None) -> bool:
        """Queues a background compile for a signature, or an example tensor's.

        Tap creation calls this with each hooked layer's last-seen output (or
        any tensor of its dtype, device and layout) and ``inference=True``
        for passes the server runs, so the first passes already run
        compiled. Modes left None are the calling thread's.

        Returns:
            True when the signature is ready, queued or compiling.
        """
        if not self._enabled or not self.background:
            return False
        sig = what if isinstance(what, Signature) else signature_of(what, grad=grad, inference=inference)
        return sig is not None and self._compiler.request(sig)

    def compile_now(self, sig: Signature, timeout: float | None = None) -> bool:
        """Compiles (or loads) ``sig`` and waits for it, background or not: for a
        training process, before its loop starts. True when the kernel is ready."""
        if not self._enabled or not self._compiler.request(sig):
            return False
        self._compiler.wait_idle(timeout)
        return self._compiler.ready(sig) is not None

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Blocks until no compile is queued or running; False on timeout."""
        return self._compiler.wait_idle(timeout)

    def close(self, timeout: float | None = 30.0) -> bool:
        """Stops compiling and the background thread (after its current compile).

        Returns:
            True when no compile is running any more (False: still inside one after ``timeout``).
        """
        self._enabled = False
        return self._compiler.close(timeout)

    # -- hot path --------------------------------------------------------------
    def _constants(self, device: torch.device, inference: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(no random positions, K off, K on)`` for the device, made once per mode:
        an inference tensor's dispatch keys differ, and the guards check them."""
        key = (device, inference)
        hit = self._consts.get(key)
        if hit is None:
            hit = self._consts[key] = (
                torch.zeros(SHIFT_SAMPLE, dtype=torch.int64, device=device),
                torch.zeros((1,), dtype=F64, device=device),
                torch.ones((1,), dtype=F64, device=device),
            )
        return hit

    def stats(self, ws: Workspace, needs: StatNeeds) -> torch.Tensor | None:
        """The basic-statistics vector of ``ws.x`` from a ready kernel, or None.

        Never compiles and never syncs. On None the caller runs the eager
        ``fused_basic_stats``. Unlike there, every slot is filled (fused, the
        extra statistics are nearly free); K is shift_of's, drawing the same
        random positions from ``ws.generator``, when ``needs.shifted``, else 0.
        """
        if not self._enabled:
            return None
        if torch._C._len_torch_dispatch_stack() or torch._C._len_torch_function_stack():
            return None  # a mode would see the compiled graph's ops (and its guards fail)
        x = ws.x
        canon = canonical_form(x)
        entry: Entry | None = None
        # A ready AOTInductor kernel serves dense tensors in any mode: no signature to work out (~1.5 us a call).
        aot = self._compiler.aoti_kernels.get((x.device, x.dtype, DENSE)) if canon is not None and canon[0] == DENSE \
            else None
        if aot is None:
            sig = signature_of(x, canon) if canon is not None else None
            if not (needs.sums or needs.minmax) and not (sig is not None and self._compiler.aoti
                                                         and aoti.applies(sig)):
                # Counts alone (the nonfinite-only passes of every=N taps) cost the
                # eager path two light ops, less than a dynamo kernel's call; the
                # AOTInductor kernel costs less than both (18 vs 19-62 us, 320 to
                # 131k elements, on the 2-core CPU machine).
                return None
            entry = self._ready(sig)
            if entry is None:
                return None
        assert canon is not None
        rnd, off, on = self._constants(x.device, torch.is_inference_mode_enabled())
        if needs.shifted and ws.floating:  # shift_of's draw, from the same generator
            rnd = torch.randint(0, ws.numel, (SHIFT_SAMPLE,), generator=ws.generator, device=x.device)
        shift = on if needs.shifted else off
        if aot is not None:
            self.compiled_calls += 1
            return aot(x.view(-1) if x.is_contiguous() else alias(x, canon[1], canon[2]), rnd, shift)
        assert entry is not None
        return self._run(entry, alias(x, canon[1], canon[2]), rnd, shift)

    def batch_stats(self, x: torch.Tensor, rnd: torch.Tensor) -> torch.Tensor | None:
        """Each row's statistics of a stacked ``(rows, n)`` tensor (:mod:`.batched`) from a ready kernel, or None.

        As :meth:`stats`: never compiles (a first sighting queues the
        signature's compile), never syncs; None means the caller runs
        :func:`~.kernel.batched_stats_body` eagerly.
        """
        if not self._enabled or x.shape[0] < 2 or torch._C._len_torch_dispatch_stack() \
                or torch._C._len_torch_function_stack():
            return None  # one row: the per-tensor kernel's (a dynamic-shape compile guards on rows >= 2)
        on = self._constants(x.device, torch.is_inference_mode_enabled())[2]
        aot = self._compiler.aoti_kernels.get((x.device, x.dtype, BATCH))
        if aot is not None:
            self.compiled_calls += 1
            return aot(x, rnd, on)
        entry = self._ready(signature_of(x, (BATCH, tuple(x.shape), tuple(x.stride()))))
        return self._run(entry, x, rnd, on) if entry is not None else None

    def _ready(self, sig: Signature | None) -> Entry | None:
        """The signature's ready entry; else counts an eager call and queues its compile (background only)."""
        entry = self._compiler.ready(sig) if sig is not None else None
        if entry is None:
            self.eager_calls += 1
            if sig is not None and self.background:
                self._compiler.request(sig)
        return entry

    def _run(self, entry: Entry, x: torch.Tensor, rnd: torch.Tensor, on: torch.Tensor) -> torch.Tensor | None:
        """A ready entry's kernel; None on a guard miss (counted, and eager from then on after a few)."""
        out = entry.run(x, rnd, on)
        if out is None:
            self.guard_misses += 1
            self.eager_calls += 1
            self._compiler.missed(entry, MAX_GUARD_MISSES)
            return None
        self.compiled_calls += 1
        return out
