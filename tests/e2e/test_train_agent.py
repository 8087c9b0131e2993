"""A training agent end to end: the real client against ``layertap.attach`` in this process."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
import textwrap
import threading
import urllib.request

import numpy as np
import pytest
import torch
from support.e2e import wait_for
from support.training import batches, free_port_pair, inplace_net, train_steps
from torch import nn

import layertap
from layertap.server.host.demo_model import build_demo_model

pytestmark = pytest.mark.slow

DEMO = (3, 32, 32)


@pytest.fixture
def agents():
    made = []

    def make(model: nn.Module, opt: torch.optim.Optimizer | None = None, **kw: object):
        agent = layertap.attach(model, opt, **kw)
        made.append(agent)
        return agent

    yield make
    for a in made:
        a.close()


def demo() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = build_demo_model(0).train()
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def ready(stream: layertap.SummaryStream) -> None:
    """The first message says the stream's taps exist."""
    assert next(stream.batches()) == []


def test_client_watches_gradient_norms_and_steps(agents):
    model, opt = demo()
    agent = agents(model, opt, metrics_port=None)
    clipped: list[float] = []
    with layertap.Client(agent.address) as client:
        meta = client.metadata()
        assert meta.model_name == "DemoResNet" and meta.source == "training (rank 0 of 1)"
        norms = client.watch("*", point="param_grad", reducers="norm", queue_size=10_000, timeout=60)
        grads = client.watch("layer4", point="grad_output", reducers=["norm"], queue_size=10_000, timeout=60)
        ready(norms)
        ready(grads)
        want = train_steps(model, opt, batches(0, 8, DEMO), 3, on_grads=lambda _i: clipped.append(
            float(nn.utils.clip_grad_norm_(model.parameters(), max_norm=math.inf))))
        n_params = len(list(model.parameters()))
        got = list(itertools.islice(norms, 3 * n_params))
        go = list(itertools.islice(grads, 3))
        norms.close()
        grads.close()
    totals: dict[int, float] = {}
    for s in got:
        assert s.point == "param_grad"
        totals[s.step] = totals.get(s.step, 0.0) + s.results["norm"].l2 ** 2
    assert sorted(totals) == [0, 1, 2]
    np.testing.assert_allclose([math.sqrt(totals[k]) for k in (0, 1, 2)], want, rtol=1e-9)
    np.testing.assert_allclose([math.sqrt(totals[k]) for k in (0, 1, 2)], clipped, rtol=1e-5)
    assert [s.step for s in go] == [0, 1, 2] and all(s.results["norm"].l2 > 0 for s in go)
    assert wait_for(lambda: agent.hooks == 0)


def test_infer_and_active_capture_are_refused(agents):
    model, opt = demo()
    agent = agents(model, opt, metrics_port=None)
    x = np.zeros((1, *DEMO), np.float32)
    with layertap.Client(agent.address) as client:
        with pytest.raises(layertap.FailedPrecondition, match="training agent"):
            client.infer(x)
        with pytest.raises(layertap.FailedPrecondition, match="training agent"):
            client.capture("fc", input=x)
        assert client.stats().passes == 0
    assert agent.hooks == 0


def test_inplace_model_trains_with_gradient_taps_over_grpc(agents):
    model = inplace_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    agent = agents(model, opt, metrics_port=None)
    with layertap.Client(agent.address) as client:
        # conv1's input is the data, which needs no gradient: it has no grad_input.
        expect = {"grad_output": ("conv1", "bn1", "conv2"), "grad_input": ("bn1", "conv2"),
                  "output": ("conv1", "bn1", "conv2")}
        streams = {p: client.watch("re:conv1|bn1|conv2", point=p, reducers="norm,nonfinite", queue_size=1000,
                                   timeout=60) for p in expect}
        for s in streams.values():
            ready(s)
        train_steps(model, opt, batches(3), 2)
        for point, s in streams.items():
            got = list(itertools.islice(s, 2 * len(expect[point])))
            assert sorted((x.step, x.layer) for x in got) == sorted(
                (st, layer) for st in (0, 1) for layer in expect[point]), point
            assert all(x.results["nonfinite"].nan_count == 0 and x.results["norm"].l2 > 0 for x in got)
            s.close()
        assert all(t.errors == 0 for t in client.taps())
    assert agent.host.hooks.errors == 0


def test_rank_ports_and_rank_label(agents, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    base, mbase = free_port_pair(), free_port_pair()
    model, opt = demo()
    agent = agents(model, opt, port=base, metrics_port=mbase)
    assert (agent.port, agent.metrics_port) == (base + 1, mbase + 1)
    with layertap.Client(agent.address) as client:
        assert client.metadata().source == "training (rank 1 of 2)"
        client.create_tap("fc", point="param_grad", reducers="norm", name="fcgrad")
        train_steps(model, opt, batches(0, 4, DEMO), 2)
    with urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    from prometheus_client.parser import text_string_to_metric_families

    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    assert samples and all(s.labels.get("rank") == "1" for s in samples)
    fc = [s for s in samples if s.labels.get("layer") == "fc" and s.labels.get("point") == "param_grad"]
    assert fc, "no per-layer series for the durable gradient tap"


def test_prometheus_total_gradient_norm_is_clip_grad_norm(agents):
    """docs/training.md's recipe: sqrt(sum(layertap_activation_l2{point="param_grad"}^2)) over a
    "*" tap is the step's total gradient norm; each module's series covers all its parameters."""
    from prometheus_client.parser import text_string_to_metric_families

    model, opt = demo()
    assert not list(model.named_parameters(recurse=False))  # "*" partitions the parameters
    agent = agents(model, opt, metrics_port=0)
    clipped: list[float] = []
    with layertap.Client(agent.address) as client:
        client.create_tap("*", point="param_grad", reducers="norm", name="grads")
        train_steps(model, opt, batches(0, 4, DEMO), 3,
                    on_grads=lambda _i: clipped.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                                                            math.inf))))

    def total() -> float | None:
        with urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        l2 = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples
              if s.name == "layertap_activation_l2" and s.labels["tap"] == "grads"]
        return math.sqrt(sum(v * v for v in l2)) if l2 else None

    assert wait_for(lambda: total() is not None and total() == pytest.approx(clipped[-1], rel=1e-5), 20), \
        (total(), clipped)


def test_exposure_and_options_are_checked():
    model, opt = demo()
    with pytest.raises(ValueError, match="auth_tokens="):
        layertap.attach(model, opt, host="0.0.0.0")
    with pytest.raises(TypeError, match="weights"):
        layertap.attach(model, opt, weights="w.pt")


def test_slow_subscriber_never_holds_the_loop(agents):
    model = inplace_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # The overhead budget off: this is about the broker's drops, which need every step's summaries.
    agent = agents(model, opt, metrics_port=None, tap_budget=0.0)
    with layertap.Client(agent.address) as client:
        # Big summaries fill gRPC's flow-control window, then the one-message queue.
        stream = client.watch("**", reducers="histogram,quantiles", point="grad_output", queue_size=1)
        ready(stream)  # then never read again
        data = batches(0)
        steps = 0
        while agent.server.state.broker.dropped_total == 0 and steps < 3000:
            train_steps(model, opt, data, 10)
            steps += 10
        assert agent.host.passes == steps
        assert agent.server.state.broker.dropped_total > 0, f"nothing dropped in {steps} steps"
        stream.close()


def test_passive_capture_records_a_training_step(agents):
    model, opt = demo()
    agent = agents(model, opt, metrics_port=None)
    stop = threading.Event()

    def loop() -> None:
        data = batches(0, 2, DEMO)
        while not stop.is_set():
            train_steps(model, opt, data, 1)

    trainer = threading.Thread(target=loop, daemon=True)
    trainer.start()
    try:
        with layertap.Client(agent.address) as client:
            out = client.capture("fc", timeout=60)
        assert out.shape == (2, 10) and np.isfinite(out).all()
    finally:
        stop.set()
        trainer.join(60)
    assert agent.hooks == 0


CLIENT = textwrap.dedent("""
    import sys, layertap
    with layertap.Client(sys.argv[1]) as c:
        s = c.watch("**", point="grad_output", reducers="norm", queue_size=4)
        next(s.batches())
        print("ready", flush=True)
        for _ in s:
            pass
""")


def test_killed_subscriber_leaves_no_hooks(agents):
    model, opt = demo()
    agent = agents(model, opt, metrics_port=None)
    stop = threading.Event()
    steps = [0]

    def loop() -> None:
        data = batches(0, 2, DEMO)
        while not stop.is_set():
            train_steps(model, opt, data, 1)
            steps[0] += 1

    proc = subprocess.Popen([sys.executable, "-c", CLIENT, agent.address], stdout=subprocess.PIPE, text=True)
    trainer = threading.Thread(target=loop, daemon=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert agent.hooks > 0
        trainer.start()
        assert wait_for(lambda: steps[0] >= 2, 60)
        proc.kill()
        proc.wait(10)
        assert wait_for(lambda: agent.hooks == 0, 15), f"{agent.hooks} hooks left"
        before = steps[0]
        assert wait_for(lambda: steps[0] > before, 30)  # training went on
    finally:
        stop.set()
        proc.kill()
        trainer.join(60) if trainer.is_alive() else None


def test_example_trains_with_an_agent():
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "examples" / "train.py"
    out = subprocess.run([sys.executable, str(script), "--steps", "3", "--batch", "4"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "layertap agent on 127.0.0.1:" in out.stdout and "done: 3 steps" in out.stdout


def test_compile_reducers_compiles_before_training_and_never_during_it(agents):
    """A compile saves and restores the global RNG, so one overlapping a step would
    change its dropout draws: an agent compiles in attach() and never afterwards."""
    from layertap.server.app import process_compilation

    model, opt = demo()
    agent = agents(model, opt, metrics_port=None, compile_reducers=True)
    assert not process_compilation().stats.background
    states, before = process_compilation().stats.states(), process_compilation().stats.counters()
    assert "ready" in states.values()
    with layertap.Client(agent.address) as client:
        norms = client.watch("*", point="param_grad", reducers="norm", queue_size=10_000, timeout=60)
        ready(norms)  # its tap exists: a serving server would have queued an ahead-compile now
        want = train_steps(model, opt, batches(0, 8, DEMO), 3)
        got: dict[int, float] = {}
        for s in itertools.islice(norms, 3 * len(list(model.parameters()))):
            got[s.step] = got.get(s.step, 0.0) + s.results["norm"].l2 ** 2
        norms.close()
    after = process_compilation().stats.counters()
    assert process_compilation().stats.states() == states and after["compiles"] == before["compiles"]  # nothing compiled since
    assert after["compiled_calls"] > before["compiled_calls"]  # the gradients ran the compiled kernel
    np.testing.assert_allclose([math.sqrt(got[i]) for i in sorted(got)], want, rtol=1e-6)
    agent.close()
    assert process_compilation().stats.background
