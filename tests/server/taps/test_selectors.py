"""Selectors from the network: linear-time matching, bounded size, clear errors."""

from __future__ import annotations

import threading

import pytest

from layertap.server.errors import ECHO_CHARS, InvalidField, NotFound
from layertap.server.taps.selectors import MAX_SELECTOR_BYTES, select_layers

pytestmark = pytest.mark.unit

#: A ResNet-50-sized name list: long dotted names, as catastrophic backtracking needs.
NAMES = [f"layer{i}.{j}.{part}" for i in range(1, 5) for j in range(6)
         for part in ("conv1", "bn1", "conv2", "bn2", "conv3", "bn3", "relu", "downsample.0")]


def finishes(fn, seconds: float = 10.0) -> BaseException | object:
    """Run ``fn`` in a thread; its result or exception, or fail if it hangs.

    The bound is generous: under Python's ``re`` these selectors never finish.
    """
    out: list = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "selector matching did not finish: backtracking?"
    return out[0]


@pytest.mark.parametrize("selector", [
    "**" * 30 + "!",
    "re:(.*)*!",
    "re:(a|aa)*$" + "!",
    "re:(" + "(.*)*" * 20 + ")!",
    "*" * 500 + "!",
])
def test_catastrophic_patterns_answer_not_found(selector: str) -> None:
    got = finishes(lambda: select_layers(selector, NAMES * 4))
    assert isinstance(got, NotFound), got


@pytest.mark.parametrize("selector, why", [
    ("layer[z-a]", "invalid character class range"),
    ("re:(a|b", "missing )"),
    ("re:(?P<x>a)(?P=x)", "bad regex"),  # backreference: RE2 refuses
    ("re:(?=lookahead)", "bad regex"),
    ("layer[1", "unclosed '['"),
])
def test_malformed_patterns_are_invalid_and_name_the_field(selector: str, why: str) -> None:
    with pytest.raises(InvalidField, match="spec.selector") as info:
        select_layers(selector, NAMES, field="spec.selector")
    assert why in str(info.value)
    assert info.value.field == "spec.selector"


@pytest.mark.parametrize("selector", [
    "re:a{99999999999}",  # OverflowError under Python's re
    "re:" + "(" * 300 + "a" + ")" * 300,  # deep nesting: RecursionError under Python's re
])
def test_extreme_regexes_never_raise_internal_errors(selector: str) -> None:
    got = finishes(lambda: select_layers(selector, NAMES))
    assert isinstance(got, (InvalidField, NotFound)), got


def test_selector_size_is_capped_in_bytes() -> None:
    ok = "re:" + "l" * (MAX_SELECTOR_BYTES - 3)
    with pytest.raises(NotFound):
        select_layers(ok, NAMES)
    with pytest.raises(InvalidField, match=f"limit is {MAX_SELECTOR_BYTES}"):
        select_layers(ok + "l", NAMES)
    with pytest.raises(InvalidField, match="bytes"):  # 2 bytes per char in UTF-8
        select_layers("é" * (MAX_SELECTOR_BYTES // 2 + 1), NAMES)


def test_errors_echo_a_bounded_excerpt() -> None:
    with pytest.raises(NotFound) as info:
        select_layers("x*" * 400, NAMES)
    msg = str(info.value)
    assert "(800 chars)" in msg and len(msg) < ECHO_CHARS + 400


def test_globs_and_regexes_still_select_in_model_order() -> None:
    assert select_layers("layer1.0.*", NAMES)[:3] == ["layer1.0.conv1", "layer1.0.bn1", "layer1.0.conv2"]
    assert select_layers("layer?.5.downsample.0", NAMES) == [f"layer{i}.5.downsample.0" for i in range(1, 5)]
    assert select_layers("layer[!1-3].0.bn1", NAMES) == ["layer4.0.bn1"]
    assert len(select_layers("**.0", NAMES)) == 4 * 6
    assert select_layers(r"re:layer2\.3\.conv[12]", NAMES) == ["layer2.3.conv1", "layer2.3.conv2"]
