"""Review of issue 29: ``--compile-variants 1`` (accepted by the CLI) kills the model compiler."""

from __future__ import annotations

import numpy as np
import pytest
from support.e2e import wait_for
from support.models import two_loaded

import layertap


@pytest.mark.timeout(240)
def test_one_variant_cap_keeps_compiling_new_tap_sets(make_server) -> None:
    srv = make_server(two_loaded(), compile_model=True, compile_variants=1, compile_fallback="eager")
    graph = srv.state.host.graph
    assert graph.wait_idle(120)
    x = np.ones((4, 8), np.float32)
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        client.infer(x)  # the untapped variant serves: it is the last one
        assert graph.compiled_passes == 1
        tap = client.create_tap("a", reducers=["moments"])
        client.infer(x)  # queues ("a",); on ready, eviction must drop the untapped one
        assert graph.wait_idle(120), "the compiler never finished the tapped variant"
        client.infer(x)
        assert graph.state(("a",)) == "ready"
        client.delete_tap(tap.id)
        client.create_tap("b", reducers=["moments"])
        client.infer(x)  # queues ("b",)
        assert graph.wait_idle(60), (f"the compiler thread is gone ({graph._thread.is_alive()=}): "
                                     f"no tap set compiles any more; state of ('b',): {graph.state(('b',))}")
        assert graph.state(("b",)) == "ready"
        assert wait_for(lambda: graph.variants == 1)
