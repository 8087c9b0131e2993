"""The compiled statistics kernel inside a real server: compiled ahead at tap
creation, used by the passes after it is ready, exported, and exact.

The one e2e test with compiling on (conftest turns it off elsewhere, so that
background compiles never steal CPU from timing-sensitive tests).
"""

from __future__ import annotations

import numpy as np
import pytest
from support.e2e import assert_basic_summaries, batch, first_per_layer, scrape, wait_for
from support.models import layer_outputs

import layertap
from layertap.server.app import process_compilation
from layertap.server.compile.kernel import DENSE, Signature
from layertap.server.compile.stats import supported

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not supported(), reason="this torch lacks what the compiled path reads")]


def test_tap_creation_compiles_ahead_and_later_passes_run_compiled(make_server):
    srv = make_server(compile_reducers=True, metrics_port=0)
    assert srv.state.compiled_stats is process_compilation().stats is srv.state.taps.stats  # app.py hands it on
    try:
        x = batch(3, seed=4)
        ref = layer_outputs(x, ["layer1", "layer2", "layer3", "layer4"])
        with layertap.Client(f"127.0.0.1:{srv.port}") as client:
            failures = process_compilation().stats.compile_failures
            # With a histogram the plan is not basic-only: it runs on the plan path, whose basic statistics
            # the compiled kernel computes (a basic-only tap's firing is one layertap::tap_stats call instead).
            with client.watch("layer*", reducers=["moments", "minmax", "nonfinite", "zero_fraction", "histogram"],
                              timeout=300) as stream:
                assert wait_for(lambda: client.stats().active_hooks == 4)
                # The compile was queued when the tap was created, before any pass saw the layers.
                assert process_compilation().stats.wait_idle(240), "background compile did not finish"
                server_pass = Signature(srv.state.host.device, srv.state.host.dtype, DENSE,
                                        grad=False, inference=True, autocast=None)
                assert process_compilation().stats.states().get(server_pass) == "ready", process_compilation().stats.states()
                assert process_compilation().stats.compile_failures == failures
                calls = process_compilation().stats.compiled_calls
                client.infer(x)
                got = first_per_layer(stream, 4)
            assert process_compilation().stats.compiled_calls >= calls + 4  # every tapped tensor of that pass
            assert_basic_summaries(got, ref)
            for name, s in got.items():
                assert s.results["zero_fraction"].fraction == pytest.approx(float(np.mean(ref[name] == 0)), abs=1e-12)
        assert srv.metrics_port is not None
        metrics = scrape(srv.metrics_port)
        assert metrics["layertap_reducer_compiles_total"] == process_compilation().stats.compiles
        assert metrics["layertap_reducer_compiled_calls_total"] >= 4
    finally:
        process_compilation().stats.set_enabled(False)


def test_no_compile_exports_no_compile_series(make_server):
    srv = make_server(metrics_port=0)  # conftest: compile_reducers=False, like --no-compile
    assert not process_compilation().stats.enabled
    assert srv.metrics_port is not None
    assert "layertap_reducer_compiles_total" not in scrape(srv.metrics_port)
