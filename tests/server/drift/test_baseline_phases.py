"""Baselines per phase on disk and on the wire: schema v2 names the phase, v1 files load as forward.

A baseline frozen now carries its null statistics and is v3 (tests/server/drift/test_calibration.py);
one without them (reloaded from an older file) is still written as v1/v2, as before.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from layertap.server.drift import schema
from layertap.server.drift.baseline import Baseline
from layertap.server.drift.builder import BaselineBuilder
from layertap.server.drift.exchange import builder_state_from_proto, builder_state_to_proto, frozen_from_bytes, frozen_to_bytes
from layertap.server.drift.files import baseline_filename, load_baselines, save_baseline
from layertap.server.drift.thresholds import DriftThresholds
from layertap.server.errors import InvalidField

pytestmark = pytest.mark.unit

#: Every key of the v1 document, as servers before phases wrote it.
V1_KEYS = {"schema", "version", "tap", "layer", "point", "edges", "counts", "count", "mean", "m2", "min", "max",
           "passes", "quantiles", "channel_mean", "channel_std", "window", "thresholds", "created_at"}


def make(phase: str = "forward", layer: str = "layer1", mu: float = 0.0, seed: int = 0) -> Baseline:
    """A baseline as a server before calibration froze it (no null statistics)."""
    b = BaselineBuilder("tap-1", layer, passes=3, seed=seed, phase=phase)
    rng = np.random.default_rng(seed)
    for _ in range(3):
        x = rng.normal(mu, 1.0, size=1000)
        b.feed(x, x.size, x.mean(), x.std(), x.min(), x.max())
    return replace(b.freeze(window=30, thresholds=DriftThresholds(psi=0.25)), null=None)


def test_a_forward_baseline_without_null_statistics_is_still_written_as_v1() -> None:
    """Rolled back, or read by an older replica of the fleet, a forward baseline still loads."""
    doc = schema.baseline_to_dict(make())
    assert doc["version"] == 1 and set(doc) == V1_KEYS
    # The name a v1 server gave it: saving it again replaces that file, never a duplicate.
    key = "\0".join(("tap-1", "layer1", "output"))
    assert baseline_filename(make()) == f"baseline-layer1.output-{hashlib.sha256(key.encode()).hexdigest()[:12]}.json"


def test_a_v1_file_loads_as_a_forward_baseline(tmp_path: Path) -> None:
    doc = schema.baseline_to_dict(make())
    (tmp_path / "old.json").write_text(json.dumps(doc))
    (loaded,), errors = load_baselines(tmp_path, {"layer1": None})
    assert errors == [] and loaded.phase == "forward" and loaded.key == ("tap-1", "layer1", "output", "forward")


def test_phases_of_one_layer_are_separate_files_that_round_trip(tmp_path: Path) -> None:
    made = {phase: make(phase, mu=mu, seed=i) for i, (phase, mu) in enumerate(
        (("forward", 0.0), ("prefill", 2.0), ("decode", -3.0)))}
    paths = {phase: save_baseline(tmp_path, b) for phase, b in made.items()}
    assert len(set(paths.values())) == 3
    assert json.loads(paths["decode"].read_text())["version"] == 2
    assert json.loads(paths["decode"].read_text())["phase"] == "decode"
    loaded, errors = load_baselines(tmp_path, {"layer1": None})
    assert errors == []  # three phases of one (tap, layer, point) are no duplicates
    got = {b.phase: b for b in loaded}
    assert set(got) == set(made)
    for phase, b in made.items():
        assert got[phase].mean == b.mean and np.array_equal(got[phase].edges, b.edges)
        assert got[phase].key == ("tap-1", "layer1", "output", phase)
    # The same document travels between replicas (InstallBaseline.frozen).
    wire = frozen_from_bytes(frozen_to_bytes(made["prefill"]), "frozen[0]", {"layer1": None})
    assert wire.phase == "prefill" and np.array_equal(wire.counts, made["prefill"].counts)


@pytest.mark.parametrize(("change", "message"), [
    ({"phase": "decode"}, "needs schema version 2"),  # v1 with a phase: an old reader would take it for forward
    ({"version": 2}, "phase None"),  # v2 must name its phase
    ({"version": 2, "phase": "sideways"}, "phase 'sideways' is not one of forward, prefill, decode"),
    ({"version": 2, "phase": 2}, "phase 2 is not"),
    ({"version": 5, "phase": "decode"}, "version 5 is not supported"),
    ({"version": 3, "phase": "decode"}, "field 'null' must be an object"),  # v3 holds its null statistics
    ({"null": {}}, "field 'null' needs schema version 3"),
    ({"version": True}, "version True"),
])
def test_a_bad_phase_or_version_is_refused(tmp_path: Path, change: dict[str, object], message: str) -> None:
    (tmp_path / "bad.json").write_text(json.dumps({**schema.baseline_to_dict(make()), **change}))
    loaded, (error,) = load_baselines(tmp_path)
    assert loaded == [] and message in error, error


def test_merging_refuses_two_phases() -> None:
    with pytest.raises(ValueError, match="layer1/output/prefill and layer1/output/decode"):
        make("prefill").merge(make("decode"))
    a = BaselineBuilder("t", "layer1", phase="prefill")
    with pytest.raises(ValueError, match="prefill"):
        a.merge(BaselineBuilder("t", "layer1", phase="decode"))


def test_builder_states_carry_their_phase() -> None:
    b = BaselineBuilder("t", "layer1", passes=2, seed=0, phase="decode")
    x = np.random.default_rng(0).normal(size=500)
    b.feed(x, x.size, x.mean(), x.std(), x.min(), x.max())
    state = b.state()
    assert state.phase == "decode" and BaselineBuilder.from_state("t", state).phase == "decode"
    forward = BaselineBuilder("t", "layer1", passes=2, seed=0)
    forward.feed(x, x.size, x.mean(), x.std(), x.min(), x.max())
    assert builder_state_from_proto(builder_state_to_proto(forward.state()), "b[0]").phase == "forward"
    assert builder_state_from_proto(builder_state_to_proto(state), "b[0]").phase == "decode"
    msg = builder_state_to_proto(state)
    msg.phase = 7  # type: ignore[assignment]  # a value this build does not know
    with pytest.raises(InvalidField, match="phase"):
        builder_state_from_proto(msg, "b[0]")
