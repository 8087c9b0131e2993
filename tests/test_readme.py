"""README's two fresh-machine commands are exactly what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Two commands on a fresh machine", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section)


def test_readme_has_two_commands_and_ci_runs_them():
    cmds = readme_commands()
    assert len(cmds) == 2, cmds
    ci = (REPO / ".ci" / "run").read_text()
    for cmd in cmds:
        setup, _, rest = cmd.partition(" && ")
        assert setup == "bash .ci/setup"
        assert rest in ci, f".ci/run does not run the README command {rest!r}"
    assert "bash .ci/setup" in ci
