"""The CLI's one-line error: the client's hints name Python arguments, the CLI's user needs flags.

A hint (:attr:`LayertapError.hint`) is written for the Python API, e.g.
"pass input= for an active capture, or a longer timeout=". The CLI prints the
same error with each such argument replaced by the flag that sets it; the
server's own message (``details``) is left as it came.
"""

from __future__ import annotations

import re

from .._errors import LayertapError

__all__ = ["CLI_FLAGS", "cli_hint", "error_line"]

#: A Python keyword argument named in a hint -> the CLI's flag for it.
CLI_FLAGS = {
    "input": "--input FILE (or --random-input)",
    "timeout": "--timeout SECONDS",
    "prompt": "--ids ID,ID,...",
    "max_new_tokens": "--max-new-tokens N",
}

_ARGUMENT = re.compile(r"\b(" + "|".join(CLI_FLAGS) + r")=")


def cli_hint(hint: str) -> str:
    """``hint`` with every ``name=`` of :data:`CLI_FLAGS` replaced by its flag."""
    return _ARGUMENT.sub(lambda m: CLI_FLAGS[m.group(1)], hint)


def error_line(exc: BaseException) -> str:
    """The message the CLI prints after ``layertap: error:``, on one line."""
    if isinstance(exc, LayertapError):
        text = "; ".join(part for part in (exc.details, cli_hint(exc.hint)) if part)
        message = f"{text} [{exc.code}]" if text else exc.code
    else:
        message = str(exc)
    return " ".join(message.split())
