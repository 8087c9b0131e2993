"""Drift baselines end to end: the real client, a real server, real passes.

Passes are driven synchronously and the tap pipeline is flushed before each
read, so every count below is exact rather than "eventually".
"""

from __future__ import annotations

import copy
import json
import logging
import math
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from support.e2e import scrape, wait_for
from support.models import Perturbable, perturbable_loaded, pooled_loaded

import layertap
from layertap import InvalidArgument, LayerDrift, LayerNotFound
from layertap.server.drift.builder import BaselineBuilder
from layertap.server.drift.files import save_baseline
from layertap.v1 import telemetry_pb2, telemetry_pb2_grpc

pytestmark = pytest.mark.e2e

LAYERS = ["layer1", "layer2", "layer3", "layer4"]
SCORES = ("psi", "js", "wasserstein", "mean_shift")


class Driver:
    """Feeds N(shift, 1) batches through Infer and waits until their summaries are processed."""

    def __init__(self, srv, client: layertap.Client, batch: int = 256, seed: int = 0) -> None:  # type: ignore[no-untyped-def]
        self.srv, self.client, self.batch = srv, client, batch
        self.rng = np.random.default_rng(seed)

    def feed(self, passes: int, shift: float = 0.0) -> None:
        for _ in range(passes):
            self.client.infer((self.rng.standard_normal((self.batch, 16)) + shift).astype(np.float32))
        assert self.srv.state.taps.flush(10), "tap pipeline did not drain"


def by_layer(drift: list[LayerDrift]) -> dict[str, LayerDrift]:
    return {d.layer: d for d in drift}


def assert_under_thresholds(d: LayerDrift) -> None:
    for m in SCORES:
        score, limit = getattr(d, m), getattr(d.thresholds, m)
        assert math.isfinite(score) and score < limit, f"{d.layer} {m} = {score} >= {limit}"
    assert not d.drifted


# ------------------------------------------------------------------ (a) live drift


def test_baseline_collects_scores_small_then_flags_shifted_inputs(make_server) -> None:
    srv = make_server(perturbable_loaded(), drift_window=50)
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        drive = Driver(srv, client)
        # Twenty passes are too few to calibrate (test_drift_calibrated.py): a given threshold
        # makes the alarm fixed, today's rule on the four scores.
        info = client.set_baseline("layer*", passes=20, window=10, thresholds={"psi": 0.2})
        assert info.layers == LAYERS and info.tap.startswith("baseline-")
        assert [t.id for t in client.taps()] == [info.tap]

        drive.feed(5)
        collecting = by_layer(client.drift())
        assert set(collecting) == set(LAYERS)
        assert all(d.state == "collecting" and d.baseline_passes == 5 and d.window_passes == 0
                   for d in collecting.values()), collecting

        drive.feed(15)
        ready = by_layer(client.drift())
        assert all(d.state == "ready" and d.baseline_passes == 20 and d.window_passes == 0
                   for d in ready.values()), ready

        drive.feed(10)
        scored = by_layer(client.drift())
        for d in scored.values():
            assert d.tap == info.tap and d.point == "output" and d.calibration == "fixed"
            assert d.window_passes == 10  # the requested window, not the server's default of 50
            assert (d.thresholds.psi, d.thresholds.js, d.thresholds.wasserstein, d.thresholds.mean_shift) == (
                0.2, 0.1, 0.1, 1.0)
            assert_under_thresholds(d)
            assert d.psi < 0.05 and d.mean_shift < 0.2, d
            # Outputs are (batch, 16): per-channel means are tapped and scored.
            assert d.channel_drift_fraction == 0.0

        drive.feed(10, shift=3.0)  # N(3, 1) inputs: the whole window is shifted
        shifted = by_layer(client.drift())
        for d in shifted.values():
            assert d.state == "ready" and d.window_passes == 10
            assert d.drifted, d
        l1 = shifted["layer1"]
        assert all(getattr(l1, m) > getattr(l1.thresholds, m) for m in ("psi", "js", "wasserstein")), l1
        # Channels move both ways, so the layer-wide mean may barely move (about
        # 0.9 sigma here); the per-channel fraction is what catches that.
        assert l1.channel_drift_fraction is not None and l1.channel_drift_fraction > 0.5, l1

        drive.feed(10)  # back in distribution: the window slides past the shift
        assert not any(d.drifted for d in client.drift())
        assert client.drift("layer3")[0].layer == "layer3" and len(client.drift("layer3")) == 1


def test_channel_fraction_only_where_channels_exist(make_server) -> None:
    srv = make_server(pooled_loaded())
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        drive = Driver(srv, client)
        client.set_baseline("lin", passes=10, window=5, thresholds={"psi": 0.2})
        client.set_baseline("total", passes=10, window=5, thresholds={"psi": 0.2})  # (batch,) outputs: no channel dim
        drive.feed(10)
        drive.feed(5, shift=3.0)
        d = by_layer(client.drift())
        assert d["lin"].drifted and d["total"].drifted
        assert d["lin"].channel_drift_fraction is not None and d["lin"].channel_drift_fraction > 0
        assert d["total"].channel_drift_fraction is None


# ------------------------------------------------------------------ (b) restart


def test_baseline_survives_restart_and_scoring_resumes(make_server, tmp_path: Path) -> None:
    bdir = tmp_path / "baselines"
    thresholds = {"psi": 0.3, "js": 0.15, "wasserstein": 0.2, "mean_shift": 1.5}
    first = make_server(perturbable_loaded(), baseline_dir=str(bdir), drift_window=50)
    with layertap.Client(f"127.0.0.1:{first.port}") as client:
        info = client.set_baseline("layer*", passes=20, window=8, thresholds=thresholds)
        Driver(first, client).feed(20)
        before = by_layer(client.drift())
        assert all(d.state == "ready" for d in before.values())
    files = sorted(bdir.glob("*.json"))
    assert len(files) == 4
    saved = {p.name: p.read_bytes() for p in files}
    assert {json.loads(b)["layer"] for b in saved.values()} == set(LAYERS)
    first.stop(0)

    second = make_server(perturbable_loaded(), baseline_dir=str(bdir), drift_window=50)
    model = second.state.host.module
    assert isinstance(model, Perturbable)
    with layertap.Client(f"127.0.0.1:{second.port}") as client:
        after = by_layer(client.drift())
        assert set(after) == set(LAYERS)
        for layer, d in after.items():
            assert d.state == "ready" and d.tap == info.tap  # no pass has run on this server yet
            assert d.baseline_passes == 20 and d.window_passes == 0
            assert d.thresholds == before[layer].thresholds
            assert d.thresholds.psi == 0.3 and d.thresholds.mean_shift == 1.5
        assert [t.id for t in client.taps()] == [info.tap]  # its durable tap is back

        drive = Driver(second, client, seed=7)
        drive.feed(8)
        resumed = by_layer(client.drift())
        for d in resumed.values():
            assert d.baseline_passes == 20  # no new baseline passes were taken
            assert d.window_passes == 8  # the window saved with the baseline, not the server's 50
            assert_under_thresholds(d)

        with second.state.host.pass_lock():
            model.perturb_layer3()
        drive.feed(8)
        drifted = by_layer(client.drift())
        assert drifted["layer3"].drifted and drifted["layer4"].drifted
        assert_under_thresholds(drifted["layer1"])
        # Reloading and scoring never rewrote the saved baselines.
        assert {p.name: p.read_bytes() for p in sorted(bdir.glob("*.json"))} == saved

        # A reloaded baseline is still this server's to replace.
        again = client.set_baseline("layer*", passes=5, window=5)
        assert again.tap == info.tap
        assert all(d.state == "collecting" and d.baseline_passes == 0 for d in client.drift())


# ------------------------------------------------------------------ (c) bad files


def _baseline_file(bdir: Path, tap: str, layer: str, channels: int, seed: int) -> Path:
    """A real baseline, frozen by the server's own builder from N(0, 1) data."""
    rng = np.random.default_rng(seed)
    b = BaselineBuilder(tap, layer, passes=3, seed=seed)
    for _ in range(3):
        x = rng.standard_normal((64, channels))
        b.feed(x.ravel(), x.size, float(x.mean()), float(x.std()), float(x.min()), float(x.max()),
               channel_mean=x.mean(axis=0), channel_std=x.std(axis=0))
    return save_baseline(bdir, b.freeze(window=5))


def test_corrupt_and_mismatched_baselines_are_refused_cleanly(make_server, tmp_path: Path, caplog) -> None:
    bdir = tmp_path / "baselines"
    good = _baseline_file(bdir, "baseline-good", "layer2", channels=16, seed=1)
    unknown = _baseline_file(bdir, "baseline-old", "encoder.block9", channels=16, seed=2)
    wrong_channels = _baseline_file(bdir, "baseline-narrow", "layer1", channels=3, seed=3)
    corrupt = bdir / "baseline-torn.json"
    corrupt.write_text('{"schema": "layertap.baseline", "version": 1, "tap": ', encoding="utf-8")
    not_a_baseline = bdir / "notes.json"
    not_a_baseline.write_text(json.dumps({"hello": "world"}), encoding="utf-8")
    # Sanity: the "wrong" files are well-formed baselines but for another model.
    assert json.loads(wrong_channels.read_text())["layer"] == "layer1"

    with caplog.at_level(logging.ERROR, logger="layertap.server"):
        srv = make_server(perturbable_loaded(), metrics_port=0, baseline_dir=str(bdir))
    refused = [r.getMessage() for r in caplog.records if "baseline refused" in r.getMessage()]
    assert len(refused) == 4, refused

    def line_for(path: Path) -> str:
        hits = [m for m in refused if str(path) in m]
        assert len(hits) == 1, (path, refused)
        return hits[0]

    assert "corrupt JSON" in line_for(corrupt)
    assert "unknown layer 'encoder.block9'" in line_for(unknown)
    assert "layer 'layer1' has 16 channels but the baseline 3" in line_for(wrong_channels)
    assert "schema" in line_for(not_a_baseline)
    assert not any(str(good) in m for m in refused)

    metrics = scrape(srv.metrics_port)
    assert metrics["layertap_baseline_load_errors_total"] == 4.0

    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        # The server serves, and the one good baseline is live.
        client.infer(np.zeros((2, 16), np.float32))
        d = client.drift()
        assert [(x.tap, x.layer, x.state) for x in d] == [("baseline-good", "layer2", "ready")]
        assert [t.id for t in client.taps()] == ["baseline-good"]
    # Refused files are left in place for the operator to inspect.
    assert corrupt.exists() and unknown.exists() and wrong_channels.exists()


def test_baseline_files_with_a_bad_point_or_too_many_edges_are_skipped(make_server, tmp_path: Path, caplog) -> None:
    bdir = tmp_path / "baselines"
    good = _baseline_file(bdir, "baseline-good", "layer2", channels=16, seed=1)
    bad_point = _baseline_file(bdir, "baseline-point", "layer1", channels=16, seed=2)
    doc = json.loads(bad_point.read_text())
    doc["point"] = "sideways"
    bad_point.write_text(json.dumps(doc))
    many_edges = _baseline_file(bdir, "baseline-edges", "layer1", channels=16, seed=3)
    doc = json.loads(many_edges.read_text())
    doc["edges"] = [float(i) for i in range(1026)]
    doc["counts"] = [1] * 1027
    many_edges.write_text(json.dumps(doc))

    with caplog.at_level(logging.ERROR, logger="layertap.server"):
        srv = make_server(perturbable_loaded(), metrics_port=0, baseline_dir=str(bdir))  # starts: not fatal
    refused = [r.getMessage() for r in caplog.records if "baseline refused" in r.getMessage()]
    assert len(refused) == 2, refused
    assert any(str(bad_point) in m and "point 'sideways'" in m for m in refused), refused
    assert any(str(many_edges) in m and "1026 edges" in m for m in refused), refused
    assert scrape(srv.metrics_port)["layertap_baseline_load_errors_total"] == 2.0
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        assert [t.id for t in client.taps()] == ["baseline-good"]
    assert good.exists()


# v3 files whose null block is hostile but passes the schema checks (issue 26 review): ``null.passes`` or
# ``null.window`` a huge JSON integer (10**400: ``float(dof)`` raised OverflowError out of
# ``DriftMonitor.load()`` and took the whole server down at start), and ``null.features`` (with its mean/std)
# for fewer features than the layer has channels (loaded ``calibrated``, then ignored every live pass).


@pytest.fixture
def saved_doc(make_server, tmp_path: Path) -> tuple[str, dict]:
    """The name and document of a v3 baseline file of layer1, written by a real server."""
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


def _write_doc(tmp_path: Path, name: str, doc: dict, sub: str) -> str:
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
    srv = make_server(baseline_dir=_write_doc(tmp_path, name, bad, "bad"))  # raised OverflowError before the fix
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        assert all(d.calibration != "calibrated" for d in client.drift())


@pytest.mark.timeout(300)
def test_a_null_for_fewer_features_than_the_layer_is_not_silently_calibrated(make_server, saved_doc, tmp_path) -> None:
    name, doc = saved_doc
    bad = copy.deepcopy(doc)
    n = bad["null"]
    n.update(features=3, mean=n["mean"][:8], std=n["std"][:8])  # 2*3+2 components, layer1 has 16 channels
    srv = make_server(baseline_dir=_write_doc(tmp_path, name, bad, "bad"))
    rng = np.random.default_rng(1)
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        for _ in range(4):
            client.infer(rng.standard_normal((2, 3, 32, 32)).astype(np.float32))
        assert srv.state.taps.flush(20)
        for d in client.drift():
            if d.calibration == "calibrated":
                assert d.scored_passes > 0, (
                    f"calibrated but blind: scored {d.scored_passes}, ignored {d.ignored_passes}, windows {d.windows}")


# ------------------------------------------------------------------ (d) bad requests


def test_bad_set_baseline_requests(make_server) -> None:
    srv = make_server(perturbable_loaded())
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        with pytest.raises(LayerNotFound) as nf:
            client.set_baseline("layer5", passes=5)
        assert "layer5" in str(nf.value) and "layer1" in str(nf.value)  # close names suggested
        with pytest.raises(LayerNotFound, match="matches no layer"):
            client.set_baseline("head*", passes=5)
        with pytest.raises(InvalidArgument, match=r"selector: bad regex"):
            client.set_baseline("re:layer(", passes=5)
        with pytest.raises(InvalidArgument, match=r"thresholds\.psi: must be a finite value >= 0"):
            client.set_baseline("layer*", passes=5, thresholds={"psi": -0.5})
        with pytest.raises(InvalidArgument, match=r"thresholds\.js"):
            client.set_baseline("layer*", passes=5, thresholds={"js": float("nan")})
        with pytest.raises(InvalidArgument, match=r"^passes: at most 100000"):
            client.set_baseline("layer*", passes=100_001)
        with pytest.raises(InvalidArgument, match=r"^window: at most 100000"):
            client.set_baseline("layer*", passes=5, window=100_001)
        # Checked before the request is sent.
        with pytest.raises(InvalidArgument, match="passes and window must be >= 1"):
            client.set_baseline("layer*", passes=0)
        with pytest.raises(InvalidArgument, match="unknown drift threshold"):
            client.set_baseline("layer*", thresholds={"kl": 0.1})
        # A refused request leaves nothing behind.
        assert client.taps() == [] and client.drift() == []

    # The server checks the point itself (the client cannot send a bad one).
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
        stub = telemetry_pb2_grpc.TelemetryServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.SetBaseline(telemetry_pb2.SetBaselineRequest(selector="layer1", point=99), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("point:")


class _Tall(torch.nn.Module):
    """60 blocks with long names: a reloaded baseline's own selector passes 1 KiB."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict({"attention_projection": torch.nn.Linear(4, 4)}) for _ in range(60))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b["attention_projection"](x)
        return x


def test_a_baseline_over_many_long_layer_names_survives_a_restart(make_server, tmp_path: Path) -> None:
    from layertap.server.host.sources import InputSpec, LoadedModel

    torch.manual_seed(0)
    loaded = LoadedModel(_Tall(), "tall", "factory", [InputSpec("x", torch.float32, (-1, 4))])
    bdir = str(tmp_path / "baselines")
    srv = make_server(loaded, baseline_dir=bdir)
    rng = np.random.default_rng(0)
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        info = client.set_baseline("**.attention_projection", passes=3, window=2)
        assert len(info.layers) == 60
        for _ in range(6):
            client.infer(rng.standard_normal((8, 4)).astype(np.float32))
        assert wait_for(lambda: all(d.state == "ready" for d in client.drift()), timeout=30)
    srv.state.taps.close()
    srv.stop(0)
    again = make_server(loaded, baseline_dir=bdir)
    with layertap.Client(f"127.0.0.1:{again.port}") as client:
        assert len(client.drift()) == 60
        assert [t.id for t in client.taps()] == [info.tap]


def test_a_named_baseline_takes_and_keeps_its_name(client) -> None:
    """docs/operations.md: a baseline tap may be named, and set again under that name to reset it."""
    info = client.set_baseline("layer1", passes=3, window=2, name="nightly")
    assert info.tap == "nightly" and info.layers == ["layer1"]
    again = client.set_baseline("layer1", passes=3, window=2, name="nightly")
    assert again.tap == "nightly" and [t.id for t in client.taps()].count("nightly") == 1
    client.delete_tap("nightly")
