"""The compile process's side: ``python -m layertap.server.compile.child JOB`` builds one package.

The server (:class:`~layertap.server.compile.process.ProcessVariant`) pickles a
:class:`ChildJob` into its private temp dir and starts this module on it. The
child nices itself (``os.nice(19)``, one thread), loads the model's skeleton
(:mod:`.skeleton`; its large tensors are placeholders it never reads),
registers plain tensor attributes as buffers (so each constant has a name the
server resolves), wraps the tree with the taps' statistics hooks, exports it
(``torch.export``, non-strict, each free dim ``Dim.AUTO``) and compiles it
with AOTInductor, holding no weights (``package_constants_in_so=False``).
Beside the package it writes a :class:`~.package.PackageMeta`: the guards,
each symbol's range, the tapped outputs' shapes as an expression of the
inputs' symbols, and the model tensors the program reads.

A skeleton this process cannot unpickle (a class only the server can import)
exits with :data:`SKELETON_REFUSED`, so the server compiles that model itself.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layertap.server.compile.package import PackageMeta, input_symbols, register_output_types
from layertap.server.compile.skeleton import PLACEHOLDERS
from layertap.server.compile.variant import SinkEntry, StatsFunction, sink_entry

__all__ = ["SKELETON_REFUSED", "ChildJob", "main"]

#: The child's exit status when it cannot unpickle the skeleton.
SKELETON_REFUSED = 3


@dataclass
class ChildJob:
    """What the server asks of one child: the model, the taps, the inputs' structure, where the package goes."""

    skeleton: str  # path of the skeleton file
    key: tuple[str, ...]
    stats: StatsFunction | None
    #: Per input (positional by index, keyword by name): ``(dtype, shape)``, or None for a None argument.
    args: list[tuple[torch.dtype, tuple[int, ...]] | None]
    kwargs: dict[str, tuple[torch.dtype, tuple[int, ...]] | None]
    free: dict[int | str, tuple[int, ...]]
    options: dict[str, Any]
    out: str  # where the package goes; its metadata beside it (``.meta``)


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


def _build(job: ChildJob) -> None:
    """The child's work: export, compile, write the package and its metadata."""
    import torch._inductor  # noqa: PLC0415 - the child's one job
    from torch.export import Dim  # noqa: PLC0415

    try:
        module = pickle.loads(Path(job.skeleton).read_bytes())
    except Exception as exc:  # noqa: BLE001 - a class this process cannot import: the server compiles it
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        raise SystemExit(SKELETON_REFUSED) from None
    register_output_types()
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
    symbols = input_symbols(inputs)
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
    meta = PackageMeta(inputs, ranges, len(job.args), names, shapes, used)
    with open(job.out + ".meta", "wb") as f:
        pickle.dump(meta, f, protocol=pickle.HIGHEST_PROTOCOL)


def _bound(value: Any, infinite: int) -> int:
    """A range bound as an int (sympy's and torch's infinities become ``infinite``)."""
    try:
        return int(value)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return infinite


def main(argv: Sequence[str] | None = None) -> int:
    """The child: ``python -m layertap.server.compile.child JOB``."""
    path = (argv if argv is not None else sys.argv[1:])[0]
    try:
        os.nice(19)  # a compile yields every core to serving
    except OSError:
        pass
    torch.set_num_threads(1)
    with open(path, "rb") as f:
        job: ChildJob = pickle.load(f)
    _build(job)
    return 0


if __name__ == "__main__":  # run by name, so what it pickles names this module, not __main__
    from layertap.server.compile.child import main as _main

    sys.exit(_main())
