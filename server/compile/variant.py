"""One compiled variant of a hosted model: its own module tree, its taps' statistics inside the graph.

Why a copy of the module tree: the taps' Python hooks live on the eager
module, and dynamo traces whatever hooks a module holds when it compiles
(and, with ``skip_nnmodule_hook_guards`` on by default in torch 2.13, ignores
hooks added later). :func:`clone_tree` copies every module object with empty
hook dicts, sharing the parameters and buffers (the same tensors, no copy):
the eager taps never reach a compiled graph, and a variant's own statistics
hooks never reach the eager module.

Why a fresh function per variant: dynamo keeps its compiled entries on the
code object of the frame it compiles, and counts recompiles per code object
(``recompile_limit``, 8). Each variant's entry function is a copy of
:func:`_body`'s code (``code.replace``), so every variant is its own compiled
object: twenty tap changes are twenty lookups in our cache, never the ninth
recompile of one function that dynamo would answer by running eager. An
evicted variant's code object dies with it, and its compiled entries too.

Why we check the guards ourselves: a request thread must never compile.
:meth:`Variant.run` checks each compiled entry's guard tree (what dynamo's
frame callback would check) and calls the compiled bytecode directly; when
no entry's guards hold (a batch of 1 where the graph was traced with batch
2, say) it returns None and the pass runs eager, while the controller
compiles that shape in the background (:mod:`.compiled`).

The statistics function comes from the taps' stage (``stats``: the compiled
basic-statistics kernel's body, see :mod:`layertap.server.taps.graph`),
traced at each tapped module's output, so inductor fuses it with the graph
around it.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["COUNT32_LIMIT", "GraphResult", "SinkEntry", "StatsFunction", "Variant", "clone_tree", "sink_entry"]

#: A tapped tensor's element count from which its statistics in a graph count in int64, not int32
#: (``compile.kernel.graph_stats``); a package's guards keep its inputs under it.
COUNT32_LIMIT = 2**31

#: Every hook dict of an ``nn.Module``: a clone starts with each empty.
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
               "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_hooks",
               "_backward_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks")

#: ``(output, stats, shapes)`` of one compiled pass: the model's output, the
#: ``(len(key), BASIC_WIDTH)`` float64 statistics (None for a variant without
#: taps) and each tapped output's shape.
GraphResult = tuple[Any, "torch.Tensor | None", list[tuple[int, ...]]]


def clone_tree(root: nn.Module) -> nn.Module:
    """A copy of every module object of ``root``, hook-free, sharing parameters and buffers."""
    memo: dict[int, nn.Module] = {}

    def cp(module: nn.Module) -> nn.Module:
        hit = memo.get(id(module))
        if hit is not None:  # a module reachable twice stays one module
            return hit
        new = copy.copy(module)
        new.__dict__ = dict(module.__dict__)
        memo[id(module)] = new
        new._modules = {k: (cp(v) if v is not None else None) for k, v in module._modules.items()}
        for name in _HOOK_DICTS:
            if name in module.__dict__:
                setattr(new, name, type(getattr(module, name))())
        return new

    return cp(root)


def _entry_function(name: str, tree: nn.Module, n: int, sink: dict[int, Any]) -> types.FunctionType:
    """A fresh function (its own code object) that runs ``tree`` and gathers its statistics.

    The sink is emptied before returning: dynamo guards the dict as it finds it on entry."""
    def make() -> Callable[..., GraphResult]:
        tree_, n_, sink_ = tree, n, sink

        def entry(args: tuple[Any, ...], kwargs: dict[str, Any]) -> GraphResult:
            out = tree_(*args, **kwargs)
            if n_:
                stats = torch.stack([sink_[i][0] for i in range(n_)])
                shapes = [sink_[i][1] for i in range(n_)]
            else:
                stats, shapes = None, []
            sink_.clear()
            return out, stats, shapes

        return entry

    template = make()
    assert isinstance(template, types.FunctionType)
    code = template.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, template.__globals__, name, None, template.__closure__)


#: ``stats(output)``: one tapped output's statistics vector, traced into the graph.
StatsFunction = Callable[[torch.Tensor], torch.Tensor]


def _version(t: torch.Tensor) -> int | None:
    # A dynamo trace reads a version as an unknown size, so it cannot say two are equal, and an
    # inference tensor has none: neither shares.
    return None if torch.compiler.is_dynamo_compiling() or t.is_inference() else t._version


#: One tap's entry in a pass's sink: ``(statistics, shape, output, output's version)``.
SinkEntry = tuple[torch.Tensor, Any, torch.Tensor, "int | None"]


def sink_entry(seen: Iterable[SinkEntry], out: torch.Tensor, stats: StatsFunction) -> SinkEntry:
    """A tapped output's sink entry: its statistics traced, or an earlier tap's of this very tensor.

    A module's output is often its parent's too (a Sequential's last block): one read for both.
    Not after an in-place change (an inplace ReLU returns its input): its version moved on."""
    version = _version(out)
    same = None if version is None else next((v[0] for v in seen if v[2] is out and v[3] == version), None)
    return stats(out.detach()) if same is None else same, out.shape, out, version


def _stats_hook(index: int, sink: dict[int, Any], stats: StatsFunction) -> Callable[[nn.Module, Any, Any], None]:
    def hook(_module: nn.Module, _args: Any, out: Any) -> None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"a tapped output must be one tensor for in-graph statistics, got {type(out).__name__}")
        sink[index] = sink_entry(sink.values(), out, stats)

    return hook


class Variant:
    """The model compiled with in-graph statistics at ``key``'s layers (none: the plain compiled model).

    Args:
        model: The eager module (never changed).
        key: Layer names whose output statistics the graph computes, in stats row order.
        backend: The dynamo backend (see :mod:`.compiled`: it counts compiles per thread).
        serial: A number that names the entry function (``layertap_variant_<serial>``).
        stats: The statistics traced at each key layer's output (needed when ``key`` is not empty).
    """

    def __init__(self, model: nn.Module, key: Sequence[str], backend: Callable[..., Any], serial: int,
                 stats: StatsFunction | None = None) -> None:
        self.key = tuple(key)
        self.tree = clone_tree(model)
        modules = dict(self.tree.named_modules())
        self._sink: dict[int, Any] = {}
        if self.key and stats is None:
            raise ValueError("a variant with tapped layers needs a statistics function")
        for i, layer in enumerate(self.key):
            assert stats is not None
            modules[layer].register_forward_hook(_stats_hook(i, self._sink, stats))
        self.fn = _entry_function(f"layertap_variant_{serial}", self.tree, len(self.key), self._sink)
        self.compiled = torch.compile(self.fn, backend=backend, fullgraph=True)
        #: ``(guard check, compiled bytecode)`` per compiled shape entry, newest first.
        self._entries: tuple[tuple[Callable[[dict[str, Any]], bool], types.FunctionType], ...] = ()
        self._freevars = dict(zip(self.fn.__code__.co_freevars,
                                  (c.cell_contents for c in (self.fn.__closure__ or ()))))

    @property
    def shapes_compiled(self) -> int:
        return len(self._entries)

    def compile(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> GraphResult:
        """Trace and compile for these example inputs (background thread only), then index the entries.

        Raises:
            RuntimeError: When the compiled entries cannot be read back (this torch lacks the introspection).
        """
        out: GraphResult = self.compiled(args, kwargs)
        self._refresh()
        if self.run(args, kwargs) is None:
            raise RuntimeError("the fresh graph's guards reject its own example")
        return out

    def _refresh(self) -> None:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list  # noqa: PLC0415 - private API

        entries = _debug_get_cache_entry_list(self.fn.__code__)
        self._entries = tuple(
            (e.guard_manager.check, types.FunctionType(e.code, self.fn.__globals__, self.fn.__name__, None,
                                                       self.fn.__closure__))
            for e in entries)

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> GraphResult | None:
        """The compiled pass when some compiled entry's guards hold, else None (nothing ran). Never compiles."""
        if not self._entries:
            return None
        local = {"args": args, "kwargs": kwargs, **self._freevars}
        for check, code in self._entries:
            if check(local):
                result: GraphResult = code(args, kwargs)
                return result
        return None
