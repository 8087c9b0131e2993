"""Every test carries exactly one tier marker: the conftest hook fails a run that has one without."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytest_plugins = ("pytester",)
pytestmark = pytest.mark.unit

_CONFTEST = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("layertap_conftest", {str(REPO / "tests" / "conftest.py")!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
pytest_collection_modifyitems = module.pytest_collection_modifyitems
"""


@pytest.mark.parametrize(("marks", "ok"), [("@pytest.mark.unit", True), ("@pytest.mark.slow", True), ("", False),
                                           ("@pytest.mark.unit\n@pytest.mark.e2e", False)])
def test_a_run_needs_exactly_one_tier_per_test(pytester: pytest.Pytester, marks: str, ok: bool) -> None:
    pytester.makeconftest(_CONFTEST)
    pytester.makepyfile(f"import pytest\n\n{marks}\ndef test_x():\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "-W", "ignore::pytest.PytestUnknownMarkWarning")
    if ok:
        result.assert_outcomes(passed=1)
    else:
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines(["*exactly one tier marker*"])
