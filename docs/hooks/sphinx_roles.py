"""griffe extension: show the docstrings' Sphinx roles as code.

The client's docstrings name other objects with Sphinx roles
(``:meth:`close` ``, ``:class:`~layertap.Incidents` ``), which Markdown would
print as they are. This turns each into a code span of the name (the last part
after a ``~``, as Sphinx shows it), so the API reference reads as the source
means it. Loaded by mkdocstrings (mkdocs.yml, the python handler's extensions).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:meth|func|class|exc|attr|mod|data|obj|const):`(~?)([^`]+)`")


def _plain(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class SphinxRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_plain, obj.docstring.value)
