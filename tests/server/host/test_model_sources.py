"""Model sources: demo, torchvision, torch.export, TorchScript, factory + weights."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import layertap
from layertap.server.host.demo_model import build_demo_model
from layertap.server.host.sources import ModelLoadError, load_model

pytestmark = pytest.mark.e2e


def test_demo_is_deterministic_from_seed():
    a, b, c = build_demo_model(1), build_demo_model(1), build_demo_model(2)
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        assert torch.equal(a(x), b(x))
        assert not torch.equal(a(x), c(x))
    names = [n for n, _ in a.named_children()]
    assert names == ["conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool", "fc"]


def test_torchvision_by_name():
    pytest.importorskip("torchvision", reason="PyPI torchvision does not import beside the CI torch build")
    loaded = load_model("resnet18")
    assert loaded.source == "torchvision" and loaded.inputs[0].shape == (-1, 3, 224, 224)


def test_factory_with_weights(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    torch.save(model.state_dict(), tmp_path / "w.pt")
    loaded = load_model("torch.nn:Identity", input_shape="-1,4")
    assert loaded.source == "factory" and loaded.inputs[0].shape == (-1, 4)
    import support.models  # noqa: F401 - on sys.path via conftest

    with pytest.raises(ModelLoadError, match="does not fit"):
        load_model("support.models:identity", input_shape="-1,4", weights=str(tmp_path / "w.pt"))


def test_bad_sources_are_one_line_errors(tmp_path):
    for ref, match in [
        ("nosuch.module:f", "cannot import"),
        ("support.models:nothing", "no callable"),
        (str(tmp_path / "missing.pt2"), "no such file"),
        ("not_a_model_name", "not 'demo'"),
        ("torch.nn:Identity", "--input-shape"),
    ]:
        with pytest.raises(ModelLoadError, match=match) as info:
            load_model(ref)
        assert "\n" not in str(info.value)


def test_cli_bad_model_exits_with_one_line_and_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "layertap.cli", "serve", "--port", "0", "--no-metrics",
                           "--model", "nosuch.module:f"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "cannot import 'nosuch.module'" in errors[0]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(4, 8)
        self.act = torch.nn.ReLU()
        self.l2 = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.act(self.l1(x)))


def test_export_program_hooks_fire_through_unflatten(tmp_path, make_server):
    torch.manual_seed(0)
    net = Net().eval()
    x = torch.randn(3, 4)
    static = tmp_path / "static.pt2"
    torch.export.save(torch.export.export(net, (x,)), str(static))
    assert load_model(str(static)).inputs[0].shape == (3, 4)  # no dynamic batch: declared as exported
    program = torch.export.export(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    path = tmp_path / "net.pt2"
    torch.export.save(program, str(path))
    loaded = load_model(str(path))
    assert loaded.source == "export" and loaded.inputs[0].shape == (-1, 4)
    srv = make_server(loaded)
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        assert client.metadata().source == "export"
        got = client.capture("act", input=x.numpy())
    with torch.inference_mode():
        want = net.act(net.l1(x)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_torchscript_serves_infer_but_capture_is_failed_precondition(tmp_path, make_server):
    torch.manual_seed(0)
    net = Net().eval()
    path = tmp_path / "net.pt"
    torch.jit.save(torch.jit.script(net), str(path))
    loaded = load_model(str(path), input_shape="-1,4")
    srv = make_server(loaded)
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        meta = client.metadata()
        assert meta.source == "torchscript" and not meta.hooks_supported
        with torch.inference_mode():
            want = net(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(client.infer(x), want, rtol=1e-6)
        with pytest.raises(layertap.FailedPrecondition, match="TorchScript"):
            client.capture("l1", input=x)
