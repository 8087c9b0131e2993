"""README's install lines and fresh-machine commands are what users and CI run; what README and the
docs pages show to copy (links, Python examples, CLI lines) names things that exist."""

from __future__ import annotations

import argparse
import ast
import inspect
import os
import re
import subprocess
from pathlib import Path

import pytest

import layertap

pytestmark = pytest.mark.unit

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


# ------------------------------------------------------------------ the README's links and the docs' examples
#
# README is a quickstart; the rest lives in docs/ (the mkdocs site, tests/test_docs_site.py). What a
# newcomer copies from either must name things that exist: pages and headings, layertap's public names
# and Client methods, and CLI commands with their flags.

DOCS = REPO / "docs"
#: Pages whose examples are checked. The benchmark pages quote old runs' commands as they were, and
#: docs/design.md shows no commands to copy.
EXAMPLE_PAGES = [REPO / "README.md", *sorted(p for p in DOCS.glob("*.md")
                                            if not p.name.startswith(("bench", "design")))]


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension (mkdocs) and GitHub give an ASCII heading."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "").strip().lower())
    return re.sub(r"[\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_readme_links_reach_pages_and_headings_that_exist():
    text = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links, "README links to the rest of the docs"
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = REPO / path
        assert target.is_file(), f"README links to {link}, which does not exist"
        if anchor:
            assert anchor in _anchors(target), f"README links to {link}: {path} has no heading with that anchor"
    linked = {link.partition("#")[0] for link in links}
    assert "docs/index.md" in linked and "docs/api.md" in linked


def _code_blocks(page: Path, langs: tuple[str, ...]) -> list[str]:
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", page.read_text(), re.S | re.M)
    return [body for lang, body in blocks if lang in langs]


def test_python_examples_name_public_api_and_real_client_methods():
    client_methods = {name for name in dir(layertap.Client) if not name.startswith("_")}
    client_params = inspect.signature(layertap.Client).parameters
    checked = 0
    for page in EXAMPLE_PAGES:
        for block in _code_blocks(page, ("python",)):
            tree = ast.parse(block)  # a SyntaxError names the page's example
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                    where = f"{page.relative_to(REPO)}: {node.value.id}.{node.attr}"
                    if node.value.id == "layertap":
                        assert node.attr in layertap.__all__, f"{where} is not public API (layertap.__all__)"
                        checked += 1
                    elif node.value.id == "client":
                        assert node.attr in client_methods, f"{where}: Client has no such method"
                        checked += 1
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "layertap"
                        and node.func.attr == "Client"):
                    for kw in node.keywords:
                        assert kw.arg in client_params, f"{page.relative_to(REPO)}: Client() has no {kw.arg}="
    assert checked > 20


def _cli_parsers() -> dict[str, argparse.ArgumentParser]:
    from layertap.cli import build_parser
    from layertap.server.cli import drift_demo, serve

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    # serve and demo hand their arguments to the server package's own parsers.
    return {**commands, "serve": serve.build_parser(), "demo": drift_demo.build_parser()}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """The option strings of a command and of its subcommands (`incidents HOST get`, `token new`)."""
    found = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _options(sub)
    return found


def _shell_parts(line: str) -> list[str]:
    """A shell line cut at `&&`, `;` and pipes, but not at the `|` of a usage line's `[a | b]`."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(line):
        depth += {"[": 1, "]": -1}.get(char, 0)
        for sep in (" && ", " | ", "; "):
            if depth == 0 and line.startswith(sep, i):
                parts.append(line[start:i])
                start = i + len(sep)
    return [*parts, line[start:]]


def _layertap_commands(page: Path) -> list[str]:
    """Each `layertap ...` command in the page's shell blocks, cut at pipes, `&&` and comments."""
    found = []
    for block in _code_blocks(page, ("bash", "sh", "console", "")):
        for line in block.replace("\\\n", " ").splitlines():
            for part in _shell_parts(line.split(" # ", 1)[0]):
                words = part.strip().removeprefix("$ ").split()
                if words and words[0].rpartition("/")[2] == "layertap":
                    found.append(" ".join(words[1:]))
    return found


def test_cli_examples_name_real_commands_and_flags():
    parsers = _cli_parsers()
    checked = 0
    for page in EXAMPLE_PAGES:
        for command in _layertap_commands(page):
            name = command.split()[0] if command else ""
            where = f"{page.relative_to(REPO)}: layertap {command}"
            assert name in parsers, f"{where}: no command {name!r}"
            flags = set(re.findall(r"(?<![\w/.:-])(--?[A-Za-z][\w-]*)", command))
            unknown = flags - _options(parsers[name])
            assert not unknown, f"{where}: {sorted(unknown)} not flags of `layertap {name}`"
            checked += 1
    assert checked > 30
