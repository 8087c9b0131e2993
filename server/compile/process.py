"""A compiled variant built in another process: one AOTInductor package per tap set and input shape.

Why another process: a compile is seconds to minutes of Python (dynamo's
trace, inductor's lowering) and a C++ build. In the serving process it
shares the GIL with every pass and every request's decode and encode; the
best in-process schedule (:mod:`.step_aside`) still left an Infer's p99
during a tap change at 2.7x the steady one on 2 cores (docs/benchmarks.md,
session 15). Here a niced child process (:mod:`.child`: ``os.nice(19)``, one
thread) exports the model with the taps' statistics hooks (``torch.export``,
non-strict) and compiles it with AOTInductor; the server only loads the
finished package (:mod:`.package`: its constants on the live weights, its guards).

What crosses to the child (a pickle in a private temp dir, :class:`~.child.ChildJob`):

* the module's *skeleton* (:mod:`.skeleton`): the module tree pickled as
  is, except that a large tensor goes as its shape, stride and dtype. The
  child allocates those with ``torch.empty`` and never reads them: the
  package is built with ``package_constants_in_so=False``, so it holds no
  weights, and the server points every constant at the live model's own
  tensor (``load_constants(..., user_managed=True)``: no copy).
* the key, the statistics function (by reference), example inputs' shapes and
  dtypes with their free dims, and inductor's options for the mode.

Scope: CPU models whose skeleton pickles (classes importable by name). The
others (CUDA, whose CUDA-graph modes AOTInductor does not replay, and
unpicklable modules) compile in the serving process (:mod:`.variant`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layertap.server.compile import child as child_process
from layertap.server.compile.package import Package, PackageMeta
from layertap.server.compile.variant import GraphResult, StatsFunction

__all__ = ["ProcessVariant", "SkeletonRefused"]


class SkeletonRefused(RuntimeError):
    """The child could not load the model's skeleton (a class only the server can import)."""


_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit)\w*: ")


def _error_line(stderr: str) -> str:
    """The child's exception line (``Type: message``, the last one), else its last line of output."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if _EXCEPTION_LINE.match(line)]
    return (errors or lines or ["no output"])[-1][:500]


class ProcessVariant:
    """The model with in-graph statistics at ``key``'s layers, its packages built by a child process.

    The same face as :class:`~layertap.server.compile.variant.Variant`: ``compile`` (the compiler thread; it waits
    on the child without holding the GIL) and ``run`` (the model thread; never compiles).

    Args:
        model: The eager module (never changed; its tensors become the packages' constants).
        key: Layer names whose output statistics the graph computes, in stats row order.
        skeleton: Path of the model's skeleton (:func:`skeleton_bytes`), written once per server.
        stats: The statistics traced at each key layer's output.
        free: Per input, the dims declared free.
        options: Inductor's options for the mode.
        workdir: Where packages go (deleted with the server's temp dir).
        timeout: Seconds a child may take before it is killed and the compile fails.
    """

    def __init__(self, model: nn.Module, key: Sequence[str], skeleton: str, stats: StatsFunction | None,
                 free: dict[int | str, tuple[int, ...]], options: dict[str, Any], workdir: str,
                 timeout: float = 3600.0) -> None:
        self.key = tuple(key)
        self._model = model
        self._skeleton = skeleton
        self._stats = stats
        self._free = free
        self._options = options
        self._workdir = workdir
        self._timeout = timeout
        self._packages: tuple[Package, ...] = ()
        self._child: subprocess.Popen[str] | None = None
        self._cancelled = False
        #: Seconds of the last compile spent in the child, and its exit status.
        self.child_seconds = 0.0

    @property
    def shapes_compiled(self) -> int:
        return len(self._packages)

    def compile(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Build, load and index a package for inputs like these.

        Raises:
            RuntimeError: The child failed or timed out (its last lines of output in the message),
                or the package does not take its own example.
        """
        def spec(t: Any) -> tuple[torch.dtype, tuple[int, ...]] | None:
            if t is None:
                return None
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"a compiled package takes tensors and None, not {type(t).__name__}")
            return t.dtype, tuple(t.shape)

        fd, out = tempfile.mkstemp(suffix=".pt2", dir=self._workdir)
        os.close(fd)
        # Inductor sizes its CPU loops' parallelism by the compiling process's threads: the child
        # runs one, the server's passes run torch.get_num_threads() (serial loops cost 1.9x, not 1.3x).
        options = {"cpp.threads": torch.get_num_threads(), **self._options}
        job = child_process.ChildJob(self._skeleton, self.key, self._stats, [spec(a) for a in args],
                                     {k: spec(v) for k, v in kwargs.items()}, self._free, options, out)
        job_path = out + ".job"
        Path(job_path).write_bytes(pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        t0 = time.monotonic()
        try:
            # The child module by its name: what it pickles (the package's metadata) names importable modules.
            with subprocess.Popen([sys.executable, "-m", child_process.__name__, job_path], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as child:
                self._child = child
                if self._cancelled:
                    child.kill()
                try:
                    _, stderr = child.communicate(timeout=self._timeout)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.communicate()
                    raise RuntimeError(f"the compile process ran past {self._timeout:.0f} s and was killed") from None
            if child.returncode == child_process.SKELETON_REFUSED and not self._cancelled:
                raise SkeletonRefused(_error_line(stderr))
            if child.returncode != 0:
                why = "it was cancelled" if self._cancelled else _error_line(stderr)
                raise RuntimeError(f"the compile process exited with {child.returncode}: {why}")
            meta: PackageMeta = pickle.loads(Path(out + ".meta").read_bytes())
            package = Package(out, meta, self._model)
        finally:
            self._child = None
            self.child_seconds = time.monotonic() - t0
            for path in (job_path, out, out + ".meta"):  # a loaded package lives in the loader's own copy
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        try:  # the guards run the shapes' expression in every pass: it must run here first, or the compile fails
            accepted = package.accepts(args, kwargs)
        except Exception as exc:  # noqa: BLE001 - a printed expression this evaluation cannot run
            raise RuntimeError(f"the tapped outputs' shapes cannot be computed: {type(exc).__name__}: {exc}") from None
        if not accepted:
            raise RuntimeError("the fresh package's guards reject its own example")
        self._packages = (package, *self._packages)

    def cancel(self) -> None:
        """Kills the child that compiles now, if any, and any later one (the server is closing)."""
        self._cancelled = True
        child = self._child
        if child is not None:
            with contextlib.suppress(OSError):
                child.kill()

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> GraphResult | None:
        """The compiled pass when some package accepts these inputs, else None (nothing ran)."""
        for package in self._packages:
            call = package.flat(args, kwargs)
            if call is not None:
                return package.run(*call)
        return None
