"""Review of issue 26: v3 baseline files whose null block is hostile but passes the schema checks.

* ``null.passes`` (or ``null.window``) a huge JSON integer (10**400): the schema takes any
  non-negative int; arming the alarm at start-up does ``float(dof)`` / ``rate / window`` and raises
  OverflowError out of ``DriftMonitor.load()``, so ``start_server`` fails: one bad file takes the whole
  server down instead of being refused and counted.
* ``null.features`` (and its mean/std) for fewer features than the layer has channels: loads as
  ``calibrated``, then every live pass has more components than the null and is ignored; the layer
  never scores a window and never alarms, while GetDrift says ``calibrated``. The schema checks
  ``channel_mean`` against the model's channel count but not the null's features.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

import layertap


@pytest.fixture
def saved_doc(make_server, tmp_path: Path) -> tuple[str, dict]:
    src = tmp_path / "src"
    src.mkdir()
    srv = make_server(baseline_dir=str(src))
    rng = np.random.default_rng(0)
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        client.set_baseline("layer1", passes=10, window=2)
        for _ in range(12):
            client.infer(rng.standard_normal((2, 3, 32, 32)).astype(np.float32))
        assert srv.state.taps.flush(20)
        assert client.drift()[0].calibration == "calibrated"
    (f,) = src.glob("*.json")
    doc = json.loads(f.read_text())
    assert doc["version"] == 3 and doc["null"]["features"] == 16
    return f.name, doc


def write(tmp_path: Path, name: str, doc: dict, sub: str) -> str:
    d = tmp_path / sub
    d.mkdir()
    (d / name).write_text(json.dumps(doc))
    return str(d)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("key", ["passes", "window"])
def test_a_huge_integer_in_the_null_is_refused_not_a_crash_at_start(make_server, saved_doc, tmp_path, key) -> None:
    name, doc = saved_doc
    bad = copy.deepcopy(doc)
    bad["null"][key] = 10**400
    srv = make_server(baseline_dir=write(tmp_path, name, bad, "bad"))  # OverflowError today
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        assert all(d.calibration != "calibrated" for d in client.drift())


@pytest.mark.timeout(300)
def test_a_null_for_fewer_features_than_the_layer_is_not_silently_calibrated(make_server, saved_doc, tmp_path) -> None:
    name, doc = saved_doc
    bad = copy.deepcopy(doc)
    n = bad["null"]
    n.update(features=3, mean=n["mean"][:8], std=n["std"][:8])  # 2*3+2 components, layer1 has 16 channels
    srv = make_server(baseline_dir=write(tmp_path, name, bad, "bad"))
    rng = np.random.default_rng(1)
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        for _ in range(4):
            client.infer(rng.standard_normal((2, 3, 32, 32)).astype(np.float32))
        assert srv.state.taps.flush(20)
        for d in client.drift():
            if d.calibration == "calibrated":
                assert d.scored_passes > 0, (
                    f"calibrated but blind: scored {d.scored_passes}, ignored {d.ignored_passes}, windows {d.windows}")
