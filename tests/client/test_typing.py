"""The client's static types, as a user's type checker sees them (mypy, when installed)."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

CLIENT_DIR = Path(__file__).resolve().parents[2] / "client"
PYPROJECT = CLIENT_DIR.parent / "pyproject.toml"

SNIPPET = """\
from typing import Any, assert_type

import numpy as np
import numpy.typing as npt

import layertap
from layertap import Structured

c = layertap.Client("localhost:1")
assert_type(c.capture("layer4"), Structured)
assert_type(c.capture(["layer3", "layer4"]), dict[str, Structured])
assert_type(c.capture("layer4", n=3, input=np.zeros(3)), list[Structured])
assert_type(c.capture(("layer3", "layer4"), n=2, dtype="float16"), list[dict[str, Structured]])
assert_type(c.capture("layer4", as_torch=True), Any)
assert_type(c.infer(np.zeros(3)), npt.NDArray[Any] | list[npt.NDArray[Any] | None] | dict[str, npt.NDArray[Any]])
assert_type(c.infer(input_ids=np.zeros(3), attention_mask=np.ones(3)), npt.NDArray[Any] | list[npt.NDArray[Any] | None] | dict[str, npt.NDArray[Any]])
with c.tap("layer*", reducers=["moments", {"histogram": {"bins": 8}}], ttl=300) as handle:
    assert_type(handle, layertap.TapHandle)
assert_type(c.watch("layer*", every=2, queue_size=8), layertap.SummaryStream)
c.create_tap("layer*", nme="typo")  # ERROR
c.watch("layer*", ttl=5)  # ERROR
"""


def test_public_signatures_type_check(tmp_path: Path) -> None:
    api = pytest.importorskip("mypy.api")
    # mypy cannot follow the editable install's import hook: give it the
    # package under its installed name.
    (tmp_path / "path").mkdir()
    os.symlink(CLIENT_DIR, tmp_path / "path" / "layertap")
    snippet = tmp_path / "snippet.py"
    snippet.write_text(SNIPPET)
    env_path = os.environ.get("MYPYPATH")
    os.environ["MYPYPATH"] = str(tmp_path / "path")
    try:
        out, err, _ = api.run([
            "--strict", "--no-incremental", "--python-version", "3.11",
            "--config-file", str(PYPROJECT), "--no-error-summary", str(snippet),
        ])
    finally:
        if env_path is None:
            del os.environ["MYPYPATH"]
        else:
            os.environ["MYPYPATH"] = env_path
    errors = [line for line in out.splitlines() if ": error:" in line]
    expected = [i for i, line in enumerate(SNIPPET.splitlines(), 1) if line.endswith("# ERROR")]
    assert [int(line.split(":")[1]) for line in errors] == expected, textwrap.indent(out + err, "  ")
    assert all("[call-arg]" in line for line in errors), out
