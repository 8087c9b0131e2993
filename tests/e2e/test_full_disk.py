"""A full disk: a baseline is never reported ready without its file, and failed writes leave nothing behind.

Each test runs twice: with an injected ENOSPC on the rename into place (runs
everywhere), and on a real tmpfs of a few MiB filled to its last byte (needs
``mount``, so root in a container that allows it; skipped with the reason
otherwise). Real servers on port 0, the real client.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from support.e2e import batch, scrape, wait_for
from support.models import perturbable_loaded

import layertap
from layertap import Incidents
from layertap.v1 import telemetry_pb2, telemetry_pb2_grpc

pytestmark = pytest.mark.e2e

LAYERS = ["layer1", "layer2", "layer3", "layer4"]
ENOSPC_TEXT = os.strerror(errno.ENOSPC)  # "No space left on device"


class Disk:
    """A directory whose filesystem can be made full and freed again."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def fill(self) -> None:
        raise NotImplementedError

    def free(self) -> None:
        raise NotImplementedError


class InjectedDisk(Disk):
    """``os.replace`` into ``root`` fails with ENOSPC while full: the temporary file was written, the rename was not."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__(root)
        self.full = False
        real = os.replace

        def replace(src, dst, **kw):  # type: ignore[no-untyped-def]
            if self.full and Path(dst).resolve().is_relative_to(self.root):
                raise OSError(errno.ENOSPC, ENOSPC_TEXT, str(dst))
            return real(src, dst, **kw)

        monkeypatch.setattr(os, "replace", replace)

    def fill(self) -> None:
        self.full = True

    def free(self) -> None:
        self.full = False


class TmpfsDisk(Disk):
    """A real tmpfs, filled by one file up to its last byte."""

    def fill(self) -> None:
        with open(self.root / "filler", "wb", buffering=0) as f:
            for chunk in (1 << 20, 1 << 16, 4096, 1):
                data = b"\0" * chunk
                try:
                    while True:
                        f.write(data)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc

    def free(self) -> None:
        (self.root / "filler").unlink()


@pytest.fixture(params=["injected", "tmpfs"])
def disk(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Disk]:
    """A fillable disk; ask for it before ``make_server`` so the servers stop before it is unmounted."""
    root = (tmp_path / "disk").resolve()
    root.mkdir()
    if request.param == "injected":
        yield InjectedDisk(root, monkeypatch)
        return
    try:
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(root)], capture_output=True, text=True)
        why = res.stderr.strip() or f"exit {res.returncode}"
    except OSError as exc:  # no mount(8) at all
        res, why = None, str(exc)
    if res is None or res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({why}): needs root and a container that allows mount; "
                    "the injected-ENOSPC variant covers the same code paths")
    try:
        yield TmpfsDisk(root)
    finally:
        if subprocess.run(["umount", str(root)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(root)], check=True)


def feed(srv, client: layertap.Client, passes: int, seed: int = 0) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    for _ in range(passes):
        client.infer(rng.standard_normal((64, 16)).astype(np.float32))
    assert srv.state.taps.flush(10), "tap pipeline did not drain"


def test_a_baseline_on_a_full_disk_is_unsaved_until_a_retry_writes_it(disk: Disk, make_server) -> None:  # type: ignore[no-untyped-def]
    bdir = disk.root / "baselines"
    bdir.mkdir()
    disk.fill()
    srv = make_server(perturbable_loaded(), metrics_port=0, baseline_dir=str(bdir))
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        info = client.set_baseline("layer*", passes=5, window=5)
        feed(srv, client, 5)
        drift = client.drift()
        assert [d.layer for d in drift] == LAYERS
        for d in drift:
            assert d.state == "unsaved" and ENOSPC_TEXT in d.save_error and str(bdir) in d.save_error, d
        assert sorted(p.name for p in bdir.iterdir()) == []  # no baseline file and no temporary file
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            exported = telemetry_pb2_grpc.TelemetryServiceStub(ch).ExportBaseline(
                telemetry_pb2.ExportBaselineRequest(tap=info.tap))
        assert {layer.state for layer in exported.layers} == {telemetry_pb2.BASELINE_STATE_UNSAVED}
        metrics = scrape(srv.metrics_port)
        assert metrics["layertap_baselines_unsaved"] == 4
        failed = metrics["layertap_baseline_save_errors_total"]
        assert failed >= 4

        # Unsaved, it still scores drift.
        feed(srv, client, 5, seed=1)
        assert all(d.window_passes == 5 and np.isfinite(d.psi) for d in client.drift())

        # Retried in the background while the disk stays full, with no traffic.
        assert wait_for(lambda: scrape(srv.metrics_port)["layertap_baseline_save_errors_total"] > failed, 10)
        assert {d.state for d in client.drift()} == {"unsaved"}
        assert sorted(p.name for p in bdir.iterdir()) == []

        disk.free()
        assert wait_for(lambda: {d.state for d in client.drift()} == {"ready"}, 20), client.drift()
        assert all(d.save_error == "" for d in client.drift())
        assert len(list(bdir.glob("baseline-*.json"))) == 4 and not list(bdir.glob(".tmp-*"))
        assert scrape(srv.metrics_port)["layertap_baselines_unsaved"] == 0

    again = make_server(perturbable_loaded(), baseline_dir=str(bdir))
    with layertap.Client(f"127.0.0.1:{again.port}") as client:
        reloaded = client.drift()
    assert [(d.layer, d.state, d.baseline_passes) for d in reloaded] == [(layer, "ready", 5) for layer in LAYERS]


def test_a_baseline_still_unsaved_at_shutdown_is_logged_and_counted_as_lost(disk: Disk, make_server,  # type: ignore[no-untyped-def]
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    """A stop (SIGTERM) while the disk is full: one last write, then an error line and a count, not silence."""
    bdir = disk.root / "baselines"
    bdir.mkdir()
    disk.fill()
    srv = make_server(perturbable_loaded(), metrics_port=0, baseline_dir=str(bdir))
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        client.set_baseline("layer*", passes=5, window=5)
        feed(srv, client, 5)
        assert {d.state for d in client.drift()} == {"unsaved"}
    with caplog.at_level(logging.ERROR, logger="layertap.server"):
        srv.stop(0)
    lost = [r.getMessage() for r in caplog.records if "are lost" in r.getMessage()]
    assert len(lost) == 1 and "4 frozen baseline layer(s)" in lost[0] and ENOSPC_TEXT in lost[0], lost
    assert srv.state.registry.get_sample_value("layertap_baselines_lost_total", {"model": "perturbable"}) == 4


def test_a_baseline_the_last_write_saves_is_not_lost(disk: Disk, make_server,  # type: ignore[no-untyped-def]
                                                     caplog: pytest.LogCaptureFixture) -> None:
    bdir = disk.root / "baselines"
    bdir.mkdir()
    disk.fill()
    srv = make_server(perturbable_loaded(), baseline_dir=str(bdir))
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        client.set_baseline("layer*", passes=5, window=5)
        feed(srv, client, 5)
        assert {d.state for d in client.drift()} == {"unsaved"}
    disk.free()  # the disk has room again, but the next retry is seconds away: the stop writes them
    with caplog.at_level(logging.ERROR, logger="layertap.server"):
        srv.stop(0)
    assert not [r for r in caplog.records if "are lost" in r.getMessage()]
    assert len(list(bdir.glob("baseline-*.json"))) == 4


def _guard_taps(path: Path) -> str:
    path.write_text(json.dumps({"taps": [{
        "name": "guard", "selector": "layer[12]", "reducers": ["moments", "minmax", "nonfinite"],
        "triggers": {"nonfinite": True, "min_interval_seconds": 1},
    }]}))
    return str(path)


def _nan_pass(srv, client: layertap.Client) -> None:  # type: ignore[no-untyped-def]
    bad = batch(2, seed=3)
    bad[0, 0, 0, 0] = np.nan
    client.infer(bad)
    assert srv.state.taps.flush(10)
    assert srv.state.recorder is not None and srv.state.recorder.wait_idle(30)


def test_failed_incident_writes_leave_no_temporary_files(disk: Disk, make_server, tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    idir = disk.root / "incidents"
    srv = make_server(incident_dir=str(idir), record_inputs=16, tap_config=_guard_taps(tmp_path / "taps.json"))
    disk.fill()
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        for i in range(3):
            if i:
                time.sleep(1.1)  # past the trigger's min_interval_seconds
            _nan_pass(srv, client)
        failures = [r for r in caplog.records if r.levelno >= logging.ERROR and "recording incidents" in r.getMessage()]
        # One line per failure, the traceback with the first only (a full disk fails about once a second).
        assert len(failures) == 3, caplog.text
        assert [r.exc_info is not None for r in failures] == [True, False, False], caplog.text
        assert ENOSPC_TEXT in str(failures[0].exc_info[1]) and all(ENOSPC_TEXT in r.getMessage() for r in failures[1:])
        assert sorted(p.name for p in idir.iterdir()) == []  # no incident and no temporary file
        assert Incidents(client).list() == []

        disk.free()
        time.sleep(1.1)
        _nan_pass(srv, client)
        (info,) = Incidents(client).list()
        assert sorted(p.name for p in idir.iterdir()) == [f"{info.id}.incident"]
