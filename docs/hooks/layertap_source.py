"""MkDocs hook: let mkdocstrings read the `layertap` package from its sources.

The `layertap` package lives in `client/` (pyproject.toml maps it with
`package-dir`), and the editable install finds it with an import hook. griffe,
which mkdocstrings uses to read docstrings, looks for a `layertap/` folder on its
search paths; it does not find one, and falls back to importing the package and
inspecting the live objects, where a type alias such as `layertap.Prompt` is
just `typing.Union` and cannot be documented. This hook lays out a temporary
folder holding a `layertap` link to `client/` and puts it first on the python
handler's search paths, so griffe reads the sources statically.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority

_made: list[Path] = []


@event_priority(100)  # before mkdocstrings' own on_config, which creates the handler
def on_config(config: Any) -> Any:
    root = Path(config.config_file_path).resolve().parent
    folder = Path(tempfile.mkdtemp(prefix="layertap-docs-"))
    (folder / "layertap").symlink_to(root / "client", target_is_directory=True)
    _made.append(folder)
    mkdocstrings = config.plugins["mkdocstrings"]
    python = mkdocstrings.config.handlers.setdefault("python", {})
    python["paths"] = [str(folder), *python.get("paths", [])]
    return config


def on_shutdown() -> None:
    while _made:
        shutil.rmtree(_made.pop(), ignore_errors=True)
