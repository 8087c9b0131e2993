"""Infer, GetModelMetadata and ListLayers against a real server."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from support.e2e import batch

import layertap
from layertap.server.host.demo_model import build_demo_model
from layertap.v1 import inference_pb2, inference_pb2_grpc, tensor_pb2

pytestmark = pytest.mark.e2e


def test_metadata_lets_a_client_build_an_input(client):
    meta = client.metadata()
    assert (meta.model_name, meta.source, meta.device, meta.dtype) == ("demo", "demo", "cpu", "float32")
    assert meta.parameter_count == sum(p.numel() for p in build_demo_model(0).parameters())
    assert meta.api_version == "layertap.v1" and meta.server_version
    (spec,) = meta.inputs
    assert spec.shape == (-1, 3, 32, 32) and spec.dtype == "float32"
    x = np.zeros([5 if d == -1 else d for d in spec.shape], dtype=spec.dtype)
    assert client.infer(x).shape == (5, 10)
    assert meta.active_hooks == 0 and meta.hooks_supported


def test_infer_matches_local_model(client):
    x = batch(3)
    with torch.inference_mode():
        want = build_demo_model(0)(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(client.infer(x), want)


def test_list_layers(client):
    layers = {layer.name: layer for layer in client.layers()}
    model = build_demo_model(0)
    assert set(layers) == {n for n, _ in model.named_modules() if n}
    assert layers["layer4"].type == "Sequential"
    assert layers["fc"].parameter_count == 128 * 10 + 10
    assert layers["layer4"].output_shapes == [(1, 128, 2, 2)]  # from the warm-up pass
    client.infer(batch(3))
    assert client.layers()  # arms the shape probe
    client.infer(batch(6))
    layers = {layer.name: layer for layer in client.layers()}
    assert layers["layer4"].output_shapes == [(6, 128, 2, 2)]
    assert layers["layer1.0.conv1"].input_shapes == [(6, 16, 16, 16)]


def test_bfloat16_server(make_server):
    srv = make_server(dtype="bfloat16")
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        meta = client.metadata()
        assert meta.dtype == "bfloat16" and meta.inputs[0].dtype == "bfloat16"
        x = torch.randn(2, 3, 32, 32).to(torch.bfloat16)
        out = client.infer(x, as_torch=True)
        assert out.dtype == torch.bfloat16
        model = build_demo_model(0).to(torch.bfloat16)
        with torch.inference_mode():
            want = model(x)
        assert torch.equal(out, want)
        act = client.capture("layer4", input=x)
        assert act.dtype == np.float32  # numpy has no bf16: widened exactly
        # numpy-only clients send float32; the server casts it to bf16.
        x32 = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
        with torch.inference_mode():
            want32 = model(torch.from_numpy(x32).to(torch.bfloat16))
        assert torch.equal(client.infer(x32, as_torch=True), want32)
        with pytest.raises(layertap.InvalidArgument, match=r"bfloat16 \(or float32"):
            client.infer(np.zeros((1, 3, 32, 32), np.float64))


def test_oversized_request_is_resource_exhausted(make_server):
    srv = make_server(max_request_bytes=1 << 20)
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}", options=[("grpc.max_send_message_length", 64 << 20)])
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    for n in (100, 400):  # over the tensor cap; over the gRPC message cap too
        x = np.zeros((n, 3, 32, 32), np.float32)
        req = inference_pb2.InferRequest(inputs=[tensor_pb2.Tensor(
            dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=list(x.shape), raw_data=x.tobytes())])
        with pytest.raises(grpc.RpcError) as info:
            stub.Infer(req, timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    channel.close()
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        with pytest.raises(layertap.ResourceExhausted, match="max-request-bytes"):
            client.infer(np.zeros((100, 3, 32, 32), np.float32))
        assert client.infer(np.zeros((2, 3, 32, 32), np.float32)).shape == (2, 10)


def test_request_errors_name_the_field(make_server):
    srv = make_server(max_request_bytes=1 << 20)
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        with pytest.raises(layertap.InvalidArgument) as wrong_shape:
            client.infer(np.zeros((2, 3, 16, 16), np.float32))
        with pytest.raises(layertap.ResourceExhausted) as too_big:
            client.infer(np.zeros((100, 3, 32, 32), np.float32))
    err = wrong_shape.value
    assert (err.reason, err.field) == ("INVALID_ARGUMENT", "inputs[0].shape")
    assert err.details.startswith("inputs[0].shape: ")
    assert type(too_big.value) is layertap.ResourceExhausted
    assert (too_big.value.reason, too_big.value.field) == ("RESOURCE_EXHAUSTED", "inputs")
    assert too_big.value.metadata["max_bytes"] == str(1 << 20)

