"""What the CLI writes, without a server: fitted tables, JSON lines, watch lines."""

from __future__ import annotations

import dataclasses
import datetime as dt
import io
import json
import math

import pytest
from rich.console import Console

from layertap import (
    AbsMax,
    Latency,
    LayerInfo,
    MinMax,
    Moments,
    Nonfinite,
    Norm,
    Quantiles,
    Summary,
    TapInfo,
    TapSpec,
    ZeroFraction,
)
from layertap.cli.json_lines import jsonable, write_json_lines
from layertap.cli.table import Column, fit_table, layers_table, taps_table
from layertap.cli.view import update_row, watch_line, watch_table

pytestmark = pytest.mark.unit

LONG = "encoder.layers.11.self_attn.out_proj"


def render(table: object, width: int) -> list[str]:
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(table)
    return out.getvalue().splitlines()


def layer(name: str, type_: str = "NonDynamicallyQuantizableLinear") -> LayerInfo:
    return LayerInfo(name, type_, 1_050_624, [(1, 8, 1024), (1, 8, 1024), (1, 8, 1024)], [(1, 8, 1024)])


@pytest.mark.parametrize("width", [60, 80, 120, 200])
def test_layer_names_are_never_cut_and_rows_never_wrap(width):
    layers = [layer(LONG), layer("head", "Linear")]
    lines = render(layers_table(layers, width, "t"), width)
    assert max(len(line) for line in lines) <= width
    rows = [line for line in lines if line.startswith("│")]
    assert len(rows) == 2  # one line per row
    assert rows[0].split("│")[1].strip() == LONG


def test_other_columns_give_way_in_their_order():
    layers = [layer(LONG)]
    headers = {w: render(layers_table(layers, w, "t"), w)[2] for w in (200, 110, 80, 60, 50)}
    assert all(h in headers[200] for h in ("type", "params", "input shapes", "output shapes"))
    assert "input shapes" not in headers[110] and "output shapes" in headers[110]  # input shapes go first
    assert "type" in headers[80] and "params" not in headers[80] and "output shapes" in headers[80]
    assert "type" not in headers[60] and "output shapes" in headers[60]  # shapes outlast the type
    assert headers[50].split() == ["┃", "name", "┃"]
    cut = [line for line in render(layers_table(layers, 80, "t"), 80) if line.startswith("│")][0]
    assert "NonDynamicallyQuantizableLinear" not in cut and "…" in cut


def test_a_name_wider_than_the_terminal_folds_but_loses_no_character():
    name = "a." * 40 + "end"
    lines = render(fit_table([Column("name"), Column("x", drop=0)], [(name, "1")], 40, title="t"), 40)
    assert "".join(line.strip("│ ") for line in lines if line.startswith("│")) == name


def test_markup_in_user_strings_is_shown_literally():
    tap = TapInfo("t1", TapSpec("re:layer[a-z]"), "durable", [], 0, 0, 0, "", False, None, None)
    assert any("re:layer[a-z]" in line for line in render(taps_table([tap], 200, "t"), 200))


def test_json_carries_non_finite_floats_and_times_as_strings():
    when = dt.datetime(2027, 1, 1, tzinfo=dt.timezone.utc)
    value = {"nan": math.nan, "up": math.inf, "down": -math.inf, "x": 1.5, "t": when, "shape": (1, 2)}
    assert jsonable(value) == {"nan": "NaN", "up": "+Inf", "down": "-Inf", "x": 1.5,
                               "t": "2027-01-01T00:00:00+00:00", "shape": [1, 2]}


def test_json_lines_are_strict_json_one_object_per_line(capsys):
    s = Summary("t", "layer1", "output", 0, 3, None, 1.0, False,
                {"moments": Moments(4, math.nan, 0.5), "nonfinite": Nonfinite(4, 0)})
    write_json_lines([s, s])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    parsed = json.loads(lines[0], parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert parsed["results"]["moments"] == {"count": 4, "mean": "NaN", "std": 0.5}
    assert parsed["layer"] == "layer1" and parsed["step"] is None


def test_watch_line_sampled_and_unsampled():
    sampled = Summary("t", "layer2", "output", 1, 7, None, 0.0, False,
                      {"moments": Moments(8, 0.25, 1.0), "minmax": MinMax(-2.0, 3.0), "nonfinite": Nonfinite(1, 0)})
    assert watch_line(sampled) == "layer2[1] pass=7 mean=0.25 std=1 min=-2 max=3 nan=1 inf=0"
    unsampled = Summary("t", "layer2", "output", 0, 8, None, 0.0, True, {"nonfinite": Nonfinite(0, 2)})
    assert watch_line(unsampled) == "layer2 pass=8 unsampled nan=0 inf=2"
    decode = dataclasses.replace(sampled, phase="decode", position=17, request_ids=("g1",))
    assert watch_line(decode) == "layer2[1] pass=7 phase=decode pos=17 mean=0.25 std=1 min=-2 max=3 nan=1 inf=0"
    ragged = dataclasses.replace(unsampled, phase="prefill")
    assert watch_line(ragged) == "layer2 pass=8 phase=prefill unsampled nan=0 inf=2"


EVERY = {"moments": Moments(8, 0.25, 1.0), "abs_max": AbsMax(3.0), "zero_fraction": ZeroFraction(0.125, 1),
         "norm": Norm(2.5), "quantiles": Quantiles([0.25, 0.5], [-0.5, 0.75], 8, 8, 0.1),
         "latency": Latency(0.0042), "nonfinite": Nonfinite(0, 0)}


def test_watch_shows_every_scalar_reducer():
    """`watch --reducers norm` (docs/training.md) must show the norm, not a bare pass number."""
    s = Summary("t", "fc", "param_grad", 0, 3, 3, 0.0, False, EVERY)
    assert watch_line(s) == "fc pass=3 mean=0.25 std=1 absmax=3 zero=0.125 l2=2.5 p50=0.75 ms=4.2 nan=0 inf=0"
    norm_only = Summary("t", "fc", "param_grad", 0, 3, 3, 0.0, False, {"norm": Norm(2.5)})
    assert watch_line(norm_only) == "fc pass=3 l2=2.5"
    rows: dict = {}
    update_row(rows, s)
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(watch_table("t", rows, 0, (), 10, 200))
    header, = [line for line in out.getvalue().splitlines() if "layer" in line]
    assert [h.strip() for h in header.split("┃") if h.strip()] == [
        "layer", "pass", "mean", "std", "min", "max", "|max|", "zero", "l2", "p50", "ms", "nan", "inf", "mean (last 10)"]
    assert "2.5" in out.getvalue() and "0.75" in out.getvalue()
    plain: dict = {}
    update_row(plain, Summary("t", "fc", "output", 0, 3, None, 0.0, False, {"moments": Moments(8, 0.25, 1.0)}))
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(watch_table("t", plain, 0, (), 10, 200))
    assert "l2" not in out.getvalue() and "|max|" not in out.getvalue()  # columns only for what is computed
