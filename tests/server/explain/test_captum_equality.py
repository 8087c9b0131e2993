"""Every method's result equals Captum's public ``attribute`` run here, on the same weights and arguments.

The server drives Captum's step loop itself, one internal batch per pass
(``server/explain/library.py``); run with the same ``internal_batch_size``,
Captum's own loop must give the same numbers, and the convergence delta the
same value.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from support.e2e import batch

from layertap.server.explain.explainer import explain
from layertap.server.explain.options import ExplainOptions, Explanation
from layertap.server.explain.passes import ExplainPasses
from layertap.server.host.demo_model import DEMO_INPUT_SHAPE, build_demo_model
from layertap.server.host.model_host import ModelHost
from layertap.server.host.sources import InputSpec, LoadedModel

pytestmark = pytest.mark.unit

captum_attr = pytest.importorskip("captum.attr")


@pytest.fixture
def host() -> Iterator[ModelHost]:
    h = ModelHost(LoadedModel(build_demo_model(0), "demo", "factory",
                              [InputSpec("input", torch.float32, DEMO_INPUT_SHAPE)]))
    yield h
    h.model_thread.close()


def run(host: ModelHost, x: np.ndarray, **options: object) -> tuple[Explanation, ExplainPasses]:
    passes = ExplainPasses(host)
    found = explain(host, host.validate_inputs([torch.from_numpy(x)]), ExplainOptions(**options), passes)  # type: ignore[arg-type]
    return found, passes


def noise(shape: tuple[int, ...], std: float, seed: int) -> torch.Tensor:
    """The noise baseline as the proto defines it: std * torch.randn from a CPU generator seeded with seed."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * std


@pytest.mark.parametrize("baseline", ["zeros", "given", "noise"])
@pytest.mark.parametrize("rows", [64, 10])
def test_integrated_gradients_equal_captums(host: ModelHost, baseline: str, rows: int) -> None:
    x = batch(3, seed=41)
    given = torch.from_numpy(batch(1, seed=42)) * 0.5
    base = {"zeros": torch.zeros(3, 3, 32, 32), "given": given.expand(3, -1, -1, -1),
            "noise": noise((3, 3, 32, 32), 0.3, 7)}[baseline]
    found, passes = run(host, x, method="integrated_gradients", n_steps=24, baseline=baseline,
                        baseline_tensor=given if baseline == "given" else None, noise_std=0.3, seed=7, batch_rows=rows)
    model = build_demo_model(0).eval()
    ig = captum_attr.IntegratedGradients(model)
    want, delta = ig.attribute(torch.from_numpy(x), baselines=base, target=found.targets.tolist(), n_steps=24,
                               internal_batch_size=rows, return_convergence_delta=True)
    torch.testing.assert_close(found.attributions, want.detach(), rtol=1e-5, atol=1e-7)
    assert found.deltas is not None
    torch.testing.assert_close(found.deltas, delta.double(), rtol=1e-4, atol=1e-5)
    steps_per_batch = max(1, rows // 3)
    assert passes.batches == found.batches == 1 + -(-24 // steps_per_batch) + 1  # targets, batches, deltas
    assert found.n_steps == 24 and found.attributions.dtype == torch.float32


def test_more_samples_than_rows_go_in_groups(host: ModelHost) -> None:
    """Five samples, at most four rows a pass: a group of four (one step a pass) and a group of one."""
    x = batch(5, seed=43)
    found, passes = run(host, x, method="integrated_gradients", n_steps=6, batch_rows=4)
    model = build_demo_model(0).eval()
    ig = captum_attr.IntegratedGradients(model)
    targets = found.targets.tolist()
    parts = [ig.attribute(torch.from_numpy(x[a:b]), target=targets[a:b], n_steps=6, internal_batch_size=4,
                          return_convergence_delta=True) for a, b in ((0, 4), (4, 5))]
    torch.testing.assert_close(found.attributions, torch.cat([p[0] for p in parts]).detach(), rtol=1e-5, atol=1e-7)
    assert passes.batches == 1 + (6 + 1) + (2 + 1)  # targets; 6 steps of 4 rows + deltas; 6 steps of 1 row by 4 + deltas


def test_layer_integrated_gradients_equal_captums(host: ModelHost) -> None:
    x = batch(2, seed=44)
    found, _ = run(host, x, method="layer_integrated_gradients", layer="layer3", n_steps=16, batch_rows=8)
    model = build_demo_model(0).eval()
    lig = captum_attr.LayerIntegratedGradients(model, model.layer3)
    want, delta = lig.attribute(torch.from_numpy(x), target=found.targets.tolist(), n_steps=16,
                                internal_batch_size=8, return_convergence_delta=True)
    assert found.layer == "layer3" and found.attributions.shape == want.shape == (2, 64, 4, 4)
    torch.testing.assert_close(found.attributions, want.detach(), rtol=1e-5, atol=1e-7)
    assert found.deltas is not None
    torch.testing.assert_close(found.deltas, delta.double(), rtol=1e-4, atol=1e-5)


def test_saliency_equals_captums(host: ModelHost) -> None:
    x = batch(3, seed=45)
    found, passes = run(host, x, method="saliency", targets=(2, 4, 6), batch_rows=2)
    model = build_demo_model(0).eval()
    sal = captum_attr.Saliency(model)
    # Two samples a pass, as the server grouped them (a convolution's sums depend on its batch).
    want = torch.cat([sal.attribute(torch.from_numpy(x[a:b]).requires_grad_(), target=[2, 4, 6][a:b])
                      for a, b in ((0, 2), (2, 3))])
    torch.testing.assert_close(found.attributions, want.detach(), rtol=1e-5, atol=1e-7)
    assert found.deltas is None and found.n_steps == 0 and passes.batches == 1 + 2
    assert found.targets.tolist() == [2, 4, 6]


def test_grad_cam_equals_captums(host: ModelHost) -> None:
    x = batch(2, seed=46)
    found, _ = run(host, x, method="grad_cam", layer="layer4")
    model = build_demo_model(0).eval()
    want = captum_attr.LayerGradCam(model, model.layer4).attribute(torch.from_numpy(x), target=found.targets.tolist(),
                                                                   relu_attributions=True)
    torch.testing.assert_close(found.attributions, want.detach()[:, 0], rtol=1e-5, atol=1e-7)
