"""The reducer result kinds are declared once: the proto's ``ReducerResult`` oneof and
the table in ``layertap._results`` (issue 22, "one table per fact").

The table must cover exactly the oneof's fields, and no other module of the
client or the server may enumerate the kinds by hand: such a list goes stale
(the ``create_tap`` docstring once left out ``latency``).
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest

import layertap
from layertap import _convert, _results
from layertap._results import RESULTS
from layertap._types import DEFAULT_REDUCERS
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
_ONEOF = pb.ReducerResult.DESCRIPTOR.oneofs_by_name["value"].fields
FIELDS = tuple(f.name for f in _ONEOF)
CLASSES = {r.type.__name__: r.field for r in RESULTS}

#: A module that names this many kinds enumerates them, unless listed below.
ENUMERATES = 3
#: Modules that implement or read particular results name those, and no others:
#: that is their job, not a list of the kinds.
READS = {
    "server/reducers/distribution.py": ({"histogram", "quantiles", "per_channel", "abs_max"},
                                        "implements these reducers (abs_max: a PerChannel field)"),
    "server/record/triggers.py": ({"nonfinite", "abs_max", "moments"}, "one trigger per reducer it reads"),
    "server/drift/layer.py": ({"histogram", "quantiles", "per_channel", "moments", "minmax"},
                              "the reducers a drift baseline taps, and the results a window scores"),
    "server/drift/monitor.py": ({"moments", "minmax", "quantiles", "per_channel", "histogram"},
                                "drift scores read these results"),
    "server/record/replay.py": ({"moments", "minmax", "abs_max", "zero_fraction", "nonfinite"},
                                "compares these results of a live pass and its replay, field by field"),
    "server/reducers/plan.py": ({"histogram", "quantiles", "per_channel"},
                                "builds the reducers that take parameters"),
    "server/reducers/spec.py": ({"histogram", "quantiles", "per_channel"},
                                "validates the parameters of the reducers that take them"),
    # Presentation: a new kind is simply not shown until given a column or a tag.
    "client/cli/view.py": ({"moments", "minmax", "abs_max", "zero_fraction", "nonfinite", "norm", "quantiles",
                             "latency"}, "the watch table's columns read these results"),
    "client/_tensorboard.py": ({"moments", "minmax", "zero_fraction", "nonfinite", "histogram", "latency"},
                               "the TensorBoard scalars and histogram read these results"),
}
#: Modules that keep the old escape hatch: none. Listing a module here needs a
#: reason it cannot read the table; the test fails once the module stops naming kinds.
STILL_ENUMERATING: dict[str, tuple[set[str], str]] = {}


def test_table_is_the_proto_oneof() -> None:
    assert tuple(r.field for r in RESULTS) == FIELDS, "add the new ReducerResult field to layertap._results.RESULTS"
    assert len({r.type for r in RESULTS}) == len(RESULTS)


def test_reducer_names_are_the_result_fields() -> None:
    # A reducer fills the oneof field named after its kind (basic.py derives it, Summary.results keys by it).
    assert _convert.REDUCER_NAMES == FIELDS


def test_dataclasses_mirror_their_messages() -> None:
    union = typing.get_args(_results.ReducerResult)
    assert union == tuple(r.type for r in RESULTS)
    for r, fd in zip(RESULTS, _ONEOF):
        names = tuple(f.name for f in dataclasses.fields(r.type))
        assert names == tuple(f.name for f in fd.message_type.fields), r.field
        assert getattr(layertap, r.type.__name__) is r.type
        assert r.type.__name__ in layertap.__all__


def test_snapshot_fields_and_families() -> None:
    from layertap.server.export.activations import ActivationCollector
    from layertap.server.export.snapshots import LayerSnapshot

    snapshot_fields = {f.name for f in dataclasses.fields(LayerSnapshot)}
    fed: list[str] = []
    for r, fd in zip(RESULTS, _ONEOF):
        for name, attr in r.snapshot:
            assert name in snapshot_fields, (r.field, name)
            assert attr == "" or attr in fd.message_type.fields_by_name, (r.field, attr)
            fed.append(name)
        for f in r.families:
            assert set(f.snapshot) <= {name for name, _ in r.snapshot}, (r.field, f.name)
            assert len(f.snapshot) == (len(f.label_values) or 1), f.name
            assert (f.type == "histogram") == (f.label == "le"), f.name
    assert len(fed) == len(set(fed)), "two results feed one snapshot field"
    described = [m.name for m in ActivationCollector(lambda: [], "m").describe()]
    for f in (f for r in RESULTS for f in r.families):
        assert described.count(f.name) == 1, f.name


def test_defaults_and_docs_name_the_kinds() -> None:
    assert DEFAULT_REDUCERS == ("moments", "minmax", "nonfinite")
    doc = " ".join((layertap.Client.create_tap.__doc__ or "").split())
    for field in FIELDS:
        assert field in doc, f"create_tap's docstring leaves out {field!r}"
    assert f"Default: {', '.join(DEFAULT_REDUCERS)}." in doc


def kinds_named(tree: ast.AST) -> set[str]:
    """The result kinds a module names: as strings, attributes or keywords (``"abs_max"``,
    ``res.abs_max``, ``abs_max=``), or by their client dataclass or message name (``Moments``)."""
    kinds: set[str] = set()
    for node in ast.walk(tree):
        name = ""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = node.value
        elif isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.keyword) and node.arg:
            name = node.arg
        elif isinstance(node, ast.Name):  # a variable or a field may be called histogram; only classes count
            name = node.id if node.id in CLASSES else ""
        elif isinstance(node, ast.alias):
            name = node.name if node.name in CLASSES else ""
        if name in FIELDS:
            kinds.add(name)
        elif name in CLASSES:
            kinds.add(CLASSES[name])
    return kinds


def enumerating_modules() -> dict[str, set[str]]:
    found = {}
    for package in ("client", "server"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("client/v1/") or rel == "client/_results.py":
                continue
            kinds = kinds_named(ast.parse(path.read_text(), rel))
            if len(kinds) >= ENUMERATES:
                found[rel] = kinds
    return found


def test_the_scan_sees_an_enumeration() -> None:
    # What the table replaced: a hand dict of kinds, a Union of dataclasses, a dispatch on kind.
    assert kinds_named(ast.parse('T = {"moments": Moments, "minmax": MinMax, "abs_max": AbsMax}')) == {
        "moments", "minmax", "abs_max"}
    assert kinds_named(ast.parse("R = Union[Moments, MinMax, Latency]")) == {"moments", "minmax", "latency"}
    assert len(kinds_named(ast.parse("def f(r):\n  if r.norm: pass\n  elif k == 'histogram': x = r.quantiles"))) == 3
    assert kinds_named(ast.parse('"moments and minmax"; abs_max_above = 1')) == set()


def test_no_module_enumerates_the_result_kinds() -> None:
    found = enumerating_modules()
    allowed = {**READS, **STILL_ENUMERATING}
    new = {m: sorted(k) for m, k in found.items() if m not in allowed}
    assert not new, f"enumerate the kinds in layertap._results.RESULTS, not by hand: {new}"
    grown = {m: sorted(k - allowed[m][0]) for m, k in found.items() if m in allowed and not k <= allowed[m][0]}
    assert not grown, f"these modules name more kinds than they did; read layertap._results.RESULTS: {grown}"
    fixed = set(STILL_ENUMERATING) - set(found)
    assert not fixed, f"no longer enumerating kinds, remove from STILL_ENUMERATING: {sorted(fixed)}"
