"""Builder states on the wire: exported, checked, merged as if one builder saw every pass."""

from __future__ import annotations

import numpy as np
import pytest

from layertap.server.drift.builder import BaselineBuilder
from layertap.server.drift.exchange import (
    builder_state_from_proto,
    builder_state_to_proto,
    frozen_from_bytes,
    frozen_to_bytes,
    merge_states,
)
from layertap.server.errors import InvalidField

pytestmark = pytest.mark.unit


def _fed(seed: int, loc: float, passes: int, reservoir: int) -> tuple[BaselineBuilder, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    b = BaselineBuilder("t", "fc", passes=passes, reservoir_size=reservoir, seed=seed)
    xs = []
    for _ in range(passes):
        x = rng.normal(loc, 1.0, size=(64, 4))
        xs.append(x)
        b.feed(x.ravel(), x.size, x.mean(), x.std(), x.min(), x.max(),
               channel_mean=x.mean(axis=0), channel_std=x.std(axis=0))
    return b, xs


def test_roundtripped_states_merge_to_the_union_of_every_pass() -> None:
    a, xa = _fed(1, 0.0, 5, 400)
    b, xb = _fed(2, 3.0, 7, 400)
    states = [builder_state_from_proto(builder_state_to_proto(x.state()), f"builders[{i}]") for i, x in enumerate((a, b))]
    merged = merge_states("t", states, reservoir_size=400)
    union = np.concatenate([x.ravel() for x in xa + xb])
    assert merged.count == union.size and merged.passes == 12 and merged.reservoir.size == 400
    np.testing.assert_allclose(merged.mean, union.mean(), rtol=1e-13)
    np.testing.assert_allclose(merged.m2, ((union - union.mean()) ** 2).sum(), rtol=1e-12)
    assert (merged.min, merged.max) == (union.min(), union.max())
    # A-Res: the merged reservoir is the values with the largest keys of both.
    keys = np.concatenate([s.keys for s in states])
    values = np.concatenate([s.values for s in states])
    expect = np.sort(values[np.argsort(keys)[-merged.reservoir_size:]])
    np.testing.assert_array_equal(np.sort(merged.reservoir), expect)
    frozen = merged.freeze()
    rows = np.concatenate([x for x in xa + xb])
    np.testing.assert_allclose(frozen.channel_mean, rows.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(frozen.channel_std, rows.std(axis=0), rtol=1e-12)
    # The same as merging the builders in process.
    a.merge(b)
    np.testing.assert_array_equal(np.sort(a.reservoir), np.sort(merged.reservoir))
    again = frozen_from_bytes(frozen_to_bytes(frozen), "frozen[0]", None)
    np.testing.assert_array_equal(again.edges, frozen.edges)
    np.testing.assert_array_equal(again.counts, frozen.counts)


@pytest.mark.parametrize(("change", "field"), [
    (lambda m: m.ClearField("layer"), "builders[3].layer"),
    (lambda m: setattr(m, "mean", float("inf")), "builders[3].mean"),
    (lambda m: setattr(m, "min", float("nan")), "builders[3].min"),
    (lambda m: m.keys.append(-1.0), "builders[3].keys"),
    (lambda m: m.channel_m2.append(1.0), "builders[3].channel_m2"),
    (lambda m: setattr(m, "channel_count", 0.0), "builders[3].channel_count"),
    (lambda m: setattr(m, "count", 0), "builders[3].count"),
])
def test_a_bad_state_is_refused_naming_its_field(change, field) -> None:  # type: ignore[no-untyped-def]
    b, _ = _fed(1, 0.0, 2, 50)
    msg = builder_state_to_proto(b.state())
    change(msg)
    with pytest.raises(InvalidField) as err:
        builder_state_from_proto(msg, "builders[3]")
    assert err.value.field == field
