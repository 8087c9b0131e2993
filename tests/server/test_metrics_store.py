"""SnapshotStore: bounded quantile labels, no stale series, no resurrection."""

from __future__ import annotations

from layertap.server.export.snapshots import EXPORTED_QUANTILES, SnapshotStore
from layertap.v1 import telemetry_pb2 as pb


def summary(*results: pb.ReducerResult, unsampled: bool = False) -> pb.Summary:
    return pb.Summary(tap="t", layer="l", point=pb.POINT_OUTPUT, results=list(results), unsampled=unsampled)


def quantiles(n: int) -> pb.ReducerResult:
    probs = [round(i / (n + 1), 2) for i in range(1, n + 1)]
    return pb.ReducerResult(quantiles=pb.Quantiles(probabilities=probs, values=[float(p) for p in probs]))


MOMENTS = pb.ReducerResult(moments=pb.Moments(count=4, mean=1.0, std=2.0))
NONFINITE = pb.ReducerResult(nonfinite=pb.Nonfinite(nan_count=1))


def test_only_the_standard_quantiles_are_exported():
    store = SnapshotStore()
    store.update_from_summary("t", summary(MOMENTS, quantiles(99)))
    (snap,) = store.snapshot()
    assert set(snap.quantiles) == set(EXPORTED_QUANTILES)


def test_results_a_tap_stops_computing_disappear():
    store = SnapshotStore()
    store.update_from_summary("t", summary(MOMENTS, quantiles(99)))
    store.update_from_summary("t", summary(NONFINITE, unsampled=True))  # unsampled: keeps the rest
    (snap,) = store.snapshot()
    assert snap.quantiles and snap.mean == 1.0 and snap.nan_total == 1
    store.update_from_summary("t", summary(MOMENTS))  # sampled, no quantiles any more
    (snap,) = store.snapshot()
    assert not snap.quantiles and snap.mean == 1.0


def test_removed_tap_is_not_resurrected_by_a_late_summary():
    store = SnapshotStore()
    store.update_from_summary("t", summary(MOMENTS))
    store.remove_tap("t")
    store.update_from_summary("t", summary(MOMENTS))
    assert store.snapshot() == []
    store.add_tap("t")  # a new tap reusing the name exports again
    store.update_from_summary("t", summary(MOMENTS))
    assert len(store.snapshot()) == 1
