"""Telemetry threads yield the CPU to the model: they run at a lower OS priority (Linux nice).

Why: on a CPU host the model's OpenMP team holds every core for the whole
forward (the workers spin between parallel regions). A telemetry thread that
wakes mid-forward takes a core from a worker, and the next parallel region
waits for that worker: measured on the 2-core CPU machine, the host-transfer thread's
~0.1 ms of Python per pass cost the forward several times that, about as
much as the statistics kernels themselves (docs/benchmarks.md). At a higher
nice value the scheduler runs telemetry on idle time first and gives it only
a small share of a contended core, so under full load telemetry falls behind
(its bounded queues drop passes, counted) before inference slows down: the
product's promise that telemetry never slows the model, applied to CPU time.

Linux sets nice per thread (``setpriority`` with a thread id), and threads a
thread starts inherit its value. Elsewhere this is a no-op. Raising nice
needs no privilege; the value is relative to the thread's own, so a server
started under ``nice`` keeps the gap.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable

__all__ = ["DEFAULT_TELEMETRY_NICE", "lower_this_thread", "set_telemetry_nice", "telemetry_nice", "telemetry_thread"]

log = logging.getLogger(__name__)

#: How much nicer than the model thread telemetry threads run by default
#: (``--telemetry-nice``): the most, so a woken model worker takes the core
#: back at once; under full load a nice-19 thread still gets ~1.5% of a
#: core. Measured (docs/benchmarks.md): nice 10 changed nothing against 0,
#: 19 took ~0.05x off the tapped step.
DEFAULT_TELEMETRY_NICE = 19
_MAX_NICE = 19

_nice = DEFAULT_TELEMETRY_NICE


def set_telemetry_nice(nice: int) -> None:
    """Process-wide: the nice increment telemetry threads started from now on take (0: none).

    Raises:
        ValueError: ``nice`` outside 0..19.
    """
    if type(nice) is not int or not 0 <= nice <= _MAX_NICE:
        raise ValueError(f"--telemetry-nice {nice}: expected 0 to {_MAX_NICE}")
    global _nice
    _nice = nice


def telemetry_nice() -> int:
    """The current process-wide increment."""
    return _nice


def lower_this_thread(nice: int | None = None) -> int | None:
    """Raises the calling thread's nice value by ``nice`` (default: :func:`telemetry_nice`).

    Returns:
        The thread's new nice value, or None when nothing changed (0, not
        Linux, or the OS refused).
    """
    step = _nice if nice is None else nice
    if step <= 0 or not sys.platform.startswith("linux"):
        return None
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        target = min(_MAX_NICE, now + step)
        os.setpriority(os.PRIO_PROCESS, tid, target)
    except Exception as exc:  # noqa: BLE001 - a sandbox may forbid it: telemetry still works, at normal priority
        log.debug("could not lower the priority of thread %s: %s", threading.current_thread().name, exc)
        return None
    return target


def telemetry_thread(target: Callable[[], object], name: str) -> threading.Thread:
    """A daemon thread (not started) that runs ``target`` at the telemetry nice value.

    The value is read now, when the owner is built, not when the thread gets
    to run: a setting changed in between (another server built in the same
    process) must not change it.
    """
    nice = _nice

    def run() -> None:
        lower_this_thread(nice)
        target()

    return threading.Thread(target=run, name=name, daemon=True)
