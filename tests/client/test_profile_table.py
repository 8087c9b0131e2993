"""``layertap profile``'s arithmetic: self time is total less the timed children's totals."""

from __future__ import annotations

import pytest

from layertap import Latency, Summary
from layertap.cli.profile import layer_times, profile_table

pytestmark = pytest.mark.unit


def _summary(layer: str, seconds: float, pass_index: int, output_index: int = 0) -> Summary:
    return Summary(tap="t", layer=layer, point="output", output_index=output_index, pass_index=pass_index,
                   step=None, wall_time=0.0, unsampled=False, results={"latency": Latency(seconds)})


def test_self_time_subtracts_the_nearest_timed_children():
    got = [
        _summary("layer1", 0.010, 0), _summary("layer1.0", 0.004, 0), _summary("layer1.0.conv", 0.003, 0),
        _summary("layer1.1", 0.005, 0), _summary("fc", 0.001, 0),
        _summary("layer1", 0.012, 1), _summary("layer1.0", 0.004, 1), _summary("layer1.0.conv", 0.003, 1),
        _summary("layer1.1", 0.007, 1), _summary("fc", 0.001, 1),
        _summary("fc", 9.0, 1, output_index=1),  # a second output tensor: the same call, not counted again
    ]
    rows = {r.name: r for r in layer_times(got)}
    assert rows["layer1"].total == pytest.approx(0.022) and rows["layer1"].calls == 2
    assert rows["layer1"].self_total == pytest.approx(0.022 - 0.008 - 0.012)  # layer1.0 and layer1.1, not the conv
    assert rows["layer1.0"].self_total == pytest.approx(0.008 - 0.006)
    assert rows["layer1.1"].max == pytest.approx(0.007) and rows["layer1.1"].avg == pytest.approx(0.006)
    assert rows["fc"].total == pytest.approx(0.002)
    assert [r.name for r in layer_times(got)][0] == "layer1.1"  # slowest by self time
    assert sum(r.self_total for r in rows.values()) == pytest.approx(rows["layer1"].total + rows["fc"].total)


def test_table_lists_the_top_rows_with_percentages_of_the_self_total():
    rows = layer_times([_summary("a", 0.003, 0), _summary("b", 0.001, 0)])
    lines = profile_table(rows, "cpu", top=1).splitlines()
    assert lines[1].split()[:3] == ["Name", "Self", "CPU"]
    assert lines[3].split() == ["a", "75.00%", "3.000ms", "75.00%", "3.000ms", "3.000ms", "3.000ms", "1"]
    assert len(lines) == 6 and lines[-1] == "Self CPU time total: 4.000ms"
    assert "Self CUDA %" in profile_table(rows, "cuda:0")
