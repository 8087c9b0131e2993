"""Capture end to end: a real server, the real client, a local torch reference."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import numpy as np
import pytest
import torch
from support.e2e import batch, rich_details, wait_for

import layertap
from layertap import _capture
from layertap.server.host.demo_model import build_demo_model
from layertap.v1 import telemetry_pb2, telemetry_pb2_grpc, tensor_pb2

pytestmark = pytest.mark.e2e


def reference(x: np.ndarray, layers: list[str], seed: int = 0) -> dict[str, np.ndarray]:
    """Forward-hook reference from the same seed, in this process."""
    model = build_demo_model(seed)
    got: dict[str, np.ndarray] = {}
    handles = [
        model.get_submodule(name).register_forward_hook(
            lambda _m, _a, out, _n=name: got.__setitem__(_n, out.detach().clone().numpy())
        )
        for name in layers
    ]
    with torch.inference_mode():
        model(torch.from_numpy(x))
    for h in handles:
        h.remove()
    return got


def test_subprocess_server_active_and_passive_match_reference(serve_process):
    srv = serve_process("--no-metrics", "--seed", "3")
    x = batch()
    ref = reference(x, ["layer4", "avgpool"], seed=3)
    with layertap.Client(srv.address) as client:
        active = client.capture(["layer4", "avgpool"], input=x)
        assert set(active) == {"layer4", "avgpool"}
        for name in ("layer4", "avgpool"):
            assert active[name].dtype == np.float32
            np.testing.assert_array_equal(active[name], ref[name])

        result: dict = {}
        t = threading.Thread(target=lambda: result.update(client.capture(["layer4", "avgpool"], timeout=30)))
        t.start()
        assert wait_for(lambda: client.stats().active_hooks == 2)
        with layertap.Client(srv.address) as other:
            other.infer(x)
        t.join(30)
        for name in ("layer4", "avgpool"):
            np.testing.assert_array_equal(result[name], ref[name])
        assert wait_for(lambda: client.stats().active_hooks == 0)
    assert srv.stop() == 0  # SIGTERM -> graceful exit code 0


def test_passive_capture_returns_exactly_the_concurrent_infer_pass(client, demo_server):
    x1, x2 = batch(seed=11), batch(seed=12)
    client.infer(x1)  # earlier traffic must not be returned
    out: list = []
    t = threading.Thread(target=lambda: out.append(client.capture("layer3", timeout=30)))
    t.start()
    assert wait_for(lambda: demo_server.state.host.hooks.active == 1)
    with layertap.Client(f"127.0.0.1:{demo_server.port}") as other:
        other.infer(x2)
    t.join(30)
    np.testing.assert_array_equal(out[0], reference(x2, ["layer3"])["layer3"])


def test_passive_capture_of_n_passes_returns_a_list(client, demo_server):
    xs = [batch(2, seed=s) for s in (21, 22, 23)]
    out: list = []
    t = threading.Thread(target=lambda: out.append(client.capture("fc", n=3, timeout=30)))
    t.start()
    assert wait_for(lambda: demo_server.state.host.hooks.active == 1)
    with layertap.Client(f"127.0.0.1:{demo_server.port}") as other:
        for x in xs:
            other.infer(x)
    t.join(30)
    assert isinstance(out[0], list) and len(out[0]) == 3
    for got, x in zip(out[0], xs):
        np.testing.assert_array_equal(got, reference(x, ["fc"])["fc"])


def test_active_capture_is_not_seen_by_passive_capture(client, demo_server):
    out: list = []
    t = threading.Thread(target=lambda: out.append(client.capture("fc", timeout=30)))
    t.start()
    assert wait_for(lambda: demo_server.state.host.hooks.active == 1)
    with layertap.Client(f"127.0.0.1:{demo_server.port}") as other:
        other.capture("fc", input=batch(seed=5))  # active: must be ignored
        time.sleep(0.2)
        assert t.is_alive()
        live = batch(seed=6)
        other.infer(live)
    t.join(30)
    np.testing.assert_array_equal(out[0], reference(live, ["fc"])["fc"])


def test_serving_passes_have_no_training_step(client, demo_server):
    """Infer traffic and active captures are no training steps: headers say has_step false, the client None."""
    req = _capture.capture_request(["fc"], input=None, passes=1, point="output", max_batch=None, dtype=None)
    assembler = _capture.CaptureAssembler()
    t = threading.Thread(target=lambda: _capture.receive(client._capture_rpc(req, timeout=30), assembler))
    t.start()
    assert wait_for(lambda: demo_server.state.host.hooks.active == 1)
    client.infer(batch(seed=7))
    t.join(30)
    (live,) = assembler.finish()
    assert (live.layer, live.active, live.step) == ("fc", False, None)

    with grpc.insecure_channel(f"127.0.0.1:{demo_server.port}") as channel:
        x = batch(seed=8)
        active = telemetry_pb2.CaptureRequest(layers=["fc"], inputs=[tensor_pb2.Tensor(
            dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=list(x.shape), raw_data=x.tobytes())])
        headers = [m.header for m in telemetry_pb2_grpc.TelemetryServiceStub(channel).Capture(active, timeout=30)
                   if m.WhichOneof("payload") == "header"]
    assert [(h.active, h.has_step, h.step) for h in headers] == [(True, False, 0)]


def test_input_point_and_container_outputs(make_server):
    from support.models import containers

    from layertap.server.host.sources import InputSpec, LoadedModel

    model = containers()
    srv = make_server(LoadedModel(model, "containers", "factory", [InputSpec("input", torch.float32, (-1, 8))]))
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    with torch.inference_mode():
        h = model.lin(torch.from_numpy(x))
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        pair = client.capture("pair", input=x)
        assert isinstance(pair, list) and len(pair) == 2
        np.testing.assert_array_equal(pair[0], (h * 2).numpy())
        np.testing.assert_array_equal(pair[1], h.sum(dim=1).numpy())
        d = client.capture("dict", input=x)
        assert isinstance(d, dict) and set(d) == {"pos", "neg"}
        np.testing.assert_array_equal(d["neg"], torch.relu(-h).numpy())
        one_arg = client.capture("pair", input=x, point="input")
        assert isinstance(one_arg, np.ndarray)
        np.testing.assert_array_equal(one_arg, h.numpy())
        two_args = client.capture("mix", input=x, point="input")
        assert isinstance(two_args, list) and len(two_args) == 2
        np.testing.assert_array_equal(two_args[1], torch.relu(h).numpy())


def test_64_mib_tensor_is_bit_exact_in_1_mib_chunks(make_server):
    from support.models import identity

    from layertap.server.host.sources import InputSpec, LoadedModel

    srv = make_server(LoadedModel(identity(), "identity", "factory", [InputSpec("input", torch.float32, (-1, 1024, 1024))]))
    x = np.random.default_rng(7).standard_normal((16, 1024, 1024)).astype(np.float32)  # 64 MiB
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:  # default channel options
        got = client.capture("body", input=x, timeout=120)
    assert got.tobytes() == x.tobytes()
    # Count the chunks on the wire with the raw stub.
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}", options=[
        ("grpc.max_send_message_length", 300 << 20), ("grpc.max_receive_message_length", 300 << 20)])
    stub = telemetry_pb2_grpc.TelemetryServiceStub(channel)
    req = telemetry_pb2.CaptureRequest(layers=["body"], inputs=[tensor_pb2.Tensor(
        dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=list(x.shape), raw_data=x.tobytes())])
    chunks = [m.chunk for m in stub.Capture(req, timeout=120) if m.HasField("chunk")]
    channel.close()
    assert len(chunks) >= 64
    assert max(len(c.data) for c in chunks) <= 1 << 20
    assert sum(len(c.data) for c in chunks) == x.nbytes


def test_downcast_and_max_batch(client):
    x = batch(6)
    ref = reference(x, ["layer2"])["layer2"]
    half = client.capture("layer2", input=x, dtype="float16", max_batch=2)
    assert half.dtype == np.float16 and half.shape == (2, *ref.shape[1:])
    np.testing.assert_array_equal(half, ref[:2].astype(np.float16))
    bf = client.capture("layer2", input=x, dtype="bfloat16", max_batch=3, as_torch=True)
    assert bf.dtype == torch.bfloat16 and tuple(bf.shape) == (3, *ref.shape[1:])
    assert torch.equal(bf, torch.from_numpy(ref[:3]).to(torch.bfloat16))
    bf_np = client.capture("layer2", input=x, dtype="bfloat16", max_batch=3)
    assert bf_np.dtype == np.float32  # numpy has no bfloat16: widened exactly
    np.testing.assert_array_equal(bf_np, torch.from_numpy(ref[:3]).to(torch.bfloat16).float().numpy())


def test_unknown_layer_suggests_close_names(client):
    with pytest.raises(layertap.LayerNotFound) as info:
        client.capture("layer5", input=batch())
    assert "layer4" in str(info.value)
    assert info.value.code == "NOT_FOUND"


def test_over_the_cap_is_refused_before_any_data(make_server):
    srv = make_server(max_capture_bytes=10_000)
    x = batch(4)
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        with pytest.raises(layertap.CaptureTooLarge):
            client.capture("layer1", input=x)
        assert client.capture("fc", input=x).shape == (4, 10)  # small still works
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    stub = telemetry_pb2_grpc.TelemetryServiceStub(channel)
    req = telemetry_pb2.CaptureRequest(layers=["fc", "layer1"], inputs=[tensor_pb2.Tensor(
        dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=list(x.shape), raw_data=x.tobytes())])
    received = []
    with pytest.raises(grpc.RpcError) as info:
        for msg in stub.Capture(req, timeout=30):
            received.append(msg)
    channel.close()
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert received == []


# ------------------------------------------------------------------ error details: the contract for any client


def test_errors_carry_reason_and_field_as_data(make_server):
    srv = make_server(max_capture_bytes=10_000)
    x = batch(4)
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        with pytest.raises(layertap.CaptureTooLarge) as too_large:
            client.capture("layer1", input=x)
        with pytest.raises(layertap.LayerNotFound) as unknown:
            client.capture(["fc", "layer5"], input=x)
        with pytest.raises(layertap.InvalidArgument) as invalid:
            client.capture("fc", input=x, n=2)  # an active capture runs one pass: the server refuses
        with pytest.raises(layertap.LayerNotFound) as no_match:
            client.create_tap("head*")

    assert too_large.value.reason == "CAPTURE_TOO_LARGE" and too_large.value.metadata["max_bytes"] == "10000"
    info, violations = rich_details(too_large.value.__cause__)
    assert info.reason == "CAPTURE_TOO_LARGE" and info.metadata["max_bytes"] == "10000" and not violations

    err = unknown.value
    assert (err.reason, err.field, err.layer) == ("LAYER_NOT_FOUND", "layers[1]", "layer5")
    assert "layer4" in err.suggestions and "layer5" in err.details  # the message still says it
    info, _ = rich_details(err.__cause__)
    assert info.reason == "LAYER_NOT_FOUND"
    assert dict(info.metadata) == {"field": "layers[1]", "layer": "layer5", "suggestions": ",".join(err.suggestions)}

    assert invalid.value.reason == "INVALID_ARGUMENT" and invalid.value.field == "passes"
    assert invalid.value.details.startswith("passes: ")  # the message still names the field
    info, violations = rich_details(invalid.value.__cause__)
    assert info.reason == "INVALID_ARGUMENT" and info.metadata["field"] == "passes"
    assert violations == [("passes", "an active capture (with inputs) runs exactly one pass")]

    assert (no_match.value.reason, no_match.value.field, no_match.value.layer) == (
        "LAYER_NOT_FOUND", "spec.selector", "head*")
    assert rich_details(no_match.value.__cause__)[0].metadata["field"] == "spec.selector"


def test_a_taken_tap_name_is_already_exists(client):
    client.create_tap("fc", name="fc-stats")
    with pytest.raises(layertap.AlreadyExists) as taken:
        client.create_tap("layer4", name="fc-stats")
    assert taken.value.code == "ALREADY_EXISTS" and taken.value.reason == "ALREADY_EXISTS"
    assert "fc-stats" in str(taken.value)
    info, violations = rich_details(taken.value.__cause__)
    assert info.reason == "ALREADY_EXISTS" and not violations
    assert [t.id for t in client.taps()] == ["fc-stats"]  # the first one is untouched
    client.delete_tap("fc-stats")


def test_capture_limits(make_server):
    srv = make_server(max_capture_passes=2)
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        with pytest.raises(layertap.ResourceExhausted):
            client.capture("fc", n=3, timeout=5)


def test_malformed_input_is_invalid_argument(client):
    channel = grpc.insecure_channel(client_target(client))
    from layertap.v1 import inference_pb2, inference_pb2_grpc

    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    bad = tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=[1, 3, 32, 32], raw_data=b"\0" * 100)
    with pytest.raises(grpc.RpcError) as info:
        stub.Infer(inference_pb2.InferRequest(inputs=[bad]), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "12288" in info.value.details()  # says what was expected
    channel.close()
    with pytest.raises(layertap.InvalidArgument, match="shape"):
        client.infer(np.zeros((2, 3, 16, 16), np.float32))
    with pytest.raises(layertap.InvalidArgument, match="dtype"):
        client.infer(np.zeros((2, 3, 32, 32), np.float64))


def client_target(client) -> str:
    return client.target


def test_server_down_is_server_unavailable_within_deadline():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    start = time.monotonic()
    with layertap.Client(f"127.0.0.1:{port}", timeout=3) as client:
        with pytest.raises(layertap.ServerUnavailable):
            client.metadata()
    assert time.monotonic() - start < 10


CLIENT_SCRIPT = textwrap.dedent("""
    import sys, layertap
    with layertap.Client(sys.argv[1]) as c:
        print("capturing", flush=True)
        c.capture("layer4", n=2, timeout=60)
""")


def test_sigkilled_client_mid_capture_frees_hooks(demo_server):
    addr = f"127.0.0.1:{demo_server.port}"
    proc = subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, addr], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "capturing"
    host = demo_server.state.host
    assert wait_for(lambda: host.hooks.active == 1, 10)
    with layertap.Client(addr) as other:
        other.infer(batch())  # one of the two passes arrives: the capture is mid-way
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert wait_for(lambda: host.hooks.active == 0, 5)
    assert demo_server.state.captures.active == 0


def test_cancelled_capture_frees_hooks(demo_server):
    host = demo_server.state.host
    channel = grpc.insecure_channel(f"127.0.0.1:{demo_server.port}")
    stub = telemetry_pb2_grpc.TelemetryServiceStub(channel)
    call = stub.Capture(telemetry_pb2.CaptureRequest(layers=["layer1", "layer2"]), timeout=60)
    assert wait_for(lambda: host.hooks.active == 2)
    call.cancel()
    assert wait_for(lambda: host.hooks.active == 0, 5)
    channel.close()


def test_parallel_captures_and_infers_are_all_correct(demo_server):
    addr = f"127.0.0.1:{demo_server.port}"
    errors: list[BaseException] = []
    model = build_demo_model(0)

    def capturer(i: int) -> None:
        try:
            x = batch(2, seed=100 + i)
            with layertap.Client(addr) as c:
                for _ in range(3):
                    got = c.capture(["layer3", "fc"], input=x)
                    ref = reference(x, ["layer3", "fc"])
                    np.testing.assert_array_equal(got["layer3"], ref["layer3"])
                    np.testing.assert_array_equal(got["fc"], ref["fc"])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def inferer(i: int) -> None:
        try:
            x = infer_inputs[i]
            with torch.inference_mode():
                want = model(torch.from_numpy(x)).numpy()
            with layertap.Client(addr) as c:
                # Live traffic until every passive capture is served (bounded).
                for k in range(2000):
                    np.testing.assert_array_equal(c.infer(x), want)
                    if k >= 5 and passive_left[0] == 0:
                        break
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    infer_inputs = [batch(2, seed=200 + i) for i in range(4)]
    live_refs = [reference(x, ["layer3"])["layer3"] for x in infer_inputs]

    def passive(i: int) -> None:
        # A passive capture among concurrent Infer calls must return exactly
        # one of their passes, never a mix.
        try:
            with layertap.Client(addr) as c:
                for _ in range(2):
                    got = c.capture("layer3", timeout=60)
                    assert any(np.array_equal(got, ref) for ref in live_refs), "passive capture matched no Infer pass"
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            with passive_lock:
                passive_left[0] -= 1

    passive_lock = threading.Lock()
    passive_left = [4]
    # 8 capturing clients (4 active, 4 passive: the server's limit is 8) and 4 Infer clients.
    threads = [threading.Thread(target=capturer, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=passive, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=inferer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a client thread hung"
    assert not errors, errors[0]
    assert wait_for(lambda: demo_server.state.host.hooks.active == 0)


def test_module_called_twice_per_pass_gives_one_entry_per_call(client):
    x = batch(2)
    model = build_demo_model(0)
    seen: list = []
    h = model.layer1[0].relu.register_forward_hook(lambda _m, _a, o: seen.append(o.detach().clone().numpy()))
    with torch.inference_mode():
        model(torch.from_numpy(x))
    h.remove()
    got = client.capture("layer1.0.relu", input=x)
    assert isinstance(got, list) and len(got) == 2
    for g, want in zip(got, seen):
        np.testing.assert_array_equal(g, want)
