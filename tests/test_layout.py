"""The layout keeps its shape: no import cycles, no module that does everything.

The checks read the source with ``ast`` (nothing is imported), so they hold
for imports under ``TYPE_CHECKING`` and inside functions too. Two graphs are
checked: modules, and the server's stages (its folders and root modules),
which ``docs/design.md`` draws and this file prints.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
#: Source tree -> the import name it installs as (see setup.py).
TREES = {REPO / "client": "layertap", REPO / "server": "layertap.server"}
GENERATED = REPO / "client" / "v1"
#: Hand-written modules stay small enough to have one job.
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for root, name in TREES.items():
        for path in root.rglob("*.py"):
            if GENERATED in path.parents:
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([name, *parts])] = path
    return out


def _imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The layertap modules ``module`` imports, resolved to module names."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return {m for m in found if m in known and m != module}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    known = _modules()
    graph = {m: _imports(m, p, known) for m, p in known.items()}
    assert graph["layertap.server.app"], "the resolver found no imports: the test is broken"
    assert _cycles(graph) == []


SERVER = "layertap.server"
DESIGN = REPO / "docs" / "design.md"
#: The only stages that wire others together: they may import ``app``.
ASSEMBLERS = {"app", "cli", "train"}


def _stage(module: str) -> str | None:
    """``layertap.server.taps.engine`` -> ``taps``; a root module is its own stage; None outside the server."""
    if not module.startswith(SERVER + "."):
        return None
    return module[len(SERVER) + 1:].split(".")[0]


def stage_graph() -> dict[str, set[str]]:
    """Stage -> the stages it imports (``TYPE_CHECKING`` and function-level imports included)."""
    known = _modules()
    out: dict[str, set[str]] = {}
    for module, path in known.items():
        here = _stage(module)
        if here is None:
            continue
        deps = out.setdefault(here, set())
        deps.update(s for m in _imports(module, path, known) if (s := _stage(m)) not in (None, here))
    return out


def render_stage_graph(graph: dict[str, set[str]]) -> str:
    return "\n".join(f"{stage:<14} -> {', '.join(sorted(deps)) or '(nothing)'}" for stage, deps in sorted(graph.items()))


def _documented_graph() -> str:
    text = DESIGN.read_text()
    start = text.index("<!-- stage-graph -->")
    block = text[start:].split("```", 2)[1]
    return block.removeprefix("text").strip("\n")


def test_stage_graph_has_no_cycle_and_matches_the_design_doc() -> None:
    graph = stage_graph()
    print(render_stage_graph(graph))
    assert {"host", "taps", "reducers", "stream", "export", "drift", "rpc", "app"} <= graph.keys()
    assert _cycles(graph) == []
    assert render_stage_graph(graph) == _documented_graph(), (
        "docs/design.md's stage graph is stale; paste this under <!-- stage-graph -->:\n" + render_stage_graph(graph))


def test_only_assemblers_wire_stages() -> None:
    graph = stage_graph()
    assert {s for s, deps in graph.items() if "cli" in deps} == set(), "no stage imports the server's CLIs"
    assert {s for s, deps in graph.items() if "app" in deps} <= ASSEMBLERS


def test_stream_names_nothing_from_taps() -> None:
    assert "taps" not in stage_graph()["stream"]


def test_cycle_detector_sees_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_client_never_imports_the_server() -> None:
    known = _modules()
    for module, path in known.items():
        if not module.startswith("layertap.server"):
            bad = {m for m in _imports(module, path, known) if m.startswith("layertap.server")}
            assert not bad, f"{module} imports {bad}: the thin client must install without torch"


def _source_files() -> list[Path]:
    """Python files git tracks or would track (build output and venvs are ignored)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [REPO / line for line in out.splitlines() if (REPO / line).exists()]


def test_hand_written_modules_stay_small() -> None:
    skip = (REPO / "tests", GENERATED)
    sizes = {
        str(p.relative_to(REPO)): len(p.read_text().splitlines())
        for p in _source_files()
        if not any(s in p.parents for s in skip)
    }
    assert "server/app.py" in sizes
    assert {path: n for path, n in sizes.items() if n > MAX_LINES} == {}


_LAYOUT_TOKEN = re.compile(r"(?<![\w./-])((?:server|client)/(?:[\w]+/)*|(?:(?:server|client)/(?:[\w]+/)*)?\w+\.py)(?![\w])")


def documented_modules() -> set[str]:
    """Repo-relative paths of the modules ``docs/design.md``'s layout block names.

    A ``server/x/`` token sets the folder that bare ``name.py`` tokens after it
    belong to; a token with a slash (``server/app.py``) names its own folder.
    """
    text = DESIGN.read_text()
    block = text[text.index("## Layout"):].split("```", 2)[1]
    named: set[str] = set()
    folder = ""
    for token in _LAYOUT_TOKEN.findall(block):
        if token.endswith("/"):
            folder = token
        elif "/" in token:
            named.add(token)
            folder = token.rpartition("/")[0] + "/"
        else:
            named.add(folder + token)
    return named


def test_the_design_doc_names_every_module_and_only_real_ones() -> None:
    real = {str(p.relative_to(REPO)) for p in _modules().values() if p.name != "__init__.py"}
    named = documented_modules()
    assert "server/taps/engine.py" in named and "client/_client.py" in named, "the layout parser is broken"
    assert sorted(real - named) == [], "modules docs/design.md's layout leaves out"
    assert sorted(named - real) == [], "modules docs/design.md's layout names that do not exist"


#: Calls that build a mutable container (as literals do).
_CONTAINERS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque", "WeakValueDictionary",
               "WeakKeyDictionary", "WeakSet"}


def _folder(module: str) -> str:
    """The folder a module lives in: ``layertap.server.taps`` for ``layertap.server.taps.engine``."""
    return module.rpartition(".")[0]


def _project_classes(known: dict[str, Path]) -> set[str]:
    return {node.name for path in known.values() for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef)}


def module_level_mutables(path: Path, classes: set[str]) -> set[str]:
    """Names a module binds at its top level to a mutable instance: a project class's, a dict, a list or a set.

    ``Final`` names are left out: the annotation says the binding is not a place to share state through.
    """
    out: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.AnnAssign):
            if "Final" in ast.unparse(node.annotation) or node.value is None:
                continue
            targets, value = [node.target], node.value
        elif isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        else:
            continue
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp))
        if isinstance(value, ast.Call):
            func = value.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            mutable = name in _CONTAINERS or name in classes
        if mutable:
            out.update(t.id for t in targets if isinstance(t, ast.Name))
    return out


def shared_mutables() -> list[str]:
    """``importer: module.NAME`` for each module-level mutable instance imported from another folder."""
    known = _modules()
    classes = _project_classes(known)
    mutables = {m: module_level_mutables(p, classes) for m, p in known.items()}
    found: list[str] = []
    for module, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in known and not node.level:
                if _folder(node.module) == _folder(module):
                    continue
                found += [f"{module}: {node.module}.{a.name}" for a in node.names if a.name in mutables[node.module]]
    return sorted(found)


def test_no_module_level_mutable_instance_crosses_folders() -> None:
    """Process-wide state is made by ``app.py`` and handed on (``ProcessCompilation``), never imported."""
    assert shared_mutables() == []


def test_the_mutable_instance_check_sees_one(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("from typing import Final\nclass Passes: ...\nPASSES = Passes()\nTABLE = {}\n"
                      "NAMES: Final = frozenset()\nLIMIT: Final = Passes()\nMAX = 3\n_ON: dict[int, int] = {}\n")
    assert module_level_mutables(module, {"Passes"}) == {"PASSES", "TABLE", "_ON"}
