"""Grad-CAM from Captum's LayerGradCam gives the maps the hand-written Grad-CAM gave.

The reference is the implementation that served Explain before issue 28,
kept unchanged in ``tests/support/legacy_gradcam.py``; both run on the same
model host, inputs and options, here in the test's process.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from support import legacy_gradcam
from support.e2e import batch
from torch import nn

from layertap.server.explain.explainer import explain
from layertap.server.explain.options import ExplainOptions
from layertap.server.explain.passes import ExplainPasses
from layertap.server.host.demo_model import DEMO_INPUT_SHAPE, build_demo_model
from layertap.server.host.model_host import ModelHost
from layertap.server.host.sources import InputSpec, LoadedModel

pytestmark = pytest.mark.unit

EXPLAIN_DIR = Path(__file__).resolve().parents[3] / "server" / "explain"


def hosted(model: nn.Module, shape: tuple[int, ...] = DEMO_INPUT_SHAPE) -> ModelHost:
    return ModelHost(LoadedModel(model, "m", "factory", [InputSpec("input", torch.float32, shape)]))


@pytest.fixture
def host() -> Iterator[ModelHost]:
    h = hosted(build_demo_model(0))
    yield h
    h.model_thread.close()


def old_and_new(host: ModelHost, x: np.ndarray, layer: str, targets: tuple[int, ...] = (), *, normalize: bool = False,
                upsample: bool = False, batch_rows: int = 64) -> tuple[legacy_gradcam.Explanation, torch.Tensor, ExplainPasses]:
    inputs = host.validate_inputs([torch.from_numpy(x)])
    old = host.on_model_thread(legacy_gradcam.grad_cam, host, inputs,
                               legacy_gradcam.GradCamOptions(layer, targets, normalize, upsample))
    passes = ExplainPasses(host)
    new = explain(host, inputs, ExplainOptions("grad_cam", layer, targets, normalize, upsample, batch_rows=batch_rows),
                  passes)
    assert torch.equal(new.targets, old.targets.cpu())
    torch.testing.assert_close(new.scores, old.scores, rtol=1e-6, atol=1e-6)
    return old, new.attributions, passes


def assert_same_maps(new: torch.Tensor, old: torch.Tensor, rtol: float = 1e-5) -> None:
    """Equal to ``rtol`` of each map's peak (channel sums in another order round differently near 0); a map
    that is all zeros (no positive evidence for the class) is held to the batch's peak, or equal if all are."""
    assert new.shape == old.shape and new.dtype == old.dtype == torch.float32 and not new.requires_grad
    peak = old.reshape(len(old), -1).abs().max(dim=1).values
    if peak.max() == 0:
        assert torch.equal(new, old)
        return
    scale = torch.where(peak > 0, peak, peak.max()).view(-1, *[1] * (old.dim() - 1))
    worst = float(((new - old).abs() / scale).max())
    assert worst <= rtol, worst


@pytest.mark.parametrize("layer", ["layer4", "layer3", "layer2.1", "layer1.0.conv2", "fc"])
@pytest.mark.parametrize("targets", [(), (7,), (0, 5, 9)])
def test_maps_equal_the_hand_written_ones(host: ModelHost, layer: str, targets: tuple[int, ...]) -> None:
    old, new, _ = old_and_new(host, batch(3, seed=31), layer, targets)
    assert_same_maps(new, old.maps)


@pytest.mark.parametrize("layer", ["layer4", "layer3", "layer1"])
@pytest.mark.parametrize("normalize,upsample", [(True, False), (False, True), (True, True)])
def test_upsampled_and_normalized_maps_equal_the_hand_written_ones(host: ModelHost, layer: str, normalize: bool,
                                                                   upsample: bool) -> None:
    old, new, _ = old_and_new(host, batch(2, seed=32), layer, normalize=normalize, upsample=upsample)
    assert new.shape == old.maps.shape == ((2, 32, 32) if upsample else new.shape)
    assert_same_maps(new, old.maps)


def test_a_layer_without_spatial_dims_normalizes_to_zeros_as_before(host: ModelHost) -> None:
    old, new, _ = old_and_new(host, batch(3, seed=33), "fc", normalize=True)
    assert torch.equal(new, old.maps) and new.shape == (3,)


def test_samples_in_groups_give_the_same_maps(host: ModelHost) -> None:
    """Five samples, two per pass: three passes after the first, and the maps of one pass."""
    old, new, passes = old_and_new(host, batch(5, seed=34), "layer3", upsample=True, batch_rows=2)
    assert passes.batches == 1 + 3
    assert_same_maps(new, old.maps)


class DenseHead(nn.Module):
    """A block ending in an in-place ReLU, and a (N, 2, 8, 8) output that needs flat targets."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True))
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.avg_pool2d(self.head(self.body(x)), 4)


def test_in_place_relu_and_flat_targets_as_before() -> None:
    torch.manual_seed(0)
    h = hosted(DenseHead().eval(), (-1, 3, 32, 32))
    try:
        flat = int(np.ravel_multi_index((1, 3, 5), (2, 8, 8)))
        old, new, _ = old_and_new(h, batch(2, seed=35), "body", (flat,), upsample=True)
        assert_same_maps(new, old.maps)
    finally:
        h.model_thread.close()


def test_server_explain_holds_no_hand_written_attribution_method() -> None:
    """The done-when: every gradient is Captum's. No module under server/explain differentiates by itself
    (``torch.autograd``, ``.backward``) or weights activations by gradients of its own."""
    for path in EXPLAIN_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not names & {"grad", "backward", "autograd"}, (path.name, names & {"grad", "backward", "autograd"})
    sources = {p.name: p.read_text() for p in EXPLAIN_DIR.glob("*.py")}
    assert "LayerGradCam" in sources["gradcam.py"] and "IntegratedGradients" in sources["library.py"]
