"""Baselines: two-phase build, merging, atomic persistence and refusal of bad files."""

from __future__ import annotations

import json
import os
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pytest

from layertap.server.drift import builder, schema
from layertap.server.drift.baseline import Baseline
from layertap.server.drift.builder import BaselineBuilder
from layertap.server.drift.files import load_baselines, save_baseline
from layertap.server.drift.thresholds import DriftThresholds

pytestmark = pytest.mark.unit


def feed_all(b: BaselineBuilder, chunks: list[np.ndarray]) -> None:
    for x in chunks:
        b.feed(x, x.size, float(x.mean()), float(x.std()), float(x.min()), float(x.max()))


@pytest.fixture
def chunks() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.normal(3.0, 2.0, size=int(rng.integers(200, 2000))) for _ in range(40)]


def test_freeze_puts_edges_at_quantiles(chunks: list[np.ndarray]) -> None:
    b = BaselineBuilder("t", "layer1", passes=40, seed=1)
    feed_all(b, chunks)
    assert b.done
    base = b.freeze(bins=20)
    want = [NormalDist(3.0, 2.0).inv_cdf(p) for p in np.linspace(0.05, 0.95, 19)]
    assert base.edges.shape == (19,) and np.all(np.diff(base.edges) > 0)
    # 20k-value reservoir: quantile standard error < 0.02σ; allow 0.1σ.
    assert np.allclose(base.edges, want, atol=0.2)
    assert base.counts.shape == (20,) and base.counts.dtype == np.int64
    assert np.allclose(base.proportions, 0.05, atol=0.01)
    allx = np.concatenate(chunks)
    assert base.count == allx.size and base.passes == 40
    assert base.mean == pytest.approx(allx.mean(), rel=1e-12)
    assert base.std == pytest.approx(allx.std(), rel=1e-12)
    assert base.min == allx.min() and base.max == allx.max()
    assert base.quantiles[0.5] == pytest.approx(3.0, abs=0.1)


def test_ties_give_strictly_increasing_edges() -> None:
    x = np.maximum(np.random.default_rng(0).normal(size=5000), 0.0)  # ReLU: half zeros
    b = BaselineBuilder("t", "relu", seed=0)
    b.feed(x, x.size, x.mean(), x.std(), x.min(), x.max())
    base = b.freeze()
    assert np.all(np.diff(base.edges) > 0) and base.edges[0] == 0.0
    assert base.counts.sum() == x.size and base.counts[0] == 0  # nothing below 0


def test_merge_equals_one_builder_on_concatenated_data(chunks: list[np.ndarray]) -> None:
    big = 10**6  # reservoir holds everything, so contents must match exactly
    one = BaselineBuilder("t", "l", reservoir_size=big, seed=0)
    feed_all(one, chunks)
    a = BaselineBuilder("t", "l", reservoir_size=big, seed=1)
    b = BaselineBuilder("t", "l", reservoir_size=big, seed=2)
    feed_all(a, chunks[:17])
    feed_all(b, chunks[17:])
    a.merge(b)
    allx = np.concatenate(chunks)
    for built in (one, a):
        assert built.count == allx.size and built.passes == len(chunks)
        assert built.mean == pytest.approx(allx.mean(), rel=1e-12)
        assert built.m2 == pytest.approx(((allx - allx.mean()) ** 2).sum(), rel=1e-12)
        assert built.min == allx.min() and built.max == allx.max()
    assert np.array_equal(np.sort(a.reservoir), np.sort(one.reservoir))
    fa, fo = a.freeze(), one.freeze()
    assert np.array_equal(fa.edges, fo.edges) and np.array_equal(fa.counts, fo.counts)
    # Bounded reservoirs merge to the bounded size.
    c, d = BaselineBuilder("t", "l", reservoir_size=500, seed=1), BaselineBuilder("t", "l", reservoir_size=500, seed=2)
    feed_all(c, chunks[:5])
    feed_all(d, chunks[5:10])
    c.merge(d)
    assert c.reservoir.size == 500


def test_frozen_baselines_merge(chunks: list[np.ndarray]) -> None:
    a, b = BaselineBuilder("t", "l", seed=1), BaselineBuilder("t", "l", seed=2)
    feed_all(a, chunks[:20])
    feed_all(b, chunks[20:])
    fa = a.freeze()
    fb = Baseline(**{**fa.__dict__, "counts": builder._bin(b.reservoir, fa.edges), "count": b.count, "mean": b.mean,
                     "m2": b.m2, "min": b.min, "max": b.max, "passes": b.passes})
    m = fa.merge(fb)
    allx = np.concatenate(chunks)
    assert np.array_equal(m.counts, fa.counts + fb.counts)
    assert m.count == allx.size and m.mean == pytest.approx(allx.mean(), rel=1e-12)
    assert m.std == pytest.approx(allx.std(), rel=1e-12) and m.passes == 40
    other_edges = Baseline(**{**fb.__dict__, "edges": fb.edges + 1.0})
    with pytest.raises(ValueError, match="different edges"):
        fa.merge(other_edges)


def make_baseline(layer: str = "layer1", tap: str = "tap-1") -> Baseline:
    rng = np.random.default_rng(5)
    b = BaselineBuilder(tap, layer, seed=0)
    for _ in range(3):
        x = rng.normal(size=1000)
        b.feed(x, x.size, x.mean(), x.std(), x.min(), x.max(), channel_mean=rng.normal(size=4), channel_std=np.ones(4))
    return b.freeze(window=30, thresholds=DriftThresholds(psi=0.25))


def test_save_load_round_trip(tmp_path: Path) -> None:
    base = make_baseline()
    path = save_baseline(tmp_path / "baselines", base)
    assert path.exists() and [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left
    loaded, errors = load_baselines(tmp_path / "baselines", {"layer1": 4})
    assert errors == []
    (got,) = loaded
    for name in ("tap", "layer", "point", "count", "mean", "m2", "min", "max", "passes", "quantiles", "window", "thresholds", "created_at"):
        assert getattr(got, name) == getattr(base, name), name
    for name in ("edges", "counts", "channel_mean", "channel_std"):
        assert np.array_equal(getattr(got, name), getattr(base, name)), name
    assert got.counts.dtype == np.int64
    # Saving again replaces the file in place.
    save_baseline(tmp_path / "baselines", base)
    assert len(list((tmp_path / "baselines").iterdir())) == 1


def test_failed_write_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = make_baseline()
    path = save_baseline(tmp_path, base)
    before = path.read_bytes()

    def boom(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        save_baseline(tmp_path, make_baseline())
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_bad_files_are_refused_with_a_message(tmp_path: Path) -> None:
    good = make_baseline("layer1")
    save_baseline(tmp_path, good)
    doc = schema.baseline_to_dict(make_baseline("layer2", tap="tap-2"))

    def write(name: str, content: object) -> None:
        (tmp_path / name).write_text(content if isinstance(content, str) else json.dumps(content))

    write("corrupt.json", '{"schema": "layertap.baseline", "version": 1, "edges": [1, 2')
    write("schema.json", {**doc, "version": 99})
    write("unknown.json", {**doc, "layer": "no_such_layer"})
    write("lengths.json", {**doc, "counts": doc["counts"][:-1]})
    write("edges.json", {**doc, "edges": sorted(doc["edges"], reverse=True)})
    write("nan.json", json.dumps(doc).replace(str(doc["mean"]), "NaN", 1))
    write("shape.json", {**doc, "channel_mean": [0.0] * 7, "channel_std": [1.0] * 7})
    write("notobject.json", "[1, 2, 3]")
    loaded, errors = load_baselines(tmp_path, {"layer1": 4, "layer2": 4})
    assert [b.layer for b in loaded] == ["layer1"]
    by_file = {e.split(" refused: ")[0].rsplit("/", 1)[-1]: e.split(" refused: ")[1] for e in errors}
    assert set(by_file) == {"corrupt.json", "schema.json", "unknown.json", "lengths.json", "edges.json",
                            "nan.json", "shape.json", "notobject.json"}
    assert "corrupt JSON" in by_file["corrupt.json"]
    assert "version 99" in by_file["schema.json"]
    assert "unknown layer 'no_such_layer'" in by_file["unknown.json"]
    assert "counts has 19 entries, expected 20" in by_file["lengths.json"]
    assert "not strictly increasing" in by_file["edges.json"]
    assert "non-finite" in by_file["nan.json"]
    assert "4 channels but the baseline 7" in by_file["shape.json"]
    assert all("\n" not in e for e in errors)


def test_missing_dir_loads_nothing(tmp_path: Path) -> None:
    assert load_baselines(tmp_path / "absent") == ([], [])


def test_refused_passes_are_counted_never_learned(chunks: list[np.ndarray]) -> None:
    nan, inf = float("nan"), float("inf")
    x = chunks[0]
    b = BaselineBuilder("t", "l", passes=2, seed=0)
    b.feed(x, 0, nan, nan, nan, nan)  # no finite element in the pass
    b.feed(x, x.size, float(x.mean()), inf, float(x.min()), float(x.max()))  # the square overflowed
    b.skip()  # refused by the caller before feeding
    assert (b.skipped_passes, b.passes, b.count, b.reservoir.size) == (3, 0, 0, 0)
    assert not b.done and b.min == inf and b.max == -inf
    with pytest.raises(ValueError, match="no data"):
        b.freeze()
    other = BaselineBuilder("t", "l", seed=1)
    other.feed(x, x.size, nan, float(x.std()), float(x.min()), float(x.max()))
    feed_all(other, chunks[:2])
    b.merge(other)
    assert (b.skipped_passes, b.passes) == (4, 2) and b.done
