"""A compiled variant built in another process: one AOTInductor package per tap set and input shape.

Why another process: a compile is seconds to minutes of Python (dynamo's
trace, inductor's lowering) and a C++ build. In the serving process it
shares the GIL with every pass and every request's decode and encode; the
best in-process schedule (:mod:`.step_aside`) still left an Infer's p99
during a tap change at 2.7x the steady one on 2 cores (docs/benchmarks.md,
session 15). Here a niced child process (``os.nice(19)``, one thread) exports
the model with the taps' statistics hooks (``torch.export``, non-strict) and
compiles it with AOTInductor; the server only loads the finished package.

What crosses to the child (a pickle in a private temp dir):

* the module's *skeleton* (:mod:`.skeleton`): the module tree pickled as
  is, except that a large tensor goes as its shape, stride and dtype. The
  child allocates those with ``torch.empty`` and never reads them: the
  package is built with ``package_constants_in_so=False``, so it holds no
  weights, and the server points every constant at the live model's own
  tensor (``load_constants(..., user_managed=True)``: no copy). The child
  registers plain tensor attributes as buffers first, so each has a name the
  server resolves; a package with a constant the server cannot resolve (a
  tensor the forward itself makes, which AOTInductor keeps under a name of
  its own) fails to load, and that compile counts as failed.
* the key, the statistics function (by reference), example inputs' shapes and
  dtypes with their free dims, and inductor's options for the mode.

Guards: the package was traced for one input structure, with each free dim
dynamic over the range export found; :meth:`Package.flat` checks that
structure (keywords by name, None inputs), each tensor's dtype, device, rank,
contiguity and every dim (fixed, or in range, and equal to every other dim
traced as the same symbol) before a call, so a pass never reaches compiled
code that was not built for its inputs: AOTInductor checks nothing and would
read out of bounds. A tapped output's shape is computed from the input sizes
(the child prints each dim as an expression of the inputs' symbols, run once
at load), not read from the graph, so feeding the statistics reads nothing
back from a tensor.

Scope: CPU models whose skeleton pickles (classes importable by name). The
others (CUDA, whose CUDA-graph modes AOTInductor does not replay, and
unpicklable modules) compile in the serving process (:mod:`.variant`).
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layertap.server.compile.skeleton import PLACEHOLDERS
from layertap.server.compile.variant import COUNT32_LIMIT, GraphResult, SinkEntry, StatsFunction, sink_entry

__all__ = ["Package", "ProcessVariant", "SkeletonRefused"]

#: The child's exit status when it cannot unpickle the skeleton.
SKELETON_REFUSED = 3


class SkeletonRefused(RuntimeError):
    """The child could not load the model's skeleton (a class only the server can import)."""

#: The wrapper's attribute that holds the model: every constant's name starts with it.
_ROOT = "model"


# -- what the child builds ----------------------------------------------------------------------------
@dataclass
class _Job:
    skeleton: str  # path of the skeleton file
    key: tuple[str, ...]
    stats: StatsFunction | None
    #: Per input (positional by index, keyword by name): ``(dtype, shape)``, or None for a None argument.
    args: list[tuple[torch.dtype, tuple[int, ...]] | None]
    kwargs: dict[str, tuple[torch.dtype, tuple[int, ...]] | None]
    free: dict[int | str, tuple[int, ...]]
    options: dict[str, Any]
    out: str  # where the package goes; its metadata beside it (``.meta``)


@dataclass
class _Meta:
    """What the server needs besides the package: guards, output shapes, the tensors it must set."""

    #: Per flat input (args, then kwargs by ``kw_names``): None, or ``(dtype, dims)``, each dim a size or
    #: the name of the symbol it was traced as (two dims with one name must be equal).
    inputs: list[tuple[torch.dtype, list[int | str]] | None]
    #: Each symbol's range, inclusive.
    ranges: dict[str, tuple[int, int]]
    n_args: int
    kw_names: list[str]
    #: A Python expression over the symbols: the tapped outputs' shapes, a list of tuples.
    shapes: str
    #: Every tensor of the model the program reads (its parameters and buffers, and any constant over a
    #: placeholder): each must be a constant the server sets.
    used: list[str] = field(default_factory=list)


class _Tapped(nn.Module):
    """The model with its taps' statistics as forward hooks: what the child exports."""

    def __init__(self, model: nn.Module, key: Sequence[str], stats: StatsFunction | None,
                 record: Callable[[list[tuple[Any, ...]]], None], n_args: int, kw_names: Sequence[str]) -> None:
        super().__init__()
        self._n_args, self._kw_names = n_args, tuple(kw_names)
        #: Called with the tapped outputs' (symbolic) shapes on each forward: a function, which
        #: export's copy of the module shares (it copies attributes, and a list with them).
        self._record = record
        self.model = model
        self._n = len(key)
        self._sink: dict[int, SinkEntry] = {}
        modules = dict(model.named_modules())
        for i, layer in enumerate(key):
            assert stats is not None
            modules[layer].register_forward_hook(self._hook(i, stats))

    def _hook(self, index: int, stats: StatsFunction) -> Callable[[nn.Module, Any, Any], None]:
        def hook(_module: nn.Module, _args: Any, out: Any) -> None:
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"a tapped output must be one tensor for in-graph statistics, "
                                f"got {type(out).__name__}")
            self._sink[index] = sink_entry(self._sink.values(), out, stats)
        return hook

    def forward(self, *flat: Any) -> tuple[Any, torch.Tensor | None]:
        """The model's inputs flat, positional then keyword (by ``kw_names``): one export signature."""
        out = self.model(*flat[:self._n_args], **dict(zip(self._kw_names, flat[self._n_args:], strict=True)))
        if not self._n:
            return out, None
        stats = torch.stack([self._sink[i][0] for i in range(self._n)])
        self._record([self._sink[i][1] for i in range(self._n)])
        self._sink.clear()
        return out, stats


def _input_dims(t: torch.Tensor) -> list[int | str]:
    """A traced input's dims: sizes, or symbol names (an expression of other sizes is not supported)."""
    dims: list[int | str] = []
    for size in t.shape:
        if isinstance(size, int) or size.node.expr.is_number:  # specialized: a fixed size
            dims.append(int(size))
        elif size.node.expr.is_Symbol:
            dims.append(str(size.node.expr))
        else:
            raise ValueError(f"an input's size is traced as {size.node.expr}, an expression of other sizes")
    return dims


def _symbols(inputs: list[tuple[torch.dtype, list[int | str]] | None]) -> set[str]:
    """The symbols the inputs' free dims were traced as."""
    return {d for spec in inputs if spec is not None for d in spec[1] if isinstance(d, str)}


def _shape_code(shapes: list[tuple[Any, ...]], symbols: set[str]) -> str:
    """The tapped outputs' shapes as one Python expression over the inputs' symbols."""
    from torch.utils._sympy.printers import PythonPrinter  # noqa: PLC0415

    printer = PythonPrinter()
    out = []
    for shape in shapes:
        dims = []
        for size in shape:
            if isinstance(size, int):
                dims.append(str(size))
                continue
            free = {str(sym) for sym in size.node.expr.free_symbols}
            if not free <= symbols:
                raise ValueError(f"a tapped output's size {size.node.expr} depends on more than the inputs' sizes")
            dims.append(printer.doprint(size.node.expr))
        out.append("(" + "".join(f"{d}, " for d in dims) + ")")
    return "[" + ", ".join(out) + "]"


def _output_types() -> None:
    """Registers the output types export must flatten: a transformers model returns its ``DynamicCache``.

    In the child before export, and in the server before loading a package (its output spec names the type)."""
    if "transformers" not in sys.modules:
        return
    from transformers.integrations.executorch import register_dynamic_cache_export_support  # noqa: PLC0415

    register_dynamic_cache_export_support()  # type: ignore[no-untyped-call]  # idempotent


def _build(job: _Job) -> None:
    """The child's work: export, compile, write the package and its metadata."""
    import torch._inductor  # noqa: PLC0415 - the child's one job
    from torch.export import Dim  # noqa: PLC0415

    try:
        module = pickle.loads(Path(job.skeleton).read_bytes())
    except Exception as exc:  # noqa: BLE001 - a class this process cannot import: the server compiles it
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        raise SystemExit(SKELETON_REFUSED) from None
    _output_types()
    for sub in module.modules():  # plain tensor attributes as buffers: constants with names the server resolves
        for name, value in list(vars(sub).items()):
            if isinstance(value, torch.Tensor):
                delattr(sub, name)
                sub.register_buffer(name, value, persistent=False)
    traced: list[list[tuple[Any, ...]]] = []
    names = list(job.kwargs)
    wrapper = _Tapped(module, job.key, job.stats, traced.append, len(job.args), names).eval()

    def example(spec: tuple[torch.dtype, tuple[int, ...]] | None) -> torch.Tensor | None:
        # 2 for a free dim: torch specializes 0 and 1; a size-1 shape of the server's gets its own package.
        return None if spec is None else torch.zeros(spec[1], dtype=spec[0])

    flat = [example(spec) for spec in (*job.args, *job.kwargs.values())]
    wheres: list[int | str] = [*range(len(job.args)), *names]

    def dims(where: int | str, t: torch.Tensor | None) -> Any:
        if t is None:
            return None
        return {d: Dim.AUTO for d in job.free.get(where, ()) if d < t.dim() and t.shape[d] >= 2} or None

    seen: list[torch.Tensor | None] = []

    def spy(_m: nn.Module, a: Any) -> None:  # the traced inputs, symbolic sizes included
        seen[:] = list(a)

    handle = wrapper.register_forward_pre_hook(spy)
    with torch.no_grad():
        # One var-positional parameter: its specs are one tuple, inside the tuple of parameters.
        specs = tuple(dims(w, t) for w, t in zip(wheres, flat, strict=True))
        program = torch.export.export(wrapper, tuple(flat), dynamic_shapes=(specs,), strict=False)
    handle.remove()
    inputs: list[tuple[torch.dtype, list[int | str]] | None] = [
        None if t is None else (t.dtype, _input_dims(t)) for t in seen]
    symbols = _symbols(inputs)
    ranges = {str(sym): (_bound(r.lower, 0), _bound(r.upper, sys.maxsize))
              for sym, r in program.range_constraints.items() if str(sym) in symbols}
    shapes = _shape_code(traced[-1] if traced else [], symbols)
    # No weights in the package, and none inlined into a kernel (inductor inlines small ones by
    # default): every tensor of the model stays a constant the server points at its own.
    options = {**job.options, "aot_inductor.package_constants_in_so": False, "always_keep_tensor_constants": True}
    if job.key:
        # Inductor's post-grad pass moves each node next to its first use, and the statistics'
        # first use is the graph's output: every tapped tensor was read a second time at the end
        # of the pass, out of cache (1.19x of the base, against 1.13x read right after it is made).
        options["reorder_for_locality"] = False
    torch._inductor.aoti_compile_and_package(program, package_path=job.out, inductor_configs=options)
    sig = program.graph_signature
    # A tensor the forward made (a scale, a mask) may be baked in; the model's own tensors, and any
    # constant over a placeholder's memory, may not.
    lifted = {n: fqn for n, fqn in sig.inputs_to_lifted_tensor_constants.items()
              if isinstance(c := program.constants.get(fqn), torch.Tensor)
              and c.untyped_storage().data_ptr() in PLACEHOLDERS}
    named = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **lifted}
    used = sorted(named[n.name] for n in program.graph.nodes if n.op == "placeholder" and n.name in named and n.users)
    meta = _Meta(inputs, ranges, len(job.args), names, shapes, used)
    with open(job.out + ".meta", "wb") as f:
        pickle.dump(meta, f, protocol=pickle.HIGHEST_PROTOCOL)


def _bound(value: Any, infinite: int) -> int:
    """A range bound as an int (sympy's and torch's infinities become ``infinite``)."""
    try:
        return int(value)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return infinite


def _resolve(root: nn.Module, name: str) -> torch.Tensor | None:
    """The tensor at a dotted attribute path of ``root``, or None."""
    obj: Any = root
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, torch.Tensor) else None


def main(argv: Sequence[str] | None = None) -> int:
    """The child: ``python -m layertap.server.compile.process JOB``."""
    path = (argv if argv is not None else sys.argv[1:])[0]
    try:
        os.nice(19)  # a compile yields every core to serving
    except OSError:
        pass
    torch.set_num_threads(1)
    with open(path, "rb") as f:
        job: _Job = pickle.load(f)
    _build(job)
    return 0


# -- the server's side --------------------------------------------------------------------------------
class Package:
    """One loaded package: its guards, and a call that feeds the statistics' shapes from the inputs."""

    def __init__(self, path: str, meta: _Meta, root: nn.Module) -> None:
        import torch._inductor  # noqa: PLC0415

        self.meta = meta
        _output_types()
        self.runner = torch._inductor.aoti_load_package(path)
        constants: dict[str, torch.Tensor] = {}
        wrapper = nn.Module()
        wrapper.add_module(_ROOT, root)
        fqns = self.runner.get_constant_fqns()
        baked = sorted(set(meta.used) - set(fqns))
        if baked:  # its compile-time value (a placeholder's garbage, or a stale copy) would serve
            raise RuntimeError(f"the package holds the model's tensor {baked[0]!r} as a compile-time value, "
                               "not as a constant the server can point at its own")
        for fqn in fqns:
            t = _resolve(wrapper, fqn)
            if t is None:
                raise RuntimeError(f"the package's constant {fqn!r} is none of the model's tensors")
            constants[fqn] = t.detach()
        self.runner.load_constants(constants, check_full_update=True, user_managed=True)
        # The child's own expression (its temp dir is private to this server): evaluated once per pass.
        self._shapes: Callable[..., list[tuple[int, ...]]] = eval(
            f"lambda {', '.join(sorted(_symbols(meta.inputs)))}: {meta.shapes}",
            {"__builtins__": {}, "max": max, "min": min, "abs": abs})

    def flat(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], list[tuple[int, ...]]] | None:
        """The inputs in the package's order and the tapped outputs' shapes, when the inputs have the structure,
        dtypes and sizes it was built for (dims traced as one symbol equal, each within its range, every tapped
        tensor's count in int32 range); else None. Compiled code checks nothing: it would read out of bounds."""
        meta = self.meta
        if len(args) != meta.n_args or len(kwargs) != len(meta.kw_names):
            return None
        try:
            flat = [*args, *(kwargs[name] for name in meta.kw_names)]
        except KeyError:
            return None
        sizes: dict[str, int] = {}
        for t, spec in zip(flat, meta.inputs, strict=True):
            if spec is None or t is None:
                if spec is not t:
                    return None
                continue
            if not isinstance(t, torch.Tensor) or t.dtype != spec[0] or t.device.type != "cpu" \
                    or t.dim() != len(spec[1]) or not t.is_contiguous():
                return None
            for size, want in zip(t.shape, spec[1], strict=True):
                if isinstance(want, int):
                    if size != want:
                        return None
                elif sizes.setdefault(want, size) != size:
                    return None
        for name, size in sizes.items():
            lo, hi = meta.ranges.get(name, (2, sys.maxsize))
            if not lo <= size <= hi:
                return None
        shapes = self._shapes(**sizes)
        if any(math.prod(shape) >= COUNT32_LIMIT for shape in shapes):  # its counts are int32 lanes
            return None
        return flat, shapes

    def accepts(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether these inputs are ones the package was built for (see :meth:`flat`)."""
        return self.flat(args, kwargs) is not None

    def run(self, flat: list[Any], shapes: list[tuple[int, ...]]) -> GraphResult:
        """One pass on what :meth:`flat` returned."""
        out, stats = self.runner(*flat)
        return out, stats, shapes


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
        job = _Job(self._skeleton, self.key, self._stats, [spec(a) for a in args],
                   {k: spec(v) for k, v in kwargs.items()}, self._free, options, out)
        job_path = out + ".job"
        Path(job_path).write_bytes(pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        t0 = time.monotonic()
        try:
            with subprocess.Popen([sys.executable, "-m", __name__, job_path], env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True) as child:
                self._child = child
                if self._cancelled:
                    child.kill()
                try:
                    _, stderr = child.communicate(timeout=self._timeout)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.communicate()
                    raise RuntimeError(f"the compile process ran past {self._timeout:.0f} s and was killed") from None
            if child.returncode == SKELETON_REFUSED and not self._cancelled:
                raise SkeletonRefused(_error_line(stderr))
            if child.returncode != 0:
                why = "it was cancelled" if self._cancelled else _error_line(stderr)
                raise RuntimeError(f"the compile process exited with {child.returncode}: {why}")
            meta: _Meta = pickle.loads(Path(out + ".meta").read_bytes())
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


if __name__ == "__main__":  # run by name, so what it pickles names this module, not __main__
    from layertap.server.compile.process import main as _main

    sys.exit(_main())
