"""The shape probe on a compiled host (issue 29, found at its review).

The probe's global module hook (``ModelHost._start_probe``, armed by ListLayers on a compiled host too)
is process-wide. Live while the compiler thread traced a variant, it was baked into the variant's guards
(dynamo guards on torch's global hook dicts): the variant rejected every later pass, the tap set ran eager
for good (its shape already "compiled", nothing recompiled) while the tap said ``in_graph``. Seen through
the real path (a client looping ``layers()`` + ``infer()`` while a tap set compiled, 24-layer MLP):
``Guard failed on the same frame it was created ...
len(G['__import_torch_dot_nn_dot_modules_dot_module']._global_forward_hooks) != 1``.

The fix (``server/host/probe.py``): while a host of the process serves compiled variants, every host's
probe hooks its own modules for its one pass, never torch's process-wide dict; the variants trace hook-free
copies of the modules, which those hooks never reach. (A first fix, a lock between a host's probe and its
compiler, left another host of the same process free to probe during the trace: the review's second round
made the compile fail outright.) With no compiled host, probes keep the one global hook: it reaches a
TorchScript child, which refuses a hook of its own (review, third round: module-local hooks everywhere made
such a model fail its warm-up).

These servers compile in their own process (``compile_where="thread"``): a variant built by a child
process (the default on CPU) is traced there, from a pickled hook-free copy, where no probe of the
server's reaches it."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from support.e2e import wait_for
from support.models import two_loaded
from torch import nn

import layertap
from layertap.server.host.sources import InputSpec, LoadedModel

pytestmark = pytest.mark.slow


class _Heavy(nn.Module):
    """Many small layers: a probing pass keeps the global hook live for most of its length."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(40))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _global_hooks() -> int:
    return len(nn.modules.module._global_forward_hooks)


@pytest.mark.timeout(240)
def test_listlayers_during_a_compile_never_leaves_the_tap_set_eager(make_server) -> None:
    srv = make_server(two_loaded(), compile_model=True, compile_where="thread",
                      compile_fallback="eager")
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
    assert _global_hooks() == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("other_compiled", [False, True], ids=["other-eager", "other-compiled"])
def test_another_host_probing_meanwhile_never_spoils_a_compile(make_server, other_compiled) -> None:
    """Review, second round: another server of the process (eager: a probe every PROBE_SECONDS; or
    compiled) probing in a loop while this one compiles. With a process-wide probe hook this compile
    failed (a dynamo KeyError building guards) and the tap set never compiled."""
    other = make_server(LoadedModel(_Heavy().eval(), "heavy", "factory", [InputSpec("x", torch.float32, (-1, 256))]),
                        compile_model=other_compiled)
    srv = make_server(two_loaded(), compile_model=True, compile_where="thread",
                      compile_fallback="eager")
    graph = srv.state.host.graph
    assert graph.wait_idle(120)
    if other.state.host.graph is not None:
        assert other.state.host.graph.wait_idle(120)
    seen: list[int] = []
    backend = graph.backend

    def counting_backend(gm, example_inputs):  # type: ignore[no-untyped-def]
        seen.append(len(nn.modules.module._global_forward_hooks))
        return backend(gm, example_inputs)

    graph.backend = counting_backend
    stop = threading.Event()
    other_passes = [0]

    def probe_other() -> None:  # ListLayers + Infer on the other server: each of its passes probes
        xo = np.ones((64, 256), np.float32)
        with layertap.Client(f"127.0.0.1:{other.port}") as c:
            while not stop.is_set():
                c.layers()
                c.infer(xo)
                other_passes[0] += 1

    t = threading.Thread(target=probe_other, daemon=True)
    t.start()
    assert wait_for(lambda: other_passes[0] >= 1, 60), "the other server never probed"
    x = np.ones((4, 8), np.float32)
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        client.create_tap("a", reducers=["moments"])
        client.infer(x)  # queues the tap set's compile
        assert graph.wait_idle(200)
        stop.set()
        t.join(30)
        before = graph.compiled_passes
        client.infer(x)
        client.infer(x)
        served = graph.compiled_passes - before
        states = [tap.serving for tap in client.taps()]
    assert seen and not any(seen), f"another host's probe hook was live during this host's trace: {seen}"
    assert served == 2, f"{served} of 2 passes compiled after the compile; tap state {states}; {graph.counters()}"


def test_a_probing_pass_hooks_only_its_own_modules(make_server) -> None:
    srv = make_server(two_loaded(), compile_model=True, compile_where="thread",
                      compile_fallback="eager")
    host = srv.state.host
    assert host.graph.wait_idle(120)
    host.layer_shapes.clear()
    host.arm_shape_probe()
    with host.pass_context(), torch.inference_mode():
        assert host._probe is not None
        assert _global_hooks() == 0, "the probe installed a process-wide hook"
        assert all(m._forward_hooks for n, m in host.module.named_modules() if n)
        host.forward(host.validate_inputs([torch.ones(2, 8)]))
    assert host._probe is None and not any(m._forward_hooks for m in host.module.modules())
    assert host.layer_shapes["a"].outputs == [(2, 8)] and host.layer_shapes["b"].calls == 1


class _Scripted(nn.Module):
    """A TorchScript child inside an eager model: it refuses register_forward_hook."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.inner = torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.a(x))


def _scripted() -> LoadedModel:
    return LoadedModel(_Scripted().eval(), "scripted", "factory", [InputSpec("x", torch.float32, (-1, 8))])


def test_a_compiled_host_with_a_torchscript_child_probes_the_rest(make_server) -> None:
    srv = make_server(_scripted(), compile_model=True, compile_where="thread",
                      compile_fallback="eager")
    host = srv.state.host
    assert host.graph.wait_idle(120)
    x = np.ones((3, 8), np.float32)
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        client.layers()
        out = client.infer(x)
    assert np.asarray(out).shape == (3, 8)
    assert not host._probe_armed and host.layer_shapes["a"].outputs == [(3, 8)]
    assert _global_hooks() == 0 and not any(m._forward_hooks for m in host.module.modules()
                                            if not isinstance(m, torch.jit.ScriptModule))


def test_an_eager_process_probes_with_one_global_hook(make_server) -> None:
    """No compiled host alive: the old single hook, which also records the TorchScript child's shapes."""
    srv = make_server(_scripted())
    host = srv.state.host
    host.layer_shapes.clear()
    host.arm_shape_probe()
    with host.pass_context(), torch.inference_mode():
        assert _global_hooks() == 1 and not host.module.a._forward_hooks
        host.forward(host.validate_inputs([torch.ones(2, 8)]))
    assert _global_hooks() == 0
    assert host.layer_shapes["inner"].outputs == [(2, 8)] and host.layer_shapes["a"].outputs == [(2, 8)]
