"""Capture limits that keep a server safe to expose: wait, budget, failed clones, exactly-once release.

Real in-process servers on port 0 and the real client; the raw stub only
where the test must read headers (``pass_index``) or cancel mid-stream.
"""

from __future__ import annotations

import random
import threading
import time

import grpc
import numpy as np
import pytest
import torch
from support.e2e import batch, scrape, wait_for
from support.models import identity

import layertap
from layertap.server.errors import LimitExceeded
from layertap.server.host.demo_model import build_demo_model
from layertap.server.host.sources import InputSpec, LoadedModel
from layertap.server.rpc.taps import CaptureCall
from layertap.server.taps import capture as capture_mod
from layertap.server.taps.capture import CaptureOptions, CaptureSession
from layertap.server.taps.capture_limits import CaptureBudget, CaptureSlots
from layertap.v1 import telemetry_pb2, telemetry_pb2_grpc

pytestmark = pytest.mark.e2e

MIB = 1 << 20


def demo_output(x: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return build_demo_model(0)(torch.from_numpy(x)).numpy()


def addr(srv) -> str:  # type: ignore[no-untyped-def]
    return f"127.0.0.1:{srv.port}"


def assert_idle(srv) -> None:  # type: ignore[no-untyped-def]
    """No capture left anything behind: slots, budget, hooks."""
    state = srv.state
    assert wait_for(lambda: state.captures.active == 0 and state.host.hooks.active == 0, 10), (
        state.captures.active, state.host.hooks.active)
    assert state.capture_budget.held == 0


def passive_in_thread(client: layertap.Client, layers, **kw):  # type: ignore[no-untyped-def]
    """Start a passive capture in a thread; returns (thread, result dict with 'value' or 'error')."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = client.capture(layers, **kw)
        except BaseException as exc:  # noqa: BLE001 - asserted by the test
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    return t, out


# ------------------------------------------------------------------ 1. the server stops waiting for traffic


def test_passive_capture_without_traffic_ends_with_deadline_exceeded(make_server):
    srv = make_server(max_capture_wait=0.5)
    with layertap.Client(addr(srv)) as client:
        start = time.monotonic()
        with pytest.raises(layertap.DeadlineExceeded) as info:
            client.capture("fc", timeout=30)
        waited = time.monotonic() - start
        assert 0.5 <= waited < 15, waited  # its 0.5 s, not the client's 30 s (half of it: room for a busy machine)
        err = info.value
        assert (err.code, err.reason) == ("DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED")
        assert err.metadata["max_wait_seconds"] == "0.5"
        assert "0.5 s" in err.details and "send Infer traffic" in err.details and "inputs" in err.details
        assert_idle(srv)
        # Active captures run their own pass: the wait does not apply.
        assert client.capture("fc", input=batch()).shape == (4, 10)
    assert_idle(srv)


def test_the_wait_also_applies_between_passes(make_server):
    srv = make_server(max_capture_wait=0.5)
    with layertap.Client(addr(srv)) as client, layertap.Client(addr(srv)) as other:
        t, out = passive_in_thread(client, "fc", n=2, timeout=30)
        assert wait_for(lambda: srv.state.host.hooks.active == 1)
        other.infer(batch())  # the first pass arrives, the second never does
        t.join(30)
        assert isinstance(out.get("error"), layertap.DeadlineExceeded), out
    assert_idle(srv)


# ------------------------------------------------------------------ 2. one byte budget for every capture's clones


def test_slow_reader_holds_the_budget_so_a_passive_capture_skips_and_counts(make_server):
    """A client that does not read keeps its 16 MiB pass (gRPC flow control
    blocks the stream), so another passive capture skips the next live pass:
    its header's pass_index shows the gap and the skip is counted."""
    loaded = LoadedModel(identity(), "identity", "factory", [InputSpec("input", torch.float32, (-1, 1024, 1024))])
    srv = make_server(loaded, capture_budget_bytes=24 * MIB, metrics_port=0)
    state, host = srv.state, srv.state.host
    xs = [np.full((4, 1024, 1024), v, np.float32) for v in (1.0, 2.0, 3.0)]  # 16 MiB each
    channel = grpc.insecure_channel(addr(srv), options=[("grpc.max_receive_message_length", 8 * MIB)])
    stub = telemetry_pb2_grpc.TelemetryServiceStub(channel)
    slow = stub.Capture(telemetry_pb2.CaptureRequest(layers=["body"]), timeout=60)
    assert wait_for(lambda: host.hooks.active == 1)
    with layertap.Client(addr(srv)) as client:
        client.infer(xs[0])
        assert wait_for(lambda: state.capture_budget.held == 16 * MIB)
        time.sleep(0.3)
        assert state.capture_budget.held == 16 * MIB, "the slow reader's pass must still be held"
        assert host.hooks.active == 0  # its last pass is in hand: its hooks are gone, its clone is not

        got: list = []
        reader = threading.Thread(target=lambda: got.extend(
            stub.Capture(telemetry_pb2.CaptureRequest(layers=["body"]), timeout=60)))
        reader.start()
        assert wait_for(lambda: host.hooks.active == 1)
        skipped_index = host.passes
        client.infer(xs[1])  # 16 + 16 MiB > 24 MiB: skipped
        assert wait_for(lambda: state.capture_budget.skipped == 1)
        assert reader.is_alive() and state.capture_budget.held == 16 * MIB

        slow_msgs = list(slow)  # the slow client reads: its pass is sent and released
        assert b"".join(m.chunk.data for m in slow_msgs) == xs[0].tobytes()
        assert wait_for(lambda: state.capture_budget.held == 0)
        taken_index = host.passes
        client.infer(xs[2])
        reader.join(30)
    channel.close()
    headers = [m.header for m in got if m.HasField("header")]
    assert [h.pass_index for h in headers] == [taken_index] and taken_index == skipped_index + 1
    assert headers[0].pass_ordinal == 0
    assert b"".join(m.chunk.data for m in got) == xs[2].tobytes()
    assert_idle(srv)
    metrics = scrape(srv.metrics_port)
    assert metrics["layertap_capture_skipped_passes_total"] == 1.0
    assert metrics["layertap_capture_budget_held_bytes"] == 0.0


def test_one_slow_capture_holds_at_most_two_passes(make_server):
    """A client that asks for many passes and reads slowly cannot pin the whole
    budget with passes queued ahead of it: past one sent and one queued, its
    live passes are skipped (counted; the headers' pass_index shows the gaps)."""
    loaded = LoadedModel(identity(), "identity", "factory", [InputSpec("input", torch.float32, (-1, 1024, 1024))])
    srv = make_server(loaded, capture_budget_bytes=1 << 30)
    state = srv.state
    xs = [np.full((4, 1024, 1024), v, np.float32) for v in range(1, 7)]  # 16 MiB each
    channel = grpc.insecure_channel(addr(srv), options=[("grpc.max_receive_message_length", 8 * MIB)])
    stub = telemetry_pb2_grpc.TelemetryServiceStub(channel)
    slow = stub.Capture(telemetry_pb2.CaptureRequest(layers=["body"], passes=3), timeout=60)
    assert wait_for(lambda: state.host.hooks.active == 1)
    with layertap.Client(addr(srv)) as client:
        for x in xs[:5]:
            client.infer(x)
        assert wait_for(lambda: state.capture_budget.skipped == 3)
        assert state.capture_budget.held == 2 * 16 * MIB  # not 5 passes' worth
        messages = []
        reader = threading.Thread(target=lambda: messages.extend(slow))
        reader.start()
        assert wait_for(lambda: state.capture_budget.held == 0)
        client.infer(xs[5])  # the third pass
        reader.join(30)
    channel.close()
    headers = [m.header for m in messages if m.HasField("header")]
    assert [h.pass_ordinal for h in headers] == [0, 1, 2]
    assert headers[1].pass_index == headers[0].pass_index + 1 and headers[2].pass_index == headers[0].pass_index + 5
    assert b"".join(m.chunk.data for m in messages) == b"".join(x.tobytes() for x in (xs[0], xs[1], xs[5]))
    assert_idle(srv)


def test_active_capture_over_the_budget_is_resource_exhausted(make_server):
    srv = make_server(capture_budget_bytes=50_000)
    x = batch()  # layer1: 4x16x16x16 float32 = 65536 bytes, over the whole budget
    with layertap.Client(addr(srv)) as client:
        with pytest.raises(layertap.ResourceExhausted) as info:
            client.capture("layer1", input=x)
        err = info.value
        assert err.reason == "CAPTURE_BUDGET_EXHAUSTED" and err.metadata["budget_bytes"] == "50000"
        assert "more than the whole" in err.details and "--capture-budget-bytes" in err.details
        assert_idle(srv)

        # Held by captures in flight (simulated: a reservation of the shared budget).
        other = srv.state.capture_budget.reservation()
        assert other.grow(45_000)
        with pytest.raises(layertap.ResourceExhausted, match="captures in flight hold 45000 bytes"):
            client.capture("layer4", input=x)  # 8192 bytes, 5000 left
        np.testing.assert_array_equal(client.capture("fc", input=x), demo_output(x))  # 160 bytes fit
        assert other.release() == 45_000
        assert client.capture("layer4", input=x).shape == (4, 128, 2, 2)
    assert_idle(srv)


def test_a_pass_that_can_never_fit_fails_a_passive_capture_at_once(make_server):
    srv = make_server(capture_budget_bytes=50_000, max_capture_wait=30)
    with layertap.Client(addr(srv)) as client, layertap.Client(addr(srv)) as other:
        t, out = passive_in_thread(client, "layer1", timeout=60)
        assert wait_for(lambda: srv.state.host.hooks.active == 1)
        start = time.monotonic()
        other.infer(batch())
        t.join(20)
        assert time.monotonic() - start < 15  # not after the 30 s wait (half of it: room for a busy machine)
        assert isinstance(out.get("error"), layertap.ResourceExhausted), out
        assert out["error"].reason == "CAPTURE_BUDGET_EXHAUSTED"
        assert srv.state.capture_budget.skipped == 0
    assert_idle(srv)


def test_passive_capture_that_only_skips_ends_naming_the_budget(make_server):
    srv = make_server(capture_budget_bytes=50_000, max_capture_wait=1.0)
    holder = srv.state.capture_budget.reservation()
    assert holder.grow(48_000)
    stop = threading.Event()
    with layertap.Client(addr(srv)) as client, layertap.Client(addr(srv)) as other:
        def traffic() -> None:
            while not stop.is_set():
                other.infer(batch())
                time.sleep(0.05)

        pump = threading.Thread(target=traffic)
        pump.start()
        try:
            with pytest.raises(layertap.ResourceExhausted) as info:
                client.capture("layer4", timeout=30)  # 8192 bytes: never fits in the 2000 left
        finally:
            stop.set()
            pump.join(10)
    err = info.value
    assert err.reason == "CAPTURE_BUDGET_EXHAUSTED" and int(err.metadata["skipped_passes"]) >= 1
    assert "skipped" in err.details and "--max-capture-wait" in err.details
    assert srv.state.capture_budget.skipped >= int(err.metadata["skipped_passes"])
    holder.release()
    assert_idle(srv)


def test_budget_returns_when_a_pass_is_too_large_or_encoding_fails(make_server, monkeypatch):
    from layertap.server.rpc import taps as telemetry

    srv = make_server(max_capture_bytes=10_000)
    x = batch()
    with layertap.Client(addr(srv)) as client:
        with pytest.raises(layertap.CaptureTooLarge):
            client.capture(["fc", "layer1"], input=x)  # fc's clone was made, then layer1 is over the cap
        assert_idle(srv)

        real = telemetry.encode_pass

        def broken(rec, opts, ids):  # type: ignore[no-untyped-def]
            it = real(rec, opts, ids)
            yield next(it)
            raise RuntimeError("encoder broke")

        monkeypatch.setattr(telemetry, "encode_pass", broken)
        with pytest.raises(layertap.LayertapError) as info:
            client.capture("layer4", input=x)
        assert info.value.code == "INTERNAL"
        assert_idle(srv)
        monkeypatch.undo()
        assert client.capture("layer4", input=x).shape == (4, 128, 2, 2)
    assert_idle(srv)


# ------------------------------------------------------------------ 3. a failed clone fails only its capture


def failing_clone(exc: Exception, at_call: int):  # type: ignore[no-untyped-def]
    """clone_for_capture that raises ``exc`` on its ``at_call``-th call (0-based) and works otherwise."""
    real = capture_mod.clone_for_capture
    calls = [0]

    def clone(src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        calls[0] += 1
        if calls[0] - 1 == at_call:
            raise exc
        return real(src, dtype)

    return clone


def test_out_of_memory_while_cloning_fails_only_that_capture(demo_server, monkeypatch):
    """Another client's concurrent Infer succeeds with the right output.

    A CPU cannot run out of device memory on demand, so the failure is
    injected: the clone step (``capture.clone_for_capture``) of this
    in-process server raises ``torch.OutOfMemoryError`` on its second call,
    after the first layer's clone was made (which must be freed too).
    """
    srv = demo_server
    monkeypatch.setattr(capture_mod, "clone_for_capture",
                        failing_clone(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), 1))
    x = batch(seed=31)
    with layertap.Client(addr(srv)) as client, layertap.Client(addr(srv)) as other:
        t, out = passive_in_thread(client, ["layer3", "fc"], timeout=30)
        assert wait_for(lambda: srv.state.host.hooks.active == 2)
        np.testing.assert_array_equal(other.infer(x), demo_output(x))  # the pass the capture failed in
        t.join(30)
        err = out.get("error")
        assert isinstance(err, layertap.ResourceExhausted), out
        assert (err.code, err.reason, err.metadata["layer"]) == ("RESOURCE_EXHAUSTED", "CAPTURE_OUT_OF_MEMORY", "fc")
        assert "ran out of memory" in err.details and "went on" in err.details
        assert_idle(srv)
        y = batch(seed=32)
        np.testing.assert_array_equal(other.infer(y), demo_output(y))  # the one just after

        # An active capture fails the same way, and the next Infer is unaffected.
        monkeypatch.setattr(capture_mod, "clone_for_capture",
                            failing_clone(torch.OutOfMemoryError("CUDA out of memory"), 0))
        with pytest.raises(layertap.ResourceExhausted) as active:
            client.capture("layer3", input=x)
        assert active.value.reason == "CAPTURE_OUT_OF_MEMORY"
        np.testing.assert_array_equal(other.infer(y), demo_output(y))
        assert_idle(srv)

        monkeypatch.undo()
        np.testing.assert_array_equal(client.capture("fc", input=x), demo_output(x))
    assert_idle(srv)


def test_any_other_clone_error_fails_only_that_capture_with_a_clear_message(demo_server, monkeypatch):
    """Injected like the out-of-memory case: a RuntimeError from the clone step."""
    srv = demo_server
    monkeypatch.setattr(capture_mod, "clone_for_capture", failing_clone(RuntimeError("boom"), 0))
    x = batch(seed=33)
    with layertap.Client(addr(srv)) as client, layertap.Client(addr(srv)) as other:
        t, out = passive_in_thread(client, "layer2", timeout=30)
        assert wait_for(lambda: srv.state.host.hooks.active == 1)
        np.testing.assert_array_equal(other.infer(x), demo_output(x))
        t.join(30)
    err = out.get("error")
    assert isinstance(err, layertap.LayertapError) and err.code == "INTERNAL", out
    assert err.reason == "CAPTURE_COPY_FAILED" and err.metadata["layer"] == "layer2"
    assert "copying layer 'layer2'" in err.details and "RuntimeError" in err.details and "boom" not in err.details
    assert_idle(srv)


# ------------------------------------------------------------------ 4. slots, budget and hooks are returned exactly once


def race(n: int, fn) -> list:  # type: ignore[no-untyped-def]
    """Run ``fn`` from ``n`` threads released together; their results."""
    barrier = threading.Barrier(n)
    results: list = [None] * n

    def run(i: int) -> None:
        barrier.wait()
        results[i] = fn()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return results


def test_a_slot_is_released_exactly_once_whatever_the_race():
    slots = CaptureSlots(2)
    for _ in range(200):
        slot = slots.acquire()
        assert sorted(race(4, slot.release)) == [False, False, False, True]
        assert slots.active == 0
    held = [slots.acquire(), slots.acquire()]
    with pytest.raises(LimitExceeded):
        slots.acquire()  # double releases above let no extra capture in
    for s in held:
        assert s.release() and not s.release()
    assert slots.active == 0


def test_a_budget_reservation_is_returned_exactly_once():
    budget = CaptureBudget(1000)
    for _ in range(200):
        res = budget.reservation()
        assert res.grow(600) and not budget.reservation().grow(401)
        assert sorted(race(4, res.release)) == [0, 0, 0, 600]
        assert budget.held == 0
        assert not res.grow(1)  # a returned reservation cannot hold bytes again
    assert budget.held == 0


def test_capture_call_finish_from_two_threads_does_its_work_once(demo_server, monkeypatch):
    state = demo_server.state
    counted: list[str] = []
    monkeypatch.setattr(state, "count_capture", lambda code, _n: counted.append(code))
    opts = CaptureOptions(("fc", "layer4"), telemetry_pb2.POINT_OUTPUT, 1, 0, None)
    for _ in range(100):
        session = CaptureSession(state.host, opts, max_bytes=1 << 20, active=False, budget=state.capture_budget)
        session.open()
        res = session.budget.reservation()  # stands for a pass this capture holds
        assert res.grow(100)
        call = CaptureCall(state, session, state.captures.acquire())
        race(2, call.finish)
        res.release()
        assert state.captures.active == 0 and state.host.hooks.active == 0
    assert len(counted) == 100
    assert state.capture_budget.held == 0


def test_many_captures_cancelled_at_random_points_leave_nothing_behind(demo_server):
    """Passive and active captures, cancelled by their clients after a random
    number of messages (or none) while live traffic flows, from more
    threads than there are capture slots."""
    srv = demo_server
    state = srv.state
    stop = threading.Event()
    errors: list[BaseException] = []
    big = batch(64, seed=41)  # layer1 + layer2: 1.5 MiB a pass, several chunks

    def traffic() -> None:
        with layertap.Client(addr(srv)) as c:
            while not stop.is_set():
                c.infer(big)

    def capturer(seed: int) -> None:
        rng = random.Random(seed)
        channel = grpc.insecure_channel(addr(srv), options=[("grpc.max_receive_message_length", 8 * MIB)])
        stub = telemetry_pb2_grpc.TelemetryServiceStub(channel)
        try:
            for _ in range(6):
                if rng.random() < 0.3:
                    req = telemetry_pb2.CaptureRequest(layers=["layer1", "layer2"])
                    req.inputs.add(dtype=1, shape=list(big.shape), raw_data=big.tobytes())
                else:
                    req = telemetry_pb2.CaptureRequest(layers=["layer1", "layer2"], passes=rng.randint(1, 4))
                call = stub.Capture(req, timeout=60)
                read = rng.randint(0, 6)
                try:
                    if read == 0:
                        time.sleep(rng.random() * 0.05)
                    else:
                        for i, _msg in enumerate(call):
                            if i + 1 >= read:
                                break
                except grpc.RpcError as exc:
                    if exc.code() not in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED):
                        raise
                call.cancel()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            channel.close()

    pump = threading.Thread(target=traffic)
    pump.start()
    threads = [threading.Thread(target=capturer, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    stop.set()
    pump.join(30)
    assert not any(t.is_alive() for t in threads), "a capturing client hung"
    assert not errors, errors[0]
    with layertap.Client(addr(srv)) as client:
        assert wait_for(lambda: (lambda s: s.active_captures == 0 and s.active_hooks == 0)(client.stats()), 10), (
            client.stats(), state.capture_budget.held)
        assert_idle(srv)
        held = [state.captures.acquire() for _ in range(state.captures.limit)]
        with pytest.raises(LimitExceeded):
            state.captures.acquire()
        for s in held:
            s.release()
        x = batch(seed=42)
        np.testing.assert_array_equal(client.capture("fc", input=x), demo_output(x))
    assert_idle(srv)
