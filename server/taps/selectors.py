"""Layer selectors: exact names, globs and ``re:`` regexes over ``named_modules()``.

In a glob, ``*`` and ``?`` stay within one dotted level and ``**`` crosses
levels: ``layer*`` matches ``layer1``..``layer4``; ``layer*.*`` their blocks.

Selectors arrive from the network, so matching must take linear time: Python's
``re`` backtracks catastrophically (``"**" * 30 + "!"`` froze the whole
process while holding the GIL). Globs and ``re:`` patterns both compile with
RE2, which guarantees time linear in the input and bounded memory, and a
pattern RE2 cannot compile (backreferences, lookaround) is refused.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import re2

from layertap.server.errors import InvalidField, echo, no_layer_matches, unknown_layer

GLOB_CHARS = frozenset("*?[")
#: Longest selector accepted, in UTF-8 bytes. Layer names of real models are
#: far shorter; the cap bounds compile, match and "did you mean" costs.
MAX_SELECTOR_BYTES = 1024
#: RE2's memory budget per compiled selector (its default is 8 MiB).
_RE2_MAX_MEM = 4 << 20


def glob_to_regex(pattern: str, field: str = "selector") -> str:
    """Translate a dotted-name glob into an RE2 regex (matched whole)."""
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
                raise InvalidField(field, f"unclosed '[' in glob {echo(pattern)}")
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


def _compile(pattern: str, selector: str, field: str, kind: str) -> "re2._Regexp":
    options = re2.Options()
    options.max_mem = _RE2_MAX_MEM
    options.log_errors = False
    try:
        return re2.compile(pattern, options)
    except re2.error as exc:
        why = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise InvalidField(field, f"bad {kind} {echo(selector)}: {why[:200]} (RE2 syntax: no backreferences or lookaround)") from None


def select_layers(selector: str, names: Sequence[str], field: str = "selector",
                  max_bytes: int | None = MAX_SELECTOR_BYTES) -> list[str]:
    """Names matching ``selector``, in model order.

    ``max_bytes=None`` lifts the size cap for selectors the server writes
    itself (a reloaded baseline names each of its layers); RE2 keeps those
    linear too.

    Raises:
        InvalidField: empty, too long or malformed selector.
        NotFound: nothing matched; the message lists close names.
    """
    if not selector:
        raise InvalidField(field, "empty selector; give a layer name, a glob such as 'layer*' or 're:<regex>'")
    size = len(selector.encode("utf-8", errors="surrogatepass"))
    if max_bytes is not None and size > max_bytes:
        raise InvalidField(field, f"selector is {size} bytes, the limit is {max_bytes}")
    if selector.startswith("re:"):
        rx = _compile(selector[3:], selector, field, "regex")
        matched = [n for n in names if rx.fullmatch(n)]
    elif GLOB_CHARS & set(selector):
        rx = _compile(glob_to_regex(selector, field), selector, field, "glob")
        matched = [n for n in names if rx.fullmatch(n)]
    else:
        matched = [n for n in names if n == selector]
        if not matched:
            raise unknown_layer(selector, names, field)
    if not matched:
        probe = re.sub(r"^re:|[*?\[\]^$\\]", "", selector)
        raise no_layer_matches(selector, probe, names, field)
    return matched
