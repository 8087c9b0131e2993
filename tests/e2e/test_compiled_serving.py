"""``serve --compile-model`` (issue 29): taps on a compiled demo model and a compiled transformer.

One compiled demo server serves the module's tests in order (each compile
costs seconds on 2 cores; inductor's cache is shared across the run).
Every test awaits the background compiler before it ends.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support import hf_models
from support.e2e import batch, scrape, wait_for
from support.models import layer_outputs

import layertap
from layertap.server.host.compile_process import ProcessVariant
from layertap.server.host.compiled_graph import Variant

BASIC = ["moments", "minmax", "nonfinite", "zero_fraction"]
LAYERS = ["layer1", "layer2", "layer3", "layer4"]
COMPILE_WAIT = 300


def _close(srv: Any) -> None:
    graph = srv.state.host.graph
    if graph is not None:
        assert graph.wait_idle(COMPILE_WAIT), "a background compile did not finish"
    srv.state.taps.close()
    srv.stop(0)


@pytest.fixture(scope="module")
def compiled_demo():
    from layertap.server.app import start_server
    from layertap.server.config import ServerConfig

    srv = start_server(ServerConfig(port=0, metrics_port=0, compile_reducers=False, compile_model=True,
                                    compile_fallback="eager"))
    assert srv.state.host.graph.wait_idle(COMPILE_WAIT)
    yield srv
    _close(srv)


def _assert_close(got: dict[str, Any], ref: dict[str, np.ndarray], rtol: float) -> None:
    assert set(got) == set(ref)
    for name, s in got.items():
        r = ref[name]
        assert s.results["moments"].count == r.size
        np.testing.assert_allclose(s.results["moments"].mean, r.mean(), rtol=rtol, atol=1e-6)
        np.testing.assert_allclose(s.results["moments"].std, r.std(), rtol=rtol)
        np.testing.assert_allclose([s.results["minmax"].min, s.results["minmax"].max], [r.min(), r.max()],
                                   rtol=rtol, atol=1e-6)
        assert s.results["nonfinite"].nan_count == 0
        assert s.results["zero_fraction"].fraction == pytest.approx(float(np.mean(r == 0)), abs=1e-3)


def _next_pass(stream: Any, layers: int) -> dict[str, Any]:
    got: dict[str, Any] = {}
    for s in stream:
        got[s.layer] = s
        if len(got) == layers:
            return got
    raise AssertionError("the stream ended")


def test_summaries_and_captures_on_the_compiled_demo_equal_eager(compiled_demo) -> None:
    graph = compiled_demo.state.host.graph
    x = batch(3, seed=4)
    ref = layer_outputs(x, LAYERS)
    with layertap.Client(f"127.0.0.1:{compiled_demo.port}") as client, \
            client.watch("layer?", reducers=BASIC, timeout=COMPILE_WAIT) as stream:
        assert wait_for(lambda: client.stats().active_hooks == 4)
        assert client.taps()[0].serving in ("compiling_eager", "in_graph")
        client.infer(x)  # served now: by the eager module while its graph compiles (or by the graph)
        _assert_close(_next_pass(stream, 4), ref, 1e-9 if graph.compiled_passes == 0 else 1e-5)
        assert graph.wait_idle(COMPILE_WAIT)
        assert [t.serving for t in client.taps()] == ["in_graph"]
        before = client.stats()
        client.infer(x)
        after = client.stats()
        assert after.compiled_passes == before.compiled_passes + 1, "the tapped pass ran eager"
        _assert_close(_next_pass(stream, 4), ref, 1e-5)  # inductor reorders float sums: not bit for bit
        # An active capture runs the eager module (its hooks are there): exact.
        got = client.capture("layer2", input=x)
        np.testing.assert_array_equal(np.asarray(got, dtype=np.float64), ref["layer2"])
        assert client.stats().request_thread_compiles == 0
    metrics = scrape(compiled_demo.metrics_port)  # {sample name: value}: one series per name here
    assert metrics["layertap_request_thread_compiles_total"] == 0
    assert metrics["layertap_compiled_variants"] >= 2
    assert metrics["layertap_compile_seconds_total"] > 0


def test_tap_churn_under_load_never_compiles_on_a_request_thread(compiled_demo) -> None:
    graph = compiled_demo.state.host.graph
    x = batch(2, seed=1)
    stop = threading.Event()
    served: list[int] = []
    errors: list[BaseException] = []
    address = f"127.0.0.1:{compiled_demo.port}"

    def load() -> None:
        try:
            with layertap.Client(address) as c:
                while not stop.is_set():
                    c.infer(x)
                    served.append(1)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    try:
        with layertap.Client(address) as client:
            for i in range(20):  # three tap sets: two graphs compile in the background under load
                selector = ("layer?", "layer?.0", "layer?.1")[i % 3]
                tap = client.create_tap(selector, reducers=["moments"], name=f"churn-{i}")
                client.infer(x)
                client.delete_tap(tap)
            assert graph.wait_idle(COMPILE_WAIT)
            tap = client.create_tap("layer?.1", reducers=["moments"], name="churn-last")
            assert wait_for(lambda: client.taps()[0].serving == "in_graph", timeout=COMPILE_WAIT)
            before = client.stats()
            for _ in range(5):
                client.infer(x)
            after = client.stats()
            client.delete_tap(tap)
    finally:
        stop.set()
        worker.join(60)
    assert not errors, errors
    assert len(served) > 20
    # Still compiled after 20 cycles: our variants, not dynamo's ninth recompile falling back to eager.
    assert after.compiled_passes - before.compiled_passes >= 5
    assert after.request_thread_compiles == 0
    assert after.compiled_variants <= graph.max_variants
    assert graph.compile_failures == 0


def test_a_compile_failure_keeps_the_old_graph_serving(compiled_demo, monkeypatch) -> None:
    graph = compiled_demo.state.host.graph
    for cls in (Variant, ProcessVariant):  # wherever the server compiles (a child's own failure: test_compile_process)
        real = cls.compile

        def failing(self: Any, args: Any, kwargs: Any, real: Any = real) -> Any:
            if "fc" in self.key:
                raise RuntimeError("injected compile failure")
            return real(self, args, kwargs)

        monkeypatch.setattr(cls, "compile", failing)
    x = batch(2, seed=3)
    with layertap.Client(f"127.0.0.1:{compiled_demo.port}") as client:
        failures = client.stats().model_compile_failures
        tap = client.create_tap("fc", reducers=["moments"], name="doomed")
        client.infer(x)  # queues the compile (served eager meanwhile)
        assert graph.wait_idle(COMPILE_WAIT)
        assert client.stats().model_compile_failures == failures + 1
        assert [t.serving for t in client.taps()] == ["compile_failed"]
        before = client.stats().compiled_passes
        out = client.infer(x)
        assert client.stats().compiled_passes == before + 1, "the old graph did not keep serving"
        assert np.asarray(out).shape == (2, 10)
        client.delete_tap(tap)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    return hf_models.save("llama", tmp_path_factory.mktemp("hf"))


def test_taps_on_a_compiled_transformer_equal_eager(make_server, llama_dir) -> None:
    path, model = llama_dir
    layers = ["model.layers.0", "model.layers.1"]
    x = hf_models.example_input("llama", batch=2, tokens=6)
    seen: dict[str, np.ndarray] = {}
    handles = [model.get_submodule(n).register_forward_hook(
        lambda _m, _a, o, n=n: seen.__setitem__(n, (o[0] if isinstance(o, tuple) else o).double().numpy()))
        for n in layers]
    with torch.inference_mode():
        model(x)
    for h in handles:
        h.remove()
    srv = make_server(model=f"hf:{path}", compile_model=True, compile_fallback="eager")
    graph = srv.state.host.graph
    try:
        with layertap.Client(f"127.0.0.1:{srv.port}") as client, \
                client.watch("model.layers.?", reducers=BASIC, timeout=COMPILE_WAIT) as stream:
            assert wait_for(lambda: client.stats().active_hooks == 2)
            client.infer(x.numpy())
            _next_pass(stream, 2)
            assert graph.wait_idle(COMPILE_WAIT)
            assert [t.serving for t in client.taps()] == ["in_graph"]
            before = client.stats().compiled_passes
            client.infer(x.numpy())
            assert client.stats().compiled_passes == before + 1
            _assert_close(_next_pass(stream, 2), seen, 1e-5)
            got = client.capture("model.layers.1", input=x.numpy())  # eager: the capture's hooks
            np.testing.assert_allclose(np.asarray(got, dtype=np.float64), seen["model.layers.1"], rtol=1e-6, atol=1e-6)
            assert client.stats().request_thread_compiles == 0
    finally:
        assert graph.wait_idle(COMPILE_WAIT)


def test_cuda_graph_modes_are_refused_until_verified(make_server) -> None:
    from layertap.server.host.compiled import check_mode

    why = check_mode("max-autotune", torch.device("cuda"))
    assert why is not None and "CUDA graphs" in why and "gpu_checks.sh" in why
    assert check_mode("reduce-overhead", torch.device("cpu")) is None  # inductor ignores it off CUDA
    assert check_mode("bogus", torch.device("cpu")) is not None
    started = time.monotonic()
    with pytest.raises(Exception, match="compile-mode"):
        make_server(compile_model=True, compile_mode="bogus")
    assert time.monotonic() - started < 60
