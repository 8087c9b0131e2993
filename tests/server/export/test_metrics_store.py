"""SnapshotStore: bounded quantile labels, no stale series, no resurrection."""

from __future__ import annotations

import pytest

from layertap.server.export.snapshots import EXPORTED_QUANTILES, SnapshotStore
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit


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


def _grad(pass_index: int, position: int, l2: float) -> pb.Summary:
    return pb.Summary(tap="grads", layer="fc", point=pb.POINT_PARAM_GRAD, pass_index=pass_index,
                      output_index=position, results=[pb.ReducerResult(norm=pb.Norm(l2=l2))])


def test_l2_adds_up_a_module_s_tensors_per_pass() -> None:
    store = SnapshotStore()
    store.update_from_summaries([("grads", _grad(1, 0, 3.0)), ("grads", _grad(1, 1, 4.0))])
    assert store.snapshot()[0].l2 == 5.0
    store.update_from_summaries([("grads", _grad(2, 0, 6.0)), ("grads", _grad(2, 1, 8.0))])
    assert store.snapshot()[0].l2 == 10.0  # a new pass starts over


def test_a_scrape_never_sees_part_of_a_pass() -> None:
    """A scrape between two summaries of one pass would show an L2 norm that never existed."""
    import threading

    store = SnapshotStore()
    seen: list[float | None] = []
    scraper: list[threading.Thread] = []

    def one_pass():  # type: ignore[no-untyped-def]
        yield "grads", _grad(1, 0, 3.0)
        scraper.append(threading.Thread(target=lambda: seen.append(store.snapshot()[0].l2)))
        scraper[0].start()
        scraper[0].join(0.2)  # a scrape arriving mid-pass waits for the pass
        yield "grads", _grad(1, 1, 4.0)

    store.update_from_summaries(one_pass())
    scraper[0].join(5)
    assert seen == [5.0]
