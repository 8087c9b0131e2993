"""Derived baselines kept (issue 45): an entropy baseline survives a restart and spreads to a new replica.

The tiny random-init Llama of tests/e2e/test_entropy_drift.py, served by ``hf:DIR`` so that a second
server loads the same weights. Given thresholds make the alarms fixed: ten passes cannot calibrate.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

if importlib.util.find_spec("transformers") is None and not os.environ.get("CI"):
    pytest.skip("transformers is not installed (pip install 'layertap[hf]')", allow_module_level=True)

from support import hf_models
from support.e2e import scrape, wait_for

from layertap import Client, Fleet, LayerDrift
from layertap.server.drift.builder import BaselineBuilder
from layertap.server.drift.files import save_baseline
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.e2e

VOCAB = hf_models.TINY["llama"][2]["vocab_size"]
SCORES = ("psi", "js", "wasserstein", "mean_shift")
THRESHOLDS = {"psi": 0.2}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _model = hf_models.save("llama", tmp_path_factory.mktemp("hf"))
    return path


def feed(server, client: Client, rng: np.random.Generator, passes: int) -> None:  # type: ignore[no-untyped-def]
    for _ in range(passes):
        client.infer(input_ids=rng.integers(1, VOCAB, (16, 32)))
    assert server.state.taps.flush(10), "tap pipeline did not drain"


def test_an_entropy_baseline_survives_a_restart_and_still_alarms(make_server, llama: Path, tmp_path: Path) -> None:
    bdir = tmp_path / "baselines"
    first = make_server(model=f"hf:{llama}", baseline_dir=str(bdir))
    rng = np.random.default_rng(5)
    with Client(f"127.0.0.1:{first.port}") as client:
        info = client.set_baseline("lm_head", passes=10, window=5, derive="entropy", thresholds=THRESHOLDS)
        feed(first, client, rng, 10)
        [before] = client.drift()
        assert before.state == "ready" and before.derive == "entropy"
    [path] = bdir.glob("*.json")  # written, no longer kept in memory only
    saved = path.read_bytes()
    doc = json.loads(saved)
    assert (doc["version"], doc["derive"], doc["tap"], doc["channel_mean"]) == (4, "entropy", info.tap, None)
    first.state.taps.close()
    first.stop(0)

    second = make_server(model=f"hf:{llama}", baseline_dir=str(bdir))
    with Client(f"127.0.0.1:{second.port}") as client:
        def entry() -> LayerDrift:
            [d] = client.drift()
            return d

        back = entry()
        assert (back.tap, back.derive, back.state, back.calibration) == (info.tap, "entropy", "ready", "fixed")
        assert back.baseline_passes == 10 and back.window_passes == 0
        [tap] = client.taps()
        assert (tap.id, tap.spec.derive) == (info.tap, "entropy")
        feed(second, client, rng, 5)
        calm = entry()
        assert calm.window_passes == 5 and not calm.drifted, calm
        for m in SCORES:
            assert math.isfinite(getattr(calm, m)) and getattr(calm, m) < getattr(calm.thresholds, m), calm

        head = second.state.host.modules["lm_head"]
        with second.state.host.pass_lock(), torch.no_grad():
            head.weight.mul_(0.05)  # flatter softmax: every token's entropy goes up
        feed(second, client, rng, 5)
        after = entry()
    assert after.drifted and after.derive == "entropy", after
    assert after.mean_shift > after.thresholds.mean_shift and after.wasserstein > after.thresholds.wasserstein, after
    assert path.read_bytes() == saved  # reloading and scoring never rewrote it


def test_a_fleet_entropy_baseline_spreads_to_a_new_replica(make_server, llama: Path) -> None:
    a = make_server(model=f"hf:{llama}")
    stop = threading.Event()

    def traffic() -> None:
        rng = np.random.default_rng(1)
        with Client(f"127.0.0.1:{a.port}") as client:
            while not stop.is_set():
                client.infer(input_ids=rng.integers(1, VOCAB, (2, 8)))

    feeder = threading.Thread(target=traffic, daemon=True)
    feeder.start()
    try:
        with Fleet([f"127.0.0.1:{a.port}"], timeout=10) as fleet:
            installed = fleet.set_baseline("lm_head", passes=4, window=2, derive="entropy", thresholds=THRESHOLDS,
                                           wait=60)
    finally:
        stop.set()
        feeder.join(10)
    assert installed.ok and len(installed) == 1
    [tap] = {i.value.tap for i in installed}
    assert tap.endswith("-entropy")

    b = make_server(model=f"hf:{llama}")  # scaled up: it has no baseline
    with Fleet([f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"], timeout=10) as fleet:
        spread = fleet.spread_baseline("lm_head", window=2, derive="entropy", thresholds=THRESHOLDS)
        assert spread.ok and [(i.value.tap, i.value.layers) for i in spread] == [(tap, ["lm_head"])]
    with Client(f"127.0.0.1:{a.port}") as src, Client(f"127.0.0.1:{b.port}") as new:
        [want], [got] = src.drift(), new.drift()
        assert (got.tap, got.derive, got.state) == (tap, "entropy", "ready")
        assert got.baseline_passes == want.baseline_passes
        [spec] = [t.spec for t in new.taps()]
        assert spec.derive == "entropy"
        rng = np.random.default_rng(2)
        feed(b, new, rng, 2)
        assert wait_for(lambda: new.drift()[0].window_passes == 2)


def test_a_bad_v4_file_is_skipped_and_counted_and_the_server_starts(make_server, llama: Path, tmp_path: Path) -> None:
    bdir = tmp_path / "baselines"
    rng = np.random.default_rng(0)
    builder = BaselineBuilder("baseline-good-entropy", "lm_head", passes=3, seed=0)
    for _ in range(3):
        x = rng.gamma(20.0, 0.25, size=64)  # entropies of a 64-token pass
        builder.feed(x, x.size, float(x.mean()), float(x.std()), float(x.min()), float(x.max()))
    good = save_baseline(bdir, builder.freeze(window=2, derive=pb.DERIVE_ENTROPY))
    doc = json.loads(good.read_text())
    bad = {"missing.json": {k: v for k, v in doc.items() if k != "derive"},
           "unknown.json": {**doc, "tap": "baseline-x", "derive": "confidence"}}
    for name, content in bad.items():
        (bdir / name).write_text(json.dumps(content))

    srv = make_server(model=f"hf:{llama}", baseline_dir=str(bdir), metrics_port=0)  # starts: never fatal
    assert scrape(srv.metrics_port)["layertap_baseline_load_errors_total"] == 2.0
    with Client(f"127.0.0.1:{srv.port}") as client:
        assert [(d.tap, d.derive, d.state) for d in client.drift()] == [("baseline-good-entropy", "entropy", "ready")]
        assert client.infer(input_ids=rng.integers(1, VOCAB, (2, 8)))
    assert all((bdir / name).exists() for name in bad)  # left for the operator to inspect
