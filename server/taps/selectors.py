"""Layer selectors: exact names, globs and ``re:`` regexes over ``named_modules()``.

In a glob, ``*`` and ``?`` stay within one dotted level and ``**`` crosses
levels: ``layer*`` matches ``layer1``..``layer4``; ``layer*.*`` their blocks.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from layertap.server.errors import LAYER_HINT, InvalidSpec, NotFound, close_names, unknown_layer

GLOB_CHARS = frozenset("*?[")


def glob_to_regex(pattern: str) -> str:
    """Translate a dotted-name glob into an anchored regex."""
    out = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append(r"[^.]*")
        elif c == "?":
            out.append(r"[^.]")
        elif c == "[":
            end = pattern.find("]", i + 1)
            if end == -1:
                raise InvalidSpec("selector", f"unclosed '[' in glob {pattern!r}")
            body = pattern[i + 1 : end]
            if body.startswith("!"):
                body = "^" + body[1:]
            out.append(f"[{body}]")
            i = end + 1
            continue
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def select_layers(selector: str, names: Sequence[str], field: str = "selector") -> list[str]:
    """Names matching ``selector``, in model order.

    Raises:
        InvalidSpec: empty selector or bad pattern.
        NotFound: nothing matched; the message lists close names.
    """
    if not selector:
        raise InvalidSpec(field, "empty selector; give a layer name, a glob such as 'layer*' or 're:<regex>'")
    if selector.startswith("re:"):
        try:
            rx = re.compile(selector[3:])
        except re.error as exc:
            raise InvalidSpec(field, f"bad regex {selector[3:]!r}: {exc}") from None
        matched = [n for n in names if rx.fullmatch(n)]
    elif GLOB_CHARS & set(selector):
        rx = re.compile(glob_to_regex(selector))
        matched = [n for n in names if rx.fullmatch(n)]
    else:
        matched = [n for n in names if n == selector]
        if not matched:
            raise unknown_layer(selector, names)
    if not matched:
        probe = re.sub(r"^re:|[*?\[\]^$\\]", "", selector)
        raise NotFound(f"selector {selector!r} matches no layer{close_names(probe, names)} {LAYER_HINT}")
    return matched
