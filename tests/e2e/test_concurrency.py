"""Slow and failing passes: no deadlock, no stalled server, no miscounted pass."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from support.e2e import wait_for

import layertap
from layertap.server.host.sources import InputSpec, LoadedModel

pytestmark = pytest.mark.e2e


class Moody(torch.nn.Module):
    """Batch 3 takes ``slow_seconds`` (1.5 s) or until ``release``; batch 5 raises; anything else is quick.

    ``slow_started`` is set once a slow pass is inside the forward, i.e. holds
    the model lock, so tests act mid-pass for certain rather than after a guess.
    """

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.slow_started = threading.Event()
        self.release = threading.Event()
        self.slow_seconds = 1.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 3:
            self.slow_started.set()
            self.release.wait(self.slow_seconds)
        if x.shape[0] == 5:
            raise ValueError("batch of 5 refused")
        return self.lin(x)


@pytest.fixture
def moody(make_server):
    torch.manual_seed(0)
    model = Moody()
    srv = make_server(LoadedModel(model, "moody", "factory", [InputSpec("input", torch.float32, (-1, 4))]))
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        yield srv, client, model


def x(n: int) -> np.ndarray:
    return np.random.default_rng(n).standard_normal((n, 4)).astype(np.float32)


def test_create_tap_during_a_slow_pass_does_not_deadlock(moody):
    srv, client, model = moody
    tap = client.create_tap("lin", reducers=["moments"], ttl=60)
    client.delete_tap(tap.id)  # leaves an event to announce
    slow = threading.Thread(target=client.infer, args=(x(3),))
    slow.start()
    assert model.slow_started.wait(10)  # the slow pass holds the model lock now
    start = time.monotonic()
    created = client.create_tap("lin", reducers=["moments"], ttl=60, timeout=20)  # a deadlock: 20 s, then an error
    slow.join(10)
    assert not slow.is_alive()
    assert created.id in {t.id for t in client.taps(timeout=5)}
    assert time.monotonic() - start < 10  # half the deadline: no wait beyond the pass, room for a busy machine
    assert client.stats(timeout=5).active_hooks == 1


def test_cancelling_a_capture_mid_pass_does_not_stall_other_rpcs(moody):
    srv, client, model = moody
    import grpc

    from layertap.v1 import telemetry_pb2, telemetry_pb2_grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    stub = telemetry_pb2_grpc.TelemetryServiceStub(channel)
    call = stub.Capture(telemetry_pb2.CaptureRequest(layers=["lin"], passes=2), timeout=60)
    assert wait_for(lambda: client.stats().active_hooks == 1)
    model.slow_seconds = 30.0  # a pass that holds the model until released: stats must not wait for it
    slow = threading.Thread(target=client.infer, args=(x(3),), kwargs={"timeout": 60})
    slow.start()
    assert model.slow_started.wait(10)  # mid-pass, with the capture's hook installed
    call.cancel()
    t0 = time.monotonic()
    client.stats(timeout=20)
    assert time.monotonic() - t0 < model.slow_seconds / 2  # not held up until the pass ends
    model.release.set()
    slow.join(10)
    assert wait_for(lambda: client.stats().active_hooks == 0)
    channel.close()


def test_passive_capture_skips_a_pass_whose_forward_failed(moody):
    srv, client, model = moody
    out: list = []
    t = threading.Thread(target=lambda: out.append(client.capture("lin", timeout=30)))
    t.start()
    assert wait_for(lambda: client.stats().active_hooks == 1)
    with pytest.raises(layertap.LayertapError):
        client.infer(x(5))
    good = x(2)
    client.infer(good)
    t.join(30)
    assert not t.is_alive()
    with torch.inference_mode():
        want = model.lin(torch.from_numpy(good)).numpy()
    np.testing.assert_array_equal(out[0], want)


def test_every_server_pass_runs_on_one_model_thread(make_server):
    """Infer from many RPC threads, an active capture and Explain all run on
    one thread: a forward on each gRPC worker would leave an OpenMP team per
    worker and slow every later forward (server/host/model_thread.py)."""
    srv = make_server()
    ran_on: set[str] = set()
    srv.state.host.module.register_forward_hook(lambda *_: ran_on.add(threading.current_thread().name))
    img = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        callers = [threading.Thread(target=client.infer, args=(img,)) for _ in range(8)]
        for t in callers:
            t.start()
        for t in callers:
            t.join(30)
        got = client.capture("layer4", input=img)
        found = client.explain(img, "layer3")
    assert got.shape[0] == 2 and found is not None
    assert srv.state.host.passes >= 10
    assert len(ran_on) == 1 and next(iter(ran_on)).startswith("layertap-model"), ran_on
