"""Compiled variants (compile.variant) and the background compiler that serves them (compile.serving).

Tiny models: each compile is a second or two on 2 cores (inductor's cache is shared across the run).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch._inductor.compile_fx import compile_fx

from layertap.server.compile.kernel import graph_stats
from layertap.server.compile.modes import check_mode
from layertap.server.compile.serving import CompiledServing, GraphPlan
from layertap.server.compile.variant import Variant, clone_tree
from layertap.server.reducers.stats_body import SHIFT_SAMPLE, basic_stats_body
from layertap.server.taps.graph import GraphFeed

pytestmark = pytest.mark.slow


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16)).eval()


def _entries(fn: Any) -> int:
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(fn.__code__))


def test_clone_tree_shares_the_weights_and_leaves_the_hooks_behind() -> None:
    model = _mlp()
    handle = model[0].register_forward_hook(lambda *_: None)
    try:
        tree = clone_tree(model)
        assert tree is not model and tree[0] is not model[0]
        assert tree[0].weight is model[0].weight  # the same tensor: no copy, in-place updates are seen
        assert not tree[0]._forward_hooks and model[0]._forward_hooks
        tree[2].register_forward_hook(lambda *_: None)
        assert not model[2]._forward_hooks
    finally:
        handle.remove()


def test_each_variant_is_its_own_function_and_never_compiles_on_the_callers_thread() -> None:
    model = _mlp()
    a, b = Variant(model, (), compile_fx, 1), Variant(model, (), compile_fx, 2)
    assert a.fn.__code__ is not b.fn.__code__  # dynamo counts recompiles per code object
    with torch.inference_mode():
        assert a.run((torch.randn(4, 8),), {}) is None  # nothing compiled yet: None, not a compile
    assert _entries(a.fn) == 0
    with pytest.raises(ValueError, match="statistics function"):
        Variant(model, ("0",), compile_fx, 3)


def _moments(row: torch.Tensor) -> torch.Tensor:
    """(mean, sum of squared deviations) from a statistics row: shift-free."""
    n, sy, syy, k = row[2], row[3], row[4], row[5]
    return torch.stack([k + sy / n, syy - sy * sy / n])


def test_in_graph_statistics_equal_the_eager_kernel() -> None:
    model = _mlp()
    v = Variant(model, ("0", "2"), compile_fx, 4, GraphFeed.statistics)
    with torch.inference_mode():
        x = torch.randn(5, 8)
        torch._dynamo.maybe_mark_dynamic(x, 0)
        v.compile((x,), {})
        y = torch.randn(9, 8)
        got = v.run((y,), {})  # another batch: the same entry (dynamic batch)
        assert got is not None
        out, stats, shapes = got
        torch.testing.assert_close(out, model(y), rtol=1e-5, atol=1e-6)
        assert stats is not None and stats.shape == (2, 8) and stats.dtype == torch.float64
        assert [tuple(s) for s in shapes] == [(9, 32), (9, 16)]
        hidden = model[0](y)
        rnd = torch.zeros(SHIFT_SAMPLE, dtype=torch.int64)
        on = torch.ones((1,), dtype=torch.float64)
        for row, tensor in zip(stats, (hidden, model(y))):
            eager = basic_stats_body(tensor.reshape(-1), rnd, on)
            # Counts, min and max are the same; the sums are shifted by each path's own K (slot 5),
            # so compare what they mean: the mean and the sum of squared deviations.
            torch.testing.assert_close(row[[0, 1, 2, 6, 7]], eager[[0, 1, 2, 6, 7]], rtol=0, atol=0)
            torch.testing.assert_close(_moments(row), _moments(eager), rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(row, graph_stats(tensor), rtol=1e-6, atol=1e-6)
        entries = _entries(v.fn)
        assert v.run((torch.randn(1, 8),), {}) is None  # batch 1 is specialized: a miss, never a compile
        assert _entries(v.fn) == entries


class _Taps:
    """A stand-in for the tap engine's GraphFeed."""

    def __init__(self) -> None:
        self.key: tuple[str, ...] = ()
        self.fed: list[tuple[tuple[str, ...], torch.Tensor]] = []
        self.statistics = GraphFeed.statistics

    def graph_plan(self, ctx: Any) -> GraphPlan:
        return GraphPlan(self.key)

    def graph_feed(self, ctx: Any, key: tuple[str, ...], stats: torch.Tensor, shapes: list[tuple[int, ...]]) -> None:
        self.fed.append((key, stats))


def test_tap_changes_compile_in_the_background_and_the_lru_caps_the_variants() -> None:
    model = _mlp()
    serving = CompiledServing(model, {0: (0,)}, max_variants=2, fallback="eager")
    serving.taps = taps = _Taps()
    x = torch.randn(4, 8)
    try:
        with torch.inference_mode():
            for key in [("0",), ("2",), ("0", "2")]:
                taps.key = key
                assert serving.serve((x,), {}, None) == (False, None)  # queued: eager meanwhile
                assert serving.state(key) in ("queued", "compiling", "ready")
                assert serving.wait_idle(300)
                served, out = serving.serve((x,), {}, None)
                assert served and serving.state(key) == "ready"
                torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)
                assert taps.fed[-1][0] == key and taps.fed[-1][1].shape == (len(key), 8)
            taps.key = ("0",)  # evicted: a ready superset serves at once while its own graph compiles again
            served, _ = serving.serve((x,), {}, None)
            assert served and taps.fed[-1][0] == ("0", "2")
            assert serving.wait_idle(300)
    finally:
        assert serving.close()
    assert serving.request_thread_compiles == 0
    assert serving.compile_failures == 0
    assert serving.variants == 2 and serving.evictions == 2
    assert serving.compiled_passes == 4 and serving.eager_passes == 3


def test_pending_fallback_keeps_the_last_graph_serving_while_the_new_one_compiles() -> None:
    model = _mlp()
    serving = CompiledServing(model, {0: (0,)}, fallback="pending")
    serving.taps = taps = _Taps()
    x = torch.randn(4, 8)
    try:
        with torch.inference_mode():
            serving.serve((x,), {}, None)
            assert serving.wait_idle(300)
            assert serving.serve((x,), {}, None)[0]
            taps.key = ("2",)
            served, _ = serving.serve((x,), {}, None)
            assert served  # the untapped graph, while the tapped one compiles
            assert not taps.fed
            assert serving.wait_idle(300)
            assert serving.serve((x,), {}, None)[0] and taps.fed[-1][0] == ("2",)
    finally:
        serving.close()


def test_unverified_cuda_graph_modes_are_refused_on_cuda_with_the_reason() -> None:
    why = check_mode("max-autotune", torch.device("cuda", 0))
    assert why is not None and "CUDA graphs" in why and "max-autotune-no-cudagraphs" in why
    assert check_mode("reduce-overhead", torch.device("cuda", 0)) is None  # verified on an H200
    assert check_mode("max-autotune-no-cudagraphs", torch.device("cuda", 0)) is None
    assert check_mode("default", torch.device("cpu")) is None
    assert "expected one of" in (check_mode("fast", torch.device("cpu")) or "")


def test_a_layer_whose_output_is_its_parents_too_is_reduced_once() -> None:
    # A Sequential's last block returns the Sequential's own output: both taps read one tensor, and
    # an exported graph reduces it once (tests/server/compile/test_compile_process.py). A dynamo trace
    # cannot compare versions, so it reduces it twice: same values.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.ReLU(), nn.Linear(16, 16))).eval()
    calls: list[torch.Size] = []

    def stats(out: torch.Tensor) -> torch.Tensor:
        calls.append(out.shape)
        return graph_stats(out)

    v = Variant(model, ("1", "1.1", "0"), compile_fx, 7, graph_stats)
    x = torch.randn(4, 8)
    with torch.inference_mode():
        compiled = v.compile((x.clone(),), {})
        # The entry function itself, eager, what dynamo traced (a counting function of its own:
        # dynamo would guard on the list it appends to). No inference tensors: they have no version.
        with torch.inference_mode(False), torch.no_grad():
            _out, got, shapes = Variant(model, ("1", "1.1", "0"), compile_fx, 8, stats).fn((x.clone(),), {})
        assert len(calls) == 2, "the shared output was reduced twice"
        assert got is not None and torch.equal(got[0], got[1]) and list(shapes) == [(4, 16)] * 3
        torch.testing.assert_close(got[0], graph_stats(model(x)), rtol=0, atol=0)
        torch.testing.assert_close(got[2], graph_stats(model[0](x)), rtol=0, atol=0)
        torch.testing.assert_close(compiled[1], got, rtol=1e-9, atol=1e-9)


def test_a_shared_output_changed_in_place_in_between_is_reduced_again() -> None:
    # An inplace ReLU returns its input, changed: its tap must see the values after it, not reuse
    # the Linear's statistics of the same tensor object.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True)).eval()
    v = Variant(model, ("0", "1"), compile_fx, 9, graph_stats)
    x = torch.randn(4, 8)
    with torch.inference_mode():
        pre = model[0](x)
        want = torch.stack([graph_stats(pre), graph_stats(torch.relu(pre))])
        _out, compiled, _shapes = v.compile((x.clone(),), {})
        with torch.inference_mode(False), torch.no_grad():
            _out, eager, _shapes = v.fn((x.clone(),), {})
    assert eager is not None and compiled is not None
    assert eager[0, 6] < 0 <= eager[1, 6], "the ReLU's tap reported the Linear's minimum"
    torch.testing.assert_close(eager, want, rtol=0, atol=0)
    torch.testing.assert_close(compiled, want, rtol=1e-9, atol=1e-9)
