"""An AOTInductor package loaded in the server: its metadata, its constants on the live weights, its guards.

The child (:mod:`.child`) builds the package with no weights in it and writes
:class:`PackageMeta` beside it; the server loads both here. Every constant is
pointed at the live model's own tensor (``load_constants(...,
user_managed=True)``: no copy); a package with a constant the server cannot
resolve (a tensor the forward itself makes, which AOTInductor keeps under a
name of its own), or one that bakes in a model tensor it did not expose,
fails to load, and that compile counts as failed.

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
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from layertap.server.compile.variant import COUNT32_LIMIT, GraphResult

__all__ = ["Package", "PackageMeta", "input_symbols", "register_output_types"]

#: The wrapper's attribute that holds the model: every constant's name starts with it.
_ROOT = "model"


@dataclass
class PackageMeta:
    """What the server needs besides the package: guards, output shapes, the tensors it must set.

    The child pickles it beside the package (so it lives here, importable by both sides)."""

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


def input_symbols(inputs: list[tuple[torch.dtype, list[int | str]] | None]) -> set[str]:
    """The symbols the inputs' free dims were traced as."""
    return {d for spec in inputs if spec is not None for d in spec[1] if isinstance(d, str)}


def register_output_types() -> None:
    """Registers the output types export must flatten: a transformers model returns its ``DynamicCache``.

    In the child before export, and in the server before loading a package (its output spec names the type)."""
    if "transformers" not in sys.modules:
        return
    from transformers.integrations.executorch import register_dynamic_cache_export_support  # noqa: PLC0415

    register_dynamic_cache_export_support()  # type: ignore[no-untyped-call]  # idempotent


def _resolve(root: nn.Module, name: str) -> torch.Tensor | None:
    """The tensor at a dotted attribute path of ``root``, or None."""
    obj: Any = root
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, torch.Tensor) else None


class Package:
    """One loaded package: its guards, and a call that feeds the statistics' shapes from the inputs."""

    def __init__(self, path: str, meta: PackageMeta, root: nn.Module) -> None:
        import torch._inductor  # noqa: PLC0415

        self.meta = meta
        register_output_types()
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
            f"lambda {', '.join(sorted(input_symbols(meta.inputs)))}: {meta.shapes}",
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
