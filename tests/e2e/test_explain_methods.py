"""Explain's Captum methods end to end on the demo model: completeness, Captum's numbers, bounds, cost.

Completeness is checked by the test itself, not through Captum's delta (the
delta is defined as the very residual): F(input) and F(baseline) come from
the demo model rebuilt here, and the attributions' sum must match their
difference.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch
from support.e2e import batch, rich_details, wait_for

import layertap
from layertap.server.codec import tensor_to_proto
from layertap.server.explain.options import EXPLAIN_OWNER
from layertap.server.host.demo_model import build_demo_model
from layertap.v1 import telemetry_pb2 as pb
from layertap.v1 import telemetry_pb2_grpc

pytestmark = pytest.mark.e2e

captum_attr = pytest.importorskip("captum.attr")


def scores(x: np.ndarray, classes: list[int]) -> np.ndarray:
    """F: the demo model's output at each sample's class, float64."""
    with torch.no_grad():
        out = build_demo_model(0).eval()(torch.from_numpy(x)).double().numpy()
    return out[np.arange(len(x)), classes]


def residual(found: layertap.Explanation, x: np.ndarray, base: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``sum(attributions) - (F(x) - F(baseline))`` per sample, and ``F(x) - F(baseline)``."""
    gap = scores(x, found.classes) - scores(base, found.classes)
    total = found.attributions.reshape(len(x), -1).astype(np.float64).sum(axis=1)
    return total - gap, gap


@pytest.mark.parametrize("baseline", ["zeros", "given", "noise"])
def test_integrated_gradients_satisfy_completeness(client: layertap.Client, baseline: str) -> None:
    x = batch(3, seed=21)
    given = (batch(1, seed=22) * 0.5).astype(np.float32)
    base = {"zeros": np.zeros_like(x), "given": np.repeat(given, 3, axis=0),
            "noise": (torch.randn(x.shape, generator=torch.Generator().manual_seed(5)) * 0.2).numpy()}[baseline]
    kwargs = {"zeros": {"baseline": "zeros"}, "given": {"baseline": given},
              "noise": {"baseline": "noise", "noise_std": 0.2, "seed": 5}}[baseline]
    fine = client.explain(x, method="integrated_gradients", n_steps=128, **kwargs)
    coarse = client.explain(x, method="ig", n_steps=8, **kwargs)
    assert fine.method == "integrated_gradients" and fine.n_steps == 128 and fine.layer == ""
    assert fine.attributions.shape == x.shape and fine.attributions.dtype == np.float32
    res, gap = residual(fine, x, base)
    assert np.all(np.abs(gap) > 0.1), gap  # a difference worth attributing
    assert np.all(np.abs(res) <= 0.01 * np.abs(gap)), np.abs(res) / np.abs(gap)
    assert fine.delta is not None and fine.delta.shape == (3,)
    np.testing.assert_allclose(fine.delta, res, rtol=0, atol=1e-4 * np.abs(gap).max())
    coarse_res, _ = residual(coarse, x, base)
    assert np.abs(res).max() < np.abs(coarse_res).max()
    np.testing.assert_allclose(coarse.delta, coarse_res, rtol=0, atol=1e-4 * np.abs(gap).max())


def test_integrated_gradients_equal_captum_run_here(client: layertap.Client) -> None:
    x = batch(2, seed=23)
    found = client.explain(x, method="ig", target=[3, 8], n_steps=32, internal_batch_size=16)
    model = build_demo_model(0).eval()
    want, delta = captum_attr.IntegratedGradients(model).attribute(
        torch.from_numpy(x), target=[3, 8], n_steps=32, internal_batch_size=16, return_convergence_delta=True)
    np.testing.assert_allclose(found.attributions, want.detach().numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(found.delta, delta.numpy(), rtol=1e-4, atol=1e-5)
    assert found.classes == [3, 8] and found.internal_batches == 1 + 32 // 8 + 1


def test_saliency_and_layer_integrated_gradients_equal_captum_run_here(client: layertap.Client) -> None:
    x = batch(2, seed=24)
    model = build_demo_model(0).eval()
    sal = client.explain(x, method="saliency")
    want = captum_attr.Saliency(model).attribute(torch.from_numpy(x).requires_grad_(), target=sal.classes)
    np.testing.assert_allclose(sal.attributions, want.numpy(), rtol=1e-5, atol=1e-7)
    assert sal.delta is None and sal.method == "saliency"
    lig = client.explain(x, "layer2", method="lig", n_steps=16)
    want, delta = captum_attr.LayerIntegratedGradients(model, model.layer2).attribute(
        torch.from_numpy(x), target=lig.classes, n_steps=16, internal_batch_size=64, return_convergence_delta=True)
    assert lig.layer == "layer2" and lig.attributions.shape == (2, 32, 8, 8)
    np.testing.assert_allclose(lig.attributions, want.detach().numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(lig.delta, delta.numpy(), rtol=1e-4, atol=1e-5)


def _owner_log(srv) -> list[object]:  # type: ignore[no-untyped-def]
    """Each forward's pass owner, in order (EXPLAIN_OWNER, or None for Infer)."""
    host = srv.state.host
    owners: list[object] = []
    host.module.register_forward_pre_hook(lambda m, a: owners.append(host._current.active_owner))
    return owners


def test_infer_runs_between_internal_batches(demo_server, client: layertap.Client) -> None:
    """An Infer sent while a long explanation runs is answered before the explanation ends: its pass lies
    between two of the explanation's (ordering, not timing: 66 passes, and the Infer waits for one at most)."""
    owners = _owner_log(demo_server)
    x = batch(1, seed=25)
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(client.explain, x, method="ig", n_steps=64, internal_batch_size=1, timeout=120)
        assert wait_for(lambda: owners.count(EXPLAIN_OWNER) >= 2, 60)
        out = client.infer(x)
        infer_done_with_explain_running = not long.done()
        found = long.result()
    assert out.shape == (1, 10) and infer_done_with_explain_running
    assert found.internal_batches == 1 + 64 + 1
    explain_passes = [i for i, o in enumerate(owners) if o == EXPLAIN_OWNER]
    infer_pass = owners.index(None)
    assert explain_passes[0] < infer_pass < explain_passes[-1], (infer_pass, len(owners))


def test_past_its_deadline_explain_stops_within_one_batch(make_server) -> None:
    srv = make_server(metrics_port=0)
    host = srv.state.host
    starts: list[float] = []

    def slow(module, args):  # type: ignore[no-untyped-def]
        if host._current is not None and host._current.active_owner == EXPLAIN_OWNER:
            starts.append(time.monotonic())
            time.sleep(0.05)

    host.module.register_forward_pre_hook(slow)
    registry = srv.state.registry
    labels = {"model": "demo", "method": "integrated_gradients", "code": "DEADLINE_EXCEEDED"}
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        begun = time.monotonic()
        with pytest.raises(layertap.DeadlineExceeded):  # 258 passes of 50 ms: 13 s
            client.explain(batch(1, seed=26), method="ig", n_steps=256, internal_batch_size=1, timeout=1.0)
        deadline = begun + 1.0
        assert wait_for(lambda: registry.get_sample_value("layertap_explain_requests_total", labels) == 1, 10)
        ran = len(starts)
        time.sleep(0.3)
        assert len(starts) == ran, "passes ran after the server gave up"
        assert 3 <= ran < 100, ran
        assert sum(s > deadline for s in starts) <= 1, [round(s - deadline, 3) for s in starts if s > deadline]
        assert client.infer(batch(1)).shape == (1, 10)  # the model is free


def test_a_cancelled_call_is_counted_as_cancelled(make_server) -> None:
    """A caller who cancels gets no DEADLINE_EXCEEDED in the metrics: it set no deadline."""
    srv = make_server(metrics_port=0)
    host = srv.state.host
    begun: list[float] = []

    def slow(module, args):  # type: ignore[no-untyped-def]
        if host._current is not None and host._current.active_owner == EXPLAIN_OWNER:
            begun.append(time.monotonic())
            time.sleep(0.05)

    host.module.register_forward_pre_hook(slow)
    registry = srv.state.registry
    request = pb.ExplainRequest(inputs=[tensor_to_proto(torch.from_numpy(batch(1, seed=28)))],
                                method=pb.EXPLAIN_METHOD_INTEGRATED_GRADIENTS, n_steps=256, internal_batch_size=1)
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
        call = telemetry_pb2_grpc.TelemetryServiceStub(channel).Explain.future(request)
        assert wait_for(lambda: len(begun) >= 3, 30)
        call.cancel()

    def count(code: str) -> float | None:
        return registry.get_sample_value("layertap_explain_requests_total",
                                         {"model": "demo", "method": "integrated_gradients", "code": code})

    assert wait_for(lambda: count("CANCELLED") == 1, 10)
    assert count("DEADLINE_EXCEEDED") is None
    ran = len(begun)
    time.sleep(0.3)
    assert len(begun) <= ran + 1 < 100, "passes went on after the cancel"


def test_each_call_s_cost_is_counted(make_server) -> None:
    srv = make_server(metrics_port=0)
    registry = srv.state.registry
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        found = client.explain(batch(2, seed=27), method="ig", n_steps=20, internal_batch_size=10)
        client.explain(batch(2, seed=27), "layer4")
        with pytest.raises(layertap.InvalidArgument):
            client.explain(batch(2), method="saliency", n_steps=3)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model": "demo", **labels})

    assert value("layertap_explain_requests_total", method="integrated_gradients", code="OK") == 1
    assert value("layertap_explain_requests_total", method="grad_cam", code="OK") == 1
    assert value("layertap_explain_requests_total", method="saliency", code="INVALID_ARGUMENT") == 1
    assert value("layertap_explain_batches_sum", method="integrated_gradients") == found.internal_batches == 1 + 4 + 1
    assert value("layertap_explain_batches_sum", method="grad_cam") == 2
    assert value("layertap_explain_duration_seconds_count", method="integrated_gradients") == 1
    assert value("layertap_explain_duration_seconds_sum", method="integrated_gradients") > 0


@pytest.mark.parametrize("call,field", [
    (dict(method="ig", n_steps=300), "n_steps"),
    (dict(method="ig", baseline=np.zeros((2, 3, 16, 16), np.float32)), "baseline.shape"),
    (dict(method="ig", baseline=np.zeros((2, 3, 32, 32), np.int64)), "baseline.dtype"),
    (dict(method="ig", internal_batch_size=65), "internal_batch_size"),
    (dict(method="ig", layer="layer4"), "layer"),
    (dict(method="ig", upsample=True), "upsample"),
    (dict(method="saliency", baseline="noise"), "baseline_kind"),
    (dict(method="ig", seed=3), "seed"),
    (dict(layer="layer4", n_steps=10), "n_steps"),
    (dict(method="grad_cam"), "layer"),
    (dict(method="integrated gradients"), "method"),
])
def test_bad_input_is_invalid_argument_naming_the_field(client: layertap.Client, call: dict, field: str) -> None:
    with pytest.raises(layertap.InvalidArgument) as err:
        client.explain(batch(2, seed=28), **call)
    assert err.value.field == field, err.value


def test_an_unknown_method_on_the_wire_names_the_field(demo_server) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{demo_server.port}") as channel:
        stub = telemetry_pb2_grpc.TelemetryServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Explain(pb.ExplainRequest(inputs=[tensor_to_proto(torch.from_numpy(batch(1)))], method=99), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info, violations = rich_details(err.value)
    assert info.metadata["field"] == "method" and violations[0][0] == "method"
    assert "EXPLAIN_METHOD_INTEGRATED_GRADIENTS" in err.value.details()


def test_an_old_request_is_grad_cam(demo_server) -> None:
    """A client from before methods sends no method: Grad-CAM's maps, in ``maps``, as before."""
    with grpc.insecure_channel(f"127.0.0.1:{demo_server.port}") as channel:
        stub = telemetry_pb2_grpc.TelemetryServiceStub(channel)
        resp = stub.Explain(pb.ExplainRequest(inputs=[tensor_to_proto(torch.from_numpy(batch(2)))], layer="layer4"),
                            timeout=30)
    assert resp.HasField("maps") and not resp.HasField("attributions") and list(resp.maps.shape) == [2, 2, 2]
    assert resp.method == pb.EXPLAIN_METHOD_GRAD_CAM and not resp.deltas


def test_cli_writes_the_integrated_gradients_heatmap(demo_server, client, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from PIL import Image

    from layertap.cli import main
    from layertap.cli.explain import heat, overlay

    x = batch(2, seed=29)
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "ig.png"
    assert main(["explain", str(demo_server.port), "--input", str(tmp_path / "x.npy"), "--method", "ig",
                 "--n-steps", "16", "-o", str(out)]) == 0
    found = client.explain(x, method="ig", n_steps=16)
    printed = capsys.readouterr().out.splitlines()
    maps = heat(found.attributions)
    for i in range(2):
        path = tmp_path / f"ig-{i}.png"
        assert printed[i].startswith(f"{path}: class {found.classes[i]} score ") and " delta " in printed[i]
        assert np.array_equal(np.asarray(Image.open(path).convert("RGB")), overlay(x[i], maps[i]))
    assert main(["explain", str(demo_server.port), "--input", str(tmp_path / "x.npy"), "--method", "ig",
                 "--layer", "layer4", "-o", str(out)]) == 1
    assert "--layer is for grad_cam, layer_integrated_gradients" in capsys.readouterr().err
