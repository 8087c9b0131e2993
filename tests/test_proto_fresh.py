"""The committed stubs in client/v1 are exactly what proto/ generates."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_fresh(tmp_path):
    spec = importlib.util.spec_from_file_location("generate", REPO / "proto" / "generate.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    written = gen.generate(tmp_path)
    committed = REPO / "client" / "v1"
    names = sorted(p.name for p in written)
    assert names == sorted(p.name for p in committed.iterdir() if p.is_file() and p.suffix in {".py", ".pyi"})
    stale = [n for n in names if (tmp_path / n).read_bytes() != (committed / n).read_bytes()]
    assert not stale, f"stale generated stubs {stale}: run `python proto/generate.py`"
