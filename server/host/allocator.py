"""glibc malloc settings for a serving process: keep freed memory for the next pass instead of returning it.

Why: with glibc's defaults, a CPU forward pass may give its activations back
to the kernel when they are freed and page-fault fresh zeroed pages for the
next pass. glibc's threshold for serving a block from ``mmap`` adapts upwards
as blocks are freed, and the heap top is trimmed back to the kernel whenever
more than twice that is free, so whether a process pays depends on its
allocation history. Measured on the 2-vCPU VM, demo model, batch 32, in a
process that paid: a forward took 6.4 ms with the defaults and 4.6 ms with the
settings below, a 200-layer ``/metrics`` render 5.9 -> 4.8 ms; a real
``layertap serve`` happened not to pay (no measurable change), and with these
settings none does. Setting either value turns glibc's adaptation off, so both
are set (the trim threshold alone made forwards 2x slower: every block above
128 KiB went back to ``mmap``).

The cost is resident memory: up to :data:`TRIM_THRESHOLD` of freed heap per
arena stays mapped, for reuse. PyTorch's CPU tuning guides reach the same end
by preloading jemalloc or tcmalloc; a process that does, or that sets glibc's
own ``MALLOC_*_`` variables or ``GLIBC_TUNABLES``, is left as it is. Only the
server's own process is tuned (``layertap serve``), never a training job that
attaches an agent.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "tune_malloc"]

log = logging.getLogger("layertap.server")

#: Blocks below this come from the heap, never a fresh ``mmap`` (glibc caps it at 32 MiB).
MMAP_THRESHOLD = 16 << 20
#: Free heap kept per arena before glibc returns its top to the kernel.
TRIM_THRESHOLD = 64 << 20
# mallopt parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def tune_malloc() -> str | None:
    """Sets glibc's mmap and trim thresholds for this process; returns why not when it does not.

    Returns:
        None when applied; else the reason it was left alone (not glibc, an
        allocator preloaded, the user's own settings, mallopt refused).
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not glibc"
    if any(name in os.environ for name in _USER_SETTINGS):
        return "malloc settings from the environment"
    preload = os.environ.get("LD_PRELOAD", "")
    if "jemalloc" in preload or "tcmalloc" in preload or "mimalloc" in preload:
        return "another allocator is preloaded"
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return "no mallopt in libc.so.6"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "mallopt refused the values"
    log.info("malloc: freed memory up to %d MiB per arena is kept for reuse (mmap above %d MiB)",
             TRIM_THRESHOLD >> 20, MMAP_THRESHOLD >> 20)
    return None
