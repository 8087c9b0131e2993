"""The drift monitor's layer table knows which taps it holds, whatever the monitor does to it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layertap.server.drift.table import LayerTable

pytestmark = pytest.mark.unit

KEY = st.tuples(st.sampled_from(["t1", "t2", "t3"]), st.sampled_from(["a", "b"]))
OP = st.one_of(
    st.tuples(st.just("set"), KEY), st.tuples(st.just("setdefault"), KEY), st.tuples(st.just("pop"), KEY),
    st.tuples(st.just("del"), KEY), st.tuples(st.just("update"), st.lists(KEY, max_size=3)),
    st.tuples(st.just("popitem"), st.none()), st.tuples(st.just("clear"), st.none()),
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(OP, max_size=40))
def test_has_tap_matches_a_scan_of_the_keys(ops) -> None:
    table = LayerTable()
    for op, arg in ops:
        if op == "set":
            table[arg] = {}
        elif op == "setdefault":
            table.setdefault(arg, {})
        elif op == "pop":
            table.pop(arg, None)
        elif op == "del" and arg in table:
            del table[arg]
        elif op == "update":
            table.update({k: {} for k in arg})
        elif op == "popitem" and table:
            table.popitem()
        elif op == "clear":
            table.clear()
        for tap in ("t1", "t2", "t3"):
            assert table.has_tap(tap) == any(t == tap for t, _ in table), (op, arg, dict(table))


def test_a_missing_key_pops_as_a_dict_does() -> None:
    table = LayerTable()
    with pytest.raises(KeyError):
        table.pop(("t", "a"))
    assert table.pop(("t", "a"), None) is None
    with pytest.raises(TypeError):
        table |= {("t", "a"): {}}
