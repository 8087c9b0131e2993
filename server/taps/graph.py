"""The taps' side of a compiled pass: which layers need in-graph statistics, and feeding them on.

A tap runs inside the compiled graph (:mod:`layertap.server.compile.serving`)
when all it asks of a pass is the basic statistics of a layer's output
tensor: point ``output``, basic reducers only (per layer too), no latency
timer, no derived quantity, no Generate request binding, every pass
(``phases`` unset), and an output recorded as one non-empty tensor. Any other live hook (such a tap that is not, a
capture) makes the pass eager, as does a pass whose attention mask pads a
row while a tap leaves padding out (the graph reduces whole tensors).

A compiled pass's statistics then take the same road as a hook's: one
vector per tapped layer into the pass buffer, one device-to-host copy when
the pass ends (the host-transfer thread), decoded by the taps' own plans.
No ``.item()`` or ``.cpu()`` on the model thread.

A container that returns its last child's output as is (``layer1`` of a
ResNet is ``layer1.1``'s output, see :mod:`.reuse`) is computed once in the
graph, at the child: the key names the child, and both taps' layers read
its row, as the eager path's reuse shares one reduction.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from layertap.server.compile.kernel import graph_stats
from layertap.server.compile.serving import COMPILING, FAILED, QUEUED, READY, CompiledServing, GraphPlan
from layertap.server.host.model_host import ModelHost, PassContext
from layertap.server.reducers.plan import ReducerPlan
from layertap.server.reducers.transfer import PassBuffer
from layertap.server.stream.publisher import Piece
from layertap.server.taps.pass_decision import thin
from layertap.server.taps.reuse import passthrough_parents
from layertap.server.taps.tap import Tap
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["GraphFeed"]


def _basic(plan: ReducerPlan | None) -> bool:
    return plan is None or plan.basic_layout is not None


class GraphFeed:
    """Implements :class:`~layertap.server.compile.serving.GraphTaps` for a tap engine (model thread).

    Args:
        host: The model host.
        taps: The engine's live taps.
        pass_buffer: The engine's buffer and pieces of the current pass (the buffer made on first use).
        graph: The host's compiled serving; None: every tap is served eager.
    """

    def __init__(self, host: ModelHost, taps: Callable[[], list[Tap]],
                 pass_buffer: Callable[[], tuple[PassBuffer, list[Piece[Tap]]]],
                 graph: CompiledServing | None, owned_hooks: Callable[[list[Tap]], int]) -> None:
        self._host = host
        #: The torch hooks that serve the given taps (``TapHooks.torch_handles``): any other hook means eager.
        self._owned_hooks = owned_hooks
        self._graph = graph
        self._taps = taps
        self._pass_buffer = pass_buffer
        self._index: tuple[tuple[str, ...], dict[str, int]] = ((), {})
        self._pass_taps: list[Tap] = []
        parents = passthrough_parents(host.modules)
        #: Layer -> the layer whose output it returns as is (itself when none).
        self._same: dict[str, str] = {}
        for layer in parents:
            child = layer
            while child in parents:
                child = parents[child]
            self._same[layer] = child

    def _key(self, taps: list[Tap]) -> tuple[str, ...]:
        """The layers a graph must compute for these taps: each tensor once."""
        same = self._same
        return tuple(sorted({same.get(layer, layer) for t in taps for layer in t.layers}))

    @staticmethod
    def statistics(out: torch.Tensor) -> torch.Tensor:
        """The basic-statistics vector of a tapped output, traced into the graph.

        :func:`~layertap.server.compile.kernel.graph_stats`: the compiled kernel's
        reductions with a cheaper shift K (the eager path's is a rank median of a random sample),
        so the moments agree with eager within float tolerance, not bit for bit.
        """
        # The tensor as it is, never reshape(-1): inductor may lay an activation out channels_last,
        # and a flat view would make it copy the tensor and reduce it in a strided scalar loop.
        return graph_stats(out)

    def in_graph(self, tap: Tap) -> bool:
        """Whether the tap's statistics can all be computed inside the compiled graph."""
        if (tap.spec.point != pb.POINT_OUTPUT or tap.request_id is not None or tap.derive is not None
                or tap.timer is not None or tap.phases is not None):
            return False
        if tap.plan.basic_layout is None or not _basic(tap.always):
            return False
        if not all(_basic(p) for p in list(tap.layer_plans.values())):
            return False
        shapes = self._host.layer_shapes
        for layer in tap.layers:
            seen = shapes.get(layer)
            # One call per pass: the graph keeps one statistics row per layer, so a module called
            # twice (the demo's shared ReLUs) is summarized per call by its eager hooks instead.
            if seen is None or seen.calls != 1 or len(seen.outputs) != 1 or math.prod(seen.outputs[0]) == 0:
                return False
        return True

    def graph_plan(self, ctx: PassContext) -> GraphPlan:
        taps = [t for t in self._taps() if not t.disabled]
        graph = [t for t in taps if self.in_graph(t)]
        self._pass_taps = graph
        owned = self._owned_hooks(graph)
        key = self._key(graph)
        eager = len(graph) != len(taps) or self._host.hooks.active != owned
        mask = ctx.attention_mask
        if not eager and mask is not None and any(not t.spec.keep_padding for t in graph):
            eager = not bool(mask.all())  # a host tensor: no device sync
        return GraphPlan(key, eager)

    def graph_feed(self, ctx: PassContext, key: tuple[str, ...], stats: torch.Tensor,
                   shapes: list[tuple[int, ...]]) -> None:
        """Hand each tap its layers' statistics rows, as its hooks would have (sampling included)."""
        if self._index[0] != key:
            rows = {layer: i for i, layer in enumerate(key)}
            rows.update({layer: rows[child] for layer, child in self._same.items() if child in rows})
            self._index = (key, rows)
        index = self._index[1]
        buffer, pieces = self._pass_buffer()
        for tap in self._pass_taps:
            if tap._pass != ctx.index:
                tap.calls.clear()
                tap.settle()
                tap._pass, tap._padding, tap._cut, tap._skip = ctx.index, None, None, False
                sampled, always = thin(tap, tap.sampler.sample())  # the overhead budget's strides too
                tap._sampled, tap._on = sampled, sampled or always
            for layer in tap.layers:
                i = index.get(layer)
                if i is None:
                    continue  # served by a graph without it (pending, or its compile failed)
                plan = tap.layer_plans.get(layer, tap.plan) if tap._sampled else tap.always if tap._on else None
                if plan is None:
                    continue
                tap.calls[layer] = 1
                buffer.add(len(pieces), stats[i])
                pieces.append(Piece(tap, layer, 0, 0, tuple(shapes[i]), plan, tap._sampled))

    def serving(self, tap: Tap) -> pb.TapServing.ValueType:
        """The tap's ``TapServing`` state now."""
        graph = self._graph
        if graph is None or not self.in_graph(tap):
            return pb.TAP_SERVING_EAGER
        key = self._key([t for t in self._taps() if not t.disabled and self.in_graph(t)])
        state = graph.state(key)
        if state == READY or graph.serves([self._same.get(layer, layer) for layer in tap.layers]):
            return pb.TAP_SERVING_IN_GRAPH
        if state == FAILED:
            return pb.TAP_SERVING_COMPILE_FAILED
        if state in (COMPILING, QUEUED) or state is None:
            return pb.TAP_SERVING_COMPILING_EAGER if graph.fallback == "eager" else pb.TAP_SERVING_PENDING
        return pb.TAP_SERVING_EAGER
