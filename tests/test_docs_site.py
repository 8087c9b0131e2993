"""The documentation site (mkdocs.yml) builds with --strict, and its API reference covers the public API.

--strict fails the build on a link to a missing page or anchor, a page left out of the nav, and an
API reference entry mkdocstrings cannot resolve. CI builds the site too (.ci/run); this test is the
same check where the suite runs. It needs the [dev] extra's mkdocs-material and mkdocstrings.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import layertap

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent


def _need_mkdocs() -> None:
    """Skip without the site's tools; under CI (CI=true) fail instead, saying how to get them."""
    missing = [m for m in ("mkdocs", "material", "mkdocstrings_handlers.python") if not _installed(m)]
    if not missing:
        return
    message = f"{', '.join(missing)} missing: pip install -c constraints-ci.txt -e '.[dev]'"
    if os.environ.get("CI"):
        pytest.fail(f"CI must build the docs site, but {message}", pytrace=False)
    pytest.skip(message)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def test_api_reference_lists_every_public_name():
    listed = re.findall(r"^::: layertap\.(\w+)$", (REPO / "docs" / "api.md").read_text(), re.M)
    assert len(listed) == len(set(listed)), "docs/api.md lists a name twice"
    assert sorted(set(layertap.__all__) - set(listed)) == [], "public names docs/api.md leaves out"
    assert sorted(set(listed) - set(layertap.__all__)) == [], "names in docs/api.md that are not public"


def test_site_builds_strict_with_the_api_reference(tmp_path):
    _need_mkdocs()
    site = tmp_path / "site"
    # Not --quiet: it hides the warnings --strict counts, and the build then passes anyway.
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                         cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "WARNING" not in out.stderr, out.stderr
    api = (site / "api" / "index.html").read_text()
    for name in layertap.__all__:
        assert f'id="layertap.{name}"' in api, f"the API reference has no entry for layertap.{name}"
    # The docstrings' Sphinx roles read as code, not as raw :meth:`...` text (docs/hooks/sphinx_roles.py).
    assert ":meth:" not in api and ":class:" not in api
    # Every page of docs/ is in the site.
    pages = {p.stem for p in (REPO / "docs").glob("*.md")} - {"index"}
    assert sorted(p for p in pages if not (site / p / "index.html").is_file()) == []
