"""Review of issue 29: in-graph statistics against the eager hooks, for a tapped output that is
mutated in place later in the pass, and for a module called twice in one pass."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from support.e2e import wait_for
from torch import nn

import layertap
from layertap.server.host.sources import InputSpec, LoadedModel

BASIC = ["moments", "minmax", "nonfinite", "zero_fraction"]


class _Mutating(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)  # mutates lin's output in place
        self.twice = nn.Linear(8, 8)  # called twice per pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.lin(x))
        z = self.twice(y)
        z = self.twice(z)
        z += 1.0  # in place on twice's second output
        return z


def _loaded() -> LoadedModel:
    return LoadedModel(_Mutating().eval(), "mutating", "factory", [InputSpec("x", torch.float32, (-1, 8))])


def _pass(srv: Any, x: np.ndarray, selector: str, in_graph: bool = True
          ) -> dict[tuple[str, int], tuple[float, float, float]]:
    """Summaries of the second of three passes (after the first's compile, if any, is done); on a
    compiled server, the passes ran compiled (``in_graph``) or eager, as the tap's place says."""
    graph = srv.state.host.graph
    with layertap.Client(f"127.0.0.1:{srv.port}") as client, \
            client.watch(selector, reducers=BASIC, timeout=120) as stream:
        assert wait_for(lambda: client.stats().active_hooks >= 1)
        client.infer(x)
        if graph is not None:
            assert graph.wait_idle(120)
            before = graph.compiled_passes
        client.infer(x)
        client.infer(x)
        if graph is not None and in_graph:
            assert graph.compiled_passes >= before + 2, "the passes after the compile were not compiled"
        elif graph is not None:
            assert graph.compiled_passes == before, "a pass the graph cannot summarize ran compiled"
            assert [t.serving for t in client.taps()] == ["eager"]
        passes: dict[int, dict[tuple[str, int], tuple[float, float, float]]] = {}
        for s in stream:
            passes.setdefault(s.pass_index, {})[(s.layer, s.call_index)] = (
                s.results["moments"].mean, s.results["minmax"].min, s.results["minmax"].max)
            if len(passes) == 3:
                break
    return passes[sorted(passes)[1]]


def _both(make_server: Any, selector: str, in_graph: bool = True) -> tuple[dict[Any, Any], dict[Any, Any]]:
    x = np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)
    ref = _pass(make_server(_loaded()), x, selector)
    compiled = make_server(_loaded(), compile_model=True, compile_fallback="eager")
    assert compiled.state.host.graph.wait_idle(120)
    got = _pass(compiled, x, selector, in_graph)
    assert compiled.state.host.graph.wait_idle(120)
    return ref, got


@pytest.mark.timeout(240)
def test_in_graph_statistics_of_an_output_mutated_in_place_later_equal_eager(make_server) -> None:
    """Held at review: ``lin``'s output is ReLU'd in place after its hook; the graph reads it before."""
    ref, got = _both(make_server, "lin")
    assert set(got) == set(ref) == {("lin", 0)}
    np.testing.assert_allclose(got[("lin", 0)], ref[("lin", 0)], rtol=1e-5, atol=1e-6)
    assert ref[("lin", 0)][1] < 0  # the hook saw the pre-ReLU tensor


@pytest.mark.timeout(240)
def test_a_module_called_twice_gets_both_calls_summarized_when_compiled(make_server) -> None:
    """Failed at review: the compiled pass sent one summary for ``twice`` (call 0, the second call's values)
    where eager sends two. The graph keeps one row per layer, so such a tap now runs its passes eager."""
    ref, got = _both(make_server, "twice", in_graph=False)
    assert set(ref) == {("twice", 0), ("twice", 1)}
    assert set(got) == set(ref), f"compiled {sorted(got)} != eager {sorted(ref)}; compiled values {got}, eager {ref}"
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-6, err_msg=str(k))
