"""Review of issue 29: the shape probe's global module hook (``ModelHost._start_probe``, armed by
ListLayers on a compiled host too) is process-wide. Live while the compiler thread traced a variant,
it was baked into the variant's guards (dynamo guards on torch's global hook dicts): the variant
rejected every later pass, the tap set ran eager for good (its shape already "compiled", nothing
recompiled) while the tap said ``in_graph``. Seen through the real path (a client looping ``layers()``
+ ``infer()`` while a tap set compiled, 24-layer MLP): ``Guard failed on the same frame it was
created ... len(G['__import_torch_dot_nn_dot_modules_dot_module']._global_forward_hooks) != 1``.

The fix: ``CompiledServing.tracing`` is held by the compiler while it traces and by a probing pass
for its length (taken without waiting: a pass that finds the compiler tracing leaves the probe armed
for a later pass). The tests drive ListLayers and Infer while a real compile runs, and hold the lock
as the compiler does."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from torch import nn

import layertap
from layertap.server.host.sources import InputSpec, LoadedModel


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _loaded() -> LoadedModel:
    return LoadedModel(_Two().eval(), "two", "factory", [InputSpec("x", torch.float32, (-1, 8))])


def _global_hooks() -> int:
    return len(nn.modules.module._global_forward_hooks)


@pytest.mark.timeout(240)
def test_listlayers_during_a_compile_never_leaves_the_tap_set_eager(make_server) -> None:
    srv = make_server(_loaded(), compile_model=True)
    graph, host = srv.state.host.graph, srv.state.host
    assert graph.wait_idle(120)
    x = np.ones((4, 8), np.float32)
    seen_during: list[int] = []  # torch's global forward hooks at each call of the compiler's backend
    backend = graph.backend

    def counting_backend(gm, example_inputs):  # type: ignore[no-untyped-def]
        seen_during.append(_global_hooks())
        return backend(gm, example_inputs)

    graph.backend = counting_backend
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        client.create_tap("a", reducers=["moments"])
        client.infer(x)  # queues the tap set's compile
        deadline = time.monotonic() + 120
        overlapped = 0
        # ListLayers arms the probe; each Infer is a pass that would install it.
        while graph.state(("a",)) != "ready" and time.monotonic() < deadline:
            client.layers()
            if graph.state(("a",)) == "compiling":
                client.infer(x)
                overlapped += 1
        assert graph.wait_idle(120)
        assert overlapped > 0, "no pass ran while the compiler traced: the test proved nothing"
        client.infer(x)  # the probe armed during the compile runs now (a probing pass runs eager)
        assert not host._probe_armed and host.layer_shapes["a"].outputs, "the probe never ran after the compile"
        before = graph.compiled_passes
        client.infer(x)
        client.infer(x)
        served = graph.compiled_passes - before
        states = [t.serving for t in client.taps()]
    assert seen_during and not any(seen_during), f"global hooks live during the compile: {seen_during}"
    assert served == 2, f"{served} of 2 passes compiled after the compile; tap state {states}; {graph.counters()}"
    assert states == ["in_graph"]
    assert _global_hooks() == 0 and not graph.tracing.locked()


def test_a_pass_never_probes_while_the_compiler_traces_and_the_probe_waits(make_server) -> None:
    srv = make_server(_loaded(), compile_model=True)
    graph, host = srv.state.host.graph, srv.state.host
    assert graph.wait_idle(120)
    x = np.ones((2, 8), np.float32)
    host.layer_shapes.clear()
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        assert graph.tracing.acquire(timeout=30)  # as the compiler does for a trace
        try:
            client.layers()  # arms the probe
            client.infer(x)
            assert host._probe_armed, "a pass probed while the compiler held the tracing lock"
            assert not host.layer_shapes
        finally:
            graph.tracing.release()
        client.infer(x)
    assert not host._probe_armed and "a" in host.layer_shapes
    assert not graph.tracing.locked() and _global_hooks() == 0


def test_the_compiler_waits_out_a_probing_pass(make_server) -> None:
    """The other side: a probing pass holds the lock for its length, so a trace starts only after it."""
    srv = make_server(_loaded(), compile_model=True)
    graph, host = srv.state.host.graph, srv.state.host
    assert graph.wait_idle(120)
    host.arm_shape_probe()
    with host.pass_context():
        assert host._probe is not None and graph.tracing.locked()
        assert not graph.tracing.acquire(blocking=False)
    assert not graph.tracing.locked() and host._probe is None
