"""Passive captures of gradient points on a training agent, the step on their headers, and the rank on its
summaries and metadata."""

from __future__ import annotations

import threading
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from support.e2e import wait_for
from support.training import batches
from torch import nn

import layertap
from layertap import _capture
from layertap.server.host.demo_model import build_demo_model
from layertap.v1 import telemetry_pb2, telemetry_pb2_grpc

pytestmark = pytest.mark.e2e

DEMO = (3, 32, 32)


@pytest.fixture
def trained():
    """An agent on the demo model and its optimizer; closed after the test."""
    model = build_demo_model(0).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = layertap.attach(model, opt, metrics_port=None)
    yield model, opt, agent
    agent.close()


def _capture_in_background(client: layertap.Client, agent: Any, **kw: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Start a passive capture and return once its hooks are on the model."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = client.capture(timeout=60, **kw)
        except Exception as exc:  # noqa: BLE001 - re-raised by the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert wait_for(lambda: client.stats().active_captures == 1, 30)
    return thread, out


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 5) -> None:
    data = batches(seed, 4, DEMO)
    for _ in range(steps):
        x, y = next(data)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _tensors_in_background(client: layertap.Client, layers: list[str], n: int,
                           active: int = 1) -> tuple[threading.Thread, list[_capture.CapturedTensor]]:
    """``client.capture``'s own request, stream and assembler, keeping the per-tensor results that
    ``capture`` shapes into arrays; returns once ``active`` captures have their hooks on the model."""
    req = _capture.capture_request(layers, input=None, passes=n, point="output", max_batch=None, dtype=None)
    assembler = _capture.CaptureAssembler()
    got: list[_capture.CapturedTensor] = []

    def run() -> None:
        with client._translating(layer_hint=True):
            _capture.receive(client._capture_rpc(req, timeout=60), assembler)
        got.extend(assembler.finish())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert wait_for(lambda: client.stats().active_captures == active, 30)
    return thread, got


def _headers_in_background(client: layertap.Client, address: str,
                           request: telemetry_pb2.CaptureRequest,
                           ) -> tuple[threading.Thread, list[telemetry_pb2.CaptureHeader]]:
    """A passive capture through the generated stub, so protobuf parses every header; returns once hooked."""
    headers: list[telemetry_pb2.CaptureHeader] = []

    def run() -> None:
        with grpc.insecure_channel(address) as channel:
            for msg in telemetry_pb2_grpc.TelemetryServiceStub(channel).Capture(request, timeout=60):
                if msg.WhichOneof("payload") == "header":
                    headers.append(msg.header)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert wait_for(lambda: client.stats().active_captures == 1, 30)
    return thread, headers


def test_captures_carry_the_training_step_of_their_pass():
    model = build_demo_model(0).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with layertap.attach(model, opt, metrics_port=None, start_step=100) as agent, \
            layertap.Client(agent.address) as client:
        _train(model, opt, 3)  # steps 100..102 are passes 0..2: a step is no pass index
        thread, got = _tensors_in_background(client, ["fc", "layer1"], n=2)
        _train(model, opt, 2)
        thread.join(60)
        assert not thread.is_alive()
        # Two layers of the two steps after the request, each tensor stamped with its own step.
        assert sorted((t.pass_ordinal, t.layer, t.step) for t in got) == [
            (0, "fc", 103), (0, "layer1", 103), (1, "fc", 104), (1, "layer1", 104)]
        assert {t.pass_index for t in got} == {3, 4}

        # Gradient points are read in the same step; on the wire, protobuf reads has_step and step.
        req = telemetry_pb2.CaptureRequest(layers=["fc"], point=telemetry_pb2.POINT_PARAM_GRAD, passes=1)
        thread, headers = _headers_in_background(client, agent.address, req)
        _train(model, opt, 1)
        thread.join(60)
        assert [(h.output_key, h.has_step, h.step) for h in headers] == [("weight", True, 105), ("bias", True, 105)]


def test_step_zero_is_a_step_not_its_absence():
    """proto3 leaves a zero ``step`` off the wire; ``has_step`` keeps step 0 apart from no step."""
    model = build_demo_model(0).train()
    with layertap.attach(model, None, metrics_port=None) as agent, layertap.Client(agent.address) as client:
        wire, headers = _headers_in_background(client, agent.address, telemetry_pb2.CaptureRequest(layers=["fc"]))
        own, got = _tensors_in_background(client, ["fc"], n=1, active=2)
        x, y = next(batches(6, 4, DEMO))
        with agent.step(0):
            nn.functional.cross_entropy(model(x), y).backward()
        wire.join(60)
        own.join(60)
        assert [(h.layer, h.has_step, h.step) for h in headers] == [("fc", True, 0)]
        assert [(t.layer, t.step) for t in got] == [("fc", 0)]


def test_param_grad_capture_is_what_the_optimizer_steps_with(trained):
    model, opt, agent = trained
    with layertap.Client(agent.address) as client:
        thread, out = _capture_in_background(client, agent, layers=["fc", "bn1"], point="param_grad", max_batch=1)
        x, y = next(batches(1, 4, DEMO))
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)  # before the pre-step: captured clipped
        want = {n: p.grad.clone().numpy() for n, p in model.named_parameters()}
        opt.step()
        thread.join(60)
        assert "error" not in out, out.get("error")
        got = out["value"]
        # A dict per layer by parameter name; max_batch does not cut a weight's first dimension.
        assert sorted(got) == ["bn1", "fc"] and sorted(got["fc"]) == ["bias", "weight"]
        for layer in ("fc", "bn1"):
            for name in ("weight", "bias"):
                np.testing.assert_array_equal(got[layer][name], want[f"{layer}.{name}"])
    assert wait_for(lambda: agent.hooks == 0)


def test_grad_output_capture_gives_each_micro_batch(trained):
    model, opt, agent = trained
    with layertap.Client(agent.address) as client:
        thread, out = _capture_in_background(client, agent, layers="fc", point="grad_output")
        data = batches(2, 4, DEMO)
        refs = []
        opt.zero_grad()
        for _ in range(2):  # gradient accumulation: one step, two micro-batches
            x, y = next(data)
            logits = model(x)
            logits.retain_grad()
            nn.functional.cross_entropy(logits, y).backward()
            refs.append(logits.grad.clone().numpy())
        opt.step()
        thread.join(60)
        assert "error" not in out, out.get("error")
        got = out["value"]
        assert isinstance(got, list) and len(got) == 2  # one per call, in call order
        for g, ref in zip(got, refs):
            np.testing.assert_array_equal(g, ref)


def test_summaries_and_metadata_carry_the_rank(trained, monkeypatch):
    model, opt, agent = trained
    with layertap.Client(agent.address) as client:
        meta = client.metadata()
        assert (meta.rank, meta.world_size) == (0, 1)
        stream = client.watch("fc", point="param_grad", reducers="norm", queue_size=100, timeout=60)
        assert next(stream.batches()) == []
        x, y = next(batches(3, 4, DEMO))
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        got = {x.output_index: x for x in (next(stream), next(stream))}
        stream.close()
    s = got[0]  # fc.weight
    assert (s.rank, s.step, s.layer) == (0, 0, "fc") and got[1].rank == 0
    assert s.results["norm"].l2 == pytest.approx(float(model.fc.weight.grad.double().norm()), rel=1e-6)


def test_serving_host_refuses_gradient_points(client):
    with pytest.raises(layertap.FailedPrecondition, match="training agent") as info:
        client.capture("fc", point="param_grad", timeout=10)
    assert info.value.field == "point"
    meta = client.metadata()
    assert (meta.rank, meta.world_size) == (None, None)


def test_set_baseline_from_live_training_steps_and_fleet_drift(trained):
    model, opt, agent = trained
    stop = threading.Event()
    steps = [0]

    def loop() -> None:
        data = batches(4, 4, DEMO)
        while not stop.is_set():
            x, y = next(data)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            steps[0] += 1

    trainer = threading.Thread(target=loop, daemon=True)
    with layertap.Client(agent.address) as client, layertap.Fleet([agent.address]) as fleet:
        info = client.set_baseline("fc", passes=4, window=4)
        assert info.layers == ["fc"]
        trainer.start()
        try:
            assert wait_for(lambda: [d.value.state for d in fleet.drift()] == ["ready"]
                            and fleet.drift().items[0].value.window_passes >= 4, 60)
            (item,) = fleet.drift().items
            assert (item.rank, item.target, item.value.layer) == (0, agent.address, "fc")
            assert item.value.baseline_passes == 4 and np.isfinite(item.value.psi)
        finally:
            stop.set()
            trainer.join(60)
    assert steps[0] >= 8
