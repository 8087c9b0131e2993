"""The ``layertap`` command line: a thin shell over :class:`layertap.Client`.

One module per command group, each with an ``add_<name>_command`` that
:mod:`.parser` calls to build the argparse tree and a handler it sets as
``func``: :mod:`.listing` (layers, taps, stats), :mod:`.capture`,
:mod:`.watch`, :mod:`.drift` (baseline, drift), :mod:`.infer`,
:mod:`.generate`, :mod:`.explain`, :mod:`.profile`, :mod:`.tensorboard`,
:mod:`.incidents`, :mod:`.tokens` (token new) and :mod:`.passthrough` (serve,
demo). The parts they share: :mod:`.args` (argument types, the connection),
:mod:`.input` (model inputs), :mod:`.json_lines` (``--json``), :mod:`.table`
and :mod:`.view` (what rich draws), :mod:`.errors` (the one-line error).

``serve`` and ``demo`` hand their arguments to the server package, imported
only then, so the base install (no torch) runs every other command.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

from .._errors import LayertapError
from .args import PROG
from .capture import _cmd_capture as _cmd_capture  # re-exported: tests compare a parsed `func` with it
from .errors import error_line
from .listing import _cmd_stats as _cmd_stats  # re-exported, as _cmd_capture
from .listing import _cmd_taps as _cmd_taps  # re-exported, as _cmd_capture
from .parser import build_parser, parse_args
from .view import SPARK_WIDTH, sparkline

__all__ = ["SPARK_WIDTH", "build_parser", "main", "parse_args", "run", "sparkline"]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit code (errors: one line on stderr, code 1)."""
    args = parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader downstream stopped reading (`layertap watch ... | head`):
        # that ends the output, it is not an error. Point stdout at devnull so
        # the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (LayertapError, OSError, ValueError) as exc:
        print(f"{PROG}: error: {error_line(exc)}", file=sys.stderr)
        return 1


def run() -> None:
    """The console script's entry: :func:`main`, then leave the process.

    A server started by ``serve`` or ``demo`` may still be inside a reducer
    compile when it has stopped: a cold one takes up to ~20 s, past any stop
    grace, and cannot be interrupted, while a thread left inside inductor's
    C++ at interpreter exit aborts the process. So when one still runs, the
    process leaves with ``os._exit`` after flushing (inductor's compile
    workers exit with their parent). Only here, never in :func:`main`, which
    in-process callers use. It asks the server's named exit check
    (``layertap.server.cli.settled``) only when ``serve`` or ``demo`` loaded
    the server: the thin client never imports it.
    """
    rc = main()
    server_cli = sys.modules.get("layertap.server.cli")
    if server_cli is not None and not server_cli.settled(0.5):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)
