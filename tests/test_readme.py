"""README's install lines and fresh-machine commands are what users and CI run."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SETUP = REPO / ".ci" / "setup"


def readme_section(title: str) -> str:
    text = (REPO / "README.md").read_text()
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", readme_section("Two commands on a fresh machine"))


def test_readme_has_two_commands_and_ci_runs_them():
    demo, tests = readme_commands()
    ci = (REPO / ".ci" / "run").read_text()
    # The demo needs no test tools (no apt, no npm); the test suite asks for them.
    assert demo.partition(" && ")[0] == "bash .ci/setup"
    assert tests.partition(" && ")[0] == "bash .ci/setup --test"
    for cmd in (demo, tests):
        rest = cmd.partition(" && ")[2]
        assert rest in ci, f".ci/run does not run the README command {rest!r}"
    # CI lints, type-checks and runs the prometheus/promtool tests: it needs the test tools.
    assert re.search(r"^bash \.ci/setup --test$", ci, re.M), ".ci/run must run `bash .ci/setup --test`"


def test_install_section_has_server_and_thin_client_lines():
    blocks = re.findall(r"```bash\n(.+?)\n```", readme_section("Install"), re.S)
    lines = [line.strip() for block in blocks for line in block.splitlines()]
    assert 'python -m pip install "layertap[server]"' in lines
    assert "python -m pip install layertap" in lines
    # torch's CPU wheel comes first, from PyTorch's CPU index, so pip never
    # resolves a bare `torch` (the multi-GB CUDA build on Linux).
    cpu = "python -m pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert cpu in lines and lines.index(cpu) < lines.index('python -m pip install "layertap[server]"')


def _fake_tools(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    """A copy of .ci/setup whose every outside command only logs its arguments.

    The venv python is a logging stand-in too, so nothing is installed and no
    system file (/usr/sbin/policy-rc.d) is touched.
    """
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    (repo / ".ci" / "setup").write_text(SETUP.read_text())
    log = tmp_path / "calls.log"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    logger = f'#!/bin/bash\necho "$(basename "$0") $*" >> {log}\n'
    for tool in ("apt-get", "npm", "sudo", "tee", "chmod", "rm", "python3"):
        (bin_dir / tool).write_text(logger)
    (bin_dir / "id").write_text("#!/bin/bash\necho 0\n")  # root: no sudo, policy-rc.d via the logging tee
    (bin_dir / "dirname").write_text(f"#!/bin/bash\nexec {_which('dirname')} \"$@\"\n")
    (bin_dir / "basename").write_text(f"#!/bin/bash\nexec {_which('basename')} \"$@\"\n")
    venv_bin = repo / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text(logger)
    for path in [*bin_dir.iterdir(), venv_bin / "python"]:
        path.chmod(0o755)
    # No promtool, prometheus or g++ on this PATH: --test must install them.
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    return repo, log, env


def _which(tool: str) -> str:
    for folder in ("/usr/bin", "/bin"):
        if os.access(f"{folder}/{tool}", os.X_OK):
            return f"{folder}/{tool}"
    pytest.skip(f"no {tool}")


def _run_setup(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> list[str]:
    repo, log, base = _fake_tools(tmp_path)
    bash = _which("bash")
    out = subprocess.run([bash, str(repo / ".ci" / "setup"), *args], env={**base, **(env or {})},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return log.read_text().splitlines() if log.exists() else []


def test_setup_for_the_demo_needs_no_apt_npm_or_root(tmp_path):
    calls = _run_setup(tmp_path)
    assert not [c for c in calls if c.split()[0] in ("apt-get", "npm", "sudo", "tee")], calls
    installs = [c for c in calls if c.startswith("python -m pip install") and "-e" in c.split()]
    assert installs == ["python -m pip install --quiet -c constraints-ci.txt -e .[server]"]


@pytest.mark.parametrize(("args", "env"), [(["--test"], {}), ([], {"LAYERTAP_SETUP_TEST": "1"})])
def test_setup_for_tests_adds_prometheus_gcc_dev_extra_and_buf(tmp_path, args, env):
    calls = _run_setup(tmp_path, *args, env=env)
    assert "apt-get install -y --no-install-recommends prometheus g++" in calls
    assert "python -m pip install --quiet -c constraints-ci.txt -e .[server,dev]" in calls
    assert any(c.startswith("npm install") and "@bufbuild/buf" in c for c in calls), calls


def test_setup_rejects_unknown_arguments(tmp_path):
    repo, _log, env = _fake_tools(tmp_path)
    out = subprocess.run([_which("bash"), str(repo / ".ci" / "setup"), "--tests"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "usage" in out.stderr
