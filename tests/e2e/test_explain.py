"""Explain (Grad-CAM) end to end: the real client against a real server, checked against Captum."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from support.e2e import batch
from torch import nn

import layertap
from layertap.server.host.demo_model import DEMO_INPUT_SHAPE, build_demo_model
from layertap.server.host.sources import InputSpec, LoadedModel

pytestmark = pytest.mark.e2e

captum_attr = pytest.importorskip("captum.attr")

RTOL = 1e-4


def demo_loaded(model: nn.Module | None = None, source: str = "factory", **kw: object) -> LoadedModel:
    model = build_demo_model(0) if model is None else model
    return LoadedModel(model, "demo", source, [InputSpec("input", torch.float32, DEMO_INPUT_SHAPE)], **kw)


def captum_cam(model: nn.Module, layer: str, x: np.ndarray, target: object, *, upsample: bool = False) -> np.ndarray:
    """Captum's LayerGradCam, with the ReLU the RPC applies, channel dim dropped."""
    model = model.eval()
    inputs = torch.from_numpy(x)
    cam = captum_attr.LayerGradCam(model, model.get_submodule(layer)).attribute(
        inputs, target=target, relu_attributions=True)
    if upsample:
        cam = captum_attr.LayerAttribution.interpolate(cam, tuple(x.shape[2:]), interpolate_mode="bilinear")
    return cam.detach().double().numpy()[:, 0]


def assert_cam_close(got: np.ndarray, ref: np.ndarray, rtol: float = RTOL) -> None:
    """Relative to each map's own scale (values near 0 after the ReLU have no relative precision);
    a map that is all zeros (no positive evidence for the class) is held to the batch's scale."""
    assert got.shape == ref.shape and got.dtype == np.float32
    scale = np.abs(ref).reshape(len(ref), -1).max(axis=1).reshape(-1, *[1] * (ref.ndim - 1))
    assert scale.max() > 0, "a degenerate reference would compare nothing"
    scale = np.where(scale > 0, scale, scale.max())
    assert np.all(np.abs(got - ref) <= rtol * scale), np.abs(got - ref).max() / scale.min()


@pytest.mark.parametrize("layer", ["layer4", "layer3", "layer2.1", "layer1.0.conv2", "fc"])
def test_maps_equal_captum_for_the_top_class(client, layer):
    x = batch(4, seed=3)
    found = client.explain(x, layer)
    model = build_demo_model(0)
    logits = model(torch.from_numpy(x)).detach().double().numpy()
    assert found.classes == list(logits.argmax(axis=1))
    np.testing.assert_allclose(found.scores, logits[np.arange(4), found.classes], rtol=1e-5)
    assert_cam_close(found.maps, captum_cam(model, layer, x, found.classes))
    assert found.layer == layer


def test_given_targets_one_for_all_and_one_per_sample(client):
    x = batch(3, seed=4)
    model = build_demo_model(0)
    every = client.explain(x, "layer3", 7)
    assert every.classes == [7, 7, 7]
    assert_cam_close(every.maps, captum_cam(model, "layer3", x, 7))
    each = client.explain(x, "layer3", [0, 5, 9])
    assert each.classes == [0, 5, 9]
    assert_cam_close(each.maps, captum_cam(model, "layer3", x, [0, 5, 9]))
    logits = model(torch.from_numpy(x)).detach().double().numpy()
    np.testing.assert_allclose(each.scores, logits[[0, 1, 2], [0, 5, 9]], rtol=1e-5)


def test_upsample_and_normalize(client):
    x = batch(2, seed=5)
    model = build_demo_model(0)
    up = client.explain(x, "layer3", upsample=True)
    assert up.maps.shape == (2, 32, 32)
    ref = captum_cam(model, "layer3", x, up.classes, upsample=True)
    assert_cam_close(up.maps, ref)
    both = client.explain(x, "layer3", normalize=True, upsample=True)
    low = ref.min(axis=(1, 2), keepdims=True)
    want = (ref - low) / (ref.max(axis=(1, 2), keepdims=True) - low)
    np.testing.assert_allclose(both.maps, want, atol=1e-4)
    assert both.maps.min() == 0.0 and both.maps.max() == 1.0
    plain = client.explain(x, "layer4", normalize=True)
    assert plain.maps.shape == (2, 2, 2)
    assert np.allclose(plain.maps.reshape(2, -1).max(axis=1), 1.0)


def _hooks(model: nn.Module) -> list[tuple[str, int, int, int, int]]:
    return [(n, len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
             len(m._backward_pre_hooks)) for n, m in model.named_modules()]


@pytest.mark.parametrize("mode", ["eval", "train", "mixed"])
def test_explain_leaves_no_trace(make_server, mode):
    model = build_demo_model(0)
    if mode == "train":
        model.train()
    elif mode == "mixed":
        model.layer2.train()
        model.fc.train()
    gen = torch.Generator().manual_seed(9)
    for p in model.parameters():  # sentinel gradients, as a training loop would leave them
        p.grad = torch.randn(p.shape, generator=gen)
    model.layer1[0].conv1.weight.requires_grad_(False)
    srv = make_server(demo_loaded(model))
    host_model = srv.state.host.module
    before_grads = {n: p.grad.clone() for n, p in host_model.named_parameters()}
    before_flags = {n: p.requires_grad for n, p in host_model.named_parameters()}
    before_buffers = {n: b.clone() for n, b in host_model.named_buffers()}
    before_modes = {n: m.training for n, m in host_model.named_modules()}
    before_hooks = _hooks(host_model)
    # The server's warm-up pass ran in the model's own mode: a train-mode model's
    # statistics moved then, so the reference is the host's model as it is now.
    reference = copy.deepcopy(host_model)
    x = batch(4, seed=6)
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        found = client.explain(x, "layer4", upsample=True, normalize=True)
        with pytest.raises(layertap.FailedPrecondition):  # an error path leaves no trace either
            client.explain(x, "layer1.0.relu")  # runs twice per pass
        stats = client.stats()
    assert found.maps.shape == (4, 32, 32)
    for n, p in host_model.named_parameters():
        assert torch.equal(p.grad, before_grads[n]), n
        assert p.requires_grad == before_flags[n], n
    for n, b in host_model.named_buffers():
        assert torch.equal(b, before_buffers[n]), n  # BatchNorm running stats and num_batches_tracked
    assert {n: m.training for n, m in host_model.named_modules()} == before_modes
    assert _hooks(host_model) == before_hooks
    assert not nn.modules.module._global_forward_hooks
    assert stats.active_hooks == 0
    # Explained in eval mode, as Captum on the eval model.
    ref = captum_cam(reference, "layer4", x, found.classes, upsample=True)
    low = ref.min(axis=(1, 2), keepdims=True)
    np.testing.assert_allclose(found.maps, (ref - low) / (ref.max(axis=(1, 2), keepdims=True) - low), atol=1e-4)


# Measured: Captum itself, run on the half model, is off the float64 reference by up to
# 6.5% (float16) and 8.3% (bfloat16) of a map's peak: channels cancel in the weighted sum.
@pytest.mark.parametrize("dtype,tol", [("float16", 0.1), ("bfloat16", 0.15)])
def test_half_precision_models(make_server, dtype, tol):
    srv = make_server(dtype=dtype)
    x = batch(4, seed=7)
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        found = client.explain(x, "layer3", [1, 2, 3, 4])
    assert found.maps.dtype == np.float32 and np.isfinite(found.maps).all()
    # The reference: the same rounded weights, in float64.
    ref_model = build_demo_model(0).to(getattr(torch, dtype)).double()
    ref = captum_cam(ref_model, "layer3", x.astype(np.float64), [1, 2, 3, 4])
    scale = np.abs(ref).reshape(4, -1).max(axis=1)[:, None, None]
    assert np.all(np.abs(found.maps - ref) <= tol * scale), (np.abs(found.maps - ref) / scale).max()


def test_torchscript_is_refused(make_server):
    scripted = torch.jit.script(build_demo_model(0))
    srv = make_server(demo_loaded(scripted, "torchscript", hooks_supported=False))
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        with pytest.raises(layertap.FailedPrecondition, match="TorchScript"):
            client.explain(batch(1), "layer4")
        with pytest.raises(layertap.FailedPrecondition, match="TorchScript"):
            client.explain(batch(1), "layer4", 3)  # a target does not make hooks possible


def test_bad_layer_is_not_found_naming_the_field(client):
    with pytest.raises(layertap.LayerNotFound) as err:
        client.explain(batch(1), "layer5")
    assert err.value.field == "layer" and err.value.code == "NOT_FOUND"
    assert "layer4" in err.value.suggestions


@pytest.mark.parametrize("target,field", [([1, 2], "targets"), (10, "targets[0]"), ([0, -1, 2], "targets[1]")])
def test_bad_targets_name_the_field(client, target, field):
    with pytest.raises(layertap.InvalidArgument) as err:
        client.explain(batch(3), "layer4", target)
    assert err.value.field == field


def test_layer_that_runs_twice_is_refused(client):
    with pytest.raises(layertap.FailedPrecondition) as err:
        client.explain(batch(2), "layer1.1.relu")  # called twice in its block
    assert err.value.field == "layer" and "2 times" in str(err.value)


class DenseHead(nn.Module):
    """Outputs a (N, 2, 8, 8) map, not (N, classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True))
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.avg_pool2d(self.head(self.body(x)), 4)


def test_output_not_classes_needs_a_flat_target(make_server):
    torch.manual_seed(0)
    model = DenseHead().eval()
    srv = make_server(LoadedModel(model, "dense", "factory", [InputSpec("input", torch.float32, (-1, 3, 32, 32))]))
    x = batch(2, seed=8)
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        with pytest.raises(layertap.FailedPrecondition) as err:
            client.explain(x, "body")
        assert err.value.field == "targets" and "not (N, classes)" in str(err.value)
        flat = int(np.ravel_multi_index((1, 3, 5), (2, 8, 8)))
        found = client.explain(x, "body", flat)
    assert found.classes == [flat, flat]
    # "body" ends in an in-place ReLU: the map is taken from the block's output all the same.
    assert_cam_close(found.maps, captum_cam(model, "body", x, (1, 3, 5)))
    out = model(torch.from_numpy(x)).detach().double().numpy()
    np.testing.assert_allclose(found.scores, out[:, 1, 3, 5], rtol=1e-5)


def test_training_agent_refuses_explain():
    model = build_demo_model(0).train()
    agent = layertap.attach(model, torch.optim.SGD(model.parameters(), lr=0.01), metrics_port=None)
    try:
        with layertap.Client(agent.address) as client:
            with pytest.raises(layertap.FailedPrecondition, match="training agent"):
                client.explain(batch(1), "layer4")
            assert client.stats().passes == 0
    finally:
        agent.close()


def test_cli_writes_the_heatmap_over_the_input(demo_server, client, tmp_path, capsys):
    from PIL import Image

    from layertap.cli import main
    from layertap.cli.explain import overlay

    x = batch(2, seed=11)
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "cam.png"
    assert main(["explain", str(demo_server.port), "--input", str(tmp_path / "x.npy"), "--layer", "layer3",
                 "--target", "4", "-o", str(out)]) == 0
    found = client.explain(x, "layer3", 4, normalize=True, upsample=True)
    printed = capsys.readouterr().out.splitlines()
    for i in range(2):
        path = tmp_path / f"cam-{i}.png"
        assert printed[i].startswith(f"{path}: class 4 score ")
        img = np.asarray(Image.open(path).convert("RGB"))
        assert np.array_equal(img, overlay(x[i], found.maps[i]))
    assert main(["explain", str(demo_server.port), "--input", str(tmp_path / "x.npy"), "--layer", "nope",
                 "-o", str(out)]) == 1
    assert "unknown layer 'nope'" in capsys.readouterr().err


def test_normalize_a_layer_without_spatial_dims(client):
    """``fc`` gives one value per sample: normalizing it over that sample is a flat map, zeros."""
    x = batch(3, seed=12)
    plain = client.explain(x, "fc")
    assert plain.maps.shape == (3,) and plain.maps.max() > 0
    found = client.explain(x, "fc", normalize=True)
    ref = plain.maps.astype(np.float64).reshape(3, -1)
    span = ref.max(axis=1, keepdims=True) - ref.min(axis=1, keepdims=True)
    want = np.where(span > 0, (ref - ref.min(axis=1, keepdims=True)) / np.where(span > 0, span, 1), 0.0)
    assert found.maps.shape == (3,) and found.maps.dtype == np.float32
    np.testing.assert_array_equal(found.maps, want.reshape(3))
    assert found.classes == plain.classes


def test_upsample_without_spatial_dims_is_the_callers_argument(client):
    """``fc`` has no spatial dims to resize: INVALID_ARGUMENT naming ``upsample`` (the same request
    without it is answered), not FAILED_PRECONDITION, which says the server is in the wrong state."""
    x = batch(2, seed=13)
    with pytest.raises(layertap.InvalidArgument) as err:
        client.explain(x, "fc", upsample=True)
    assert (err.value.code, err.value.field) == ("INVALID_ARGUMENT", "upsample")
    assert "0 spatial dim" in str(err.value)
    assert client.explain(x, "fc").maps.shape == (2,)


class LazyCache(nn.Module):
    """Builds a per-channel scale on its first forward, as rotary and positional caches do."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, 5)
        self.cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cache is None:
            self.cache = torch.ones(4, 1, 1)  # made in the server's warm-up, under inference_mode
        return self.fc((self.conv(x) * self.cache).mean(dim=(2, 3)))


def test_model_caching_an_inference_tensor_is_a_precondition_not_the_callers_input(make_server):
    torch.manual_seed(0)
    srv = make_server(LoadedModel(LazyCache().eval(), "lazy", "factory",
                                  [InputSpec("x", torch.float32, (-1, 3, 8, 8))]))
    x = np.random.default_rng(0).random((2, 3, 8, 8), dtype=np.float32)
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        assert client.infer(x).shape == (2, 5)
        with pytest.raises(layertap.FailedPrecondition) as err:
            client.explain(x, "conv")
        assert err.value.reason == "INFERENCE_TENSOR_CACHED" and "inference_mode" in str(err.value)
        assert err.value.field is None
        assert client.stats().active_hooks == 0
