"""glibc malloc settings a serving process may opt into (``--malloc-tuning``): keep freed memory for the next pass.

Why: with glibc's defaults, a CPU forward pass may give its activations back
to the kernel when they are freed and page-fault fresh zeroed pages for the
next pass. glibc's threshold for serving a block from ``mmap`` adapts upwards
(to 32 MiB) as blocks are freed, and the heap top is trimmed back to the
kernel whenever more than twice that is free, so whether a process pays
depends on its allocation history. Measured on the 2-vCPU VM, demo model,
batch 32, in a process that paid: a forward took 6.4 ms with the defaults and
4.6 ms tuned, a 200-layer ``/metrics`` render 5.9 -> 4.8 ms. A real
``layertap serve`` happened not to pay (no measurable change). Setting either
value turns glibc's adaptation off, so both are set (the trim threshold alone
made forwards 2x slower: every block above 128 KiB went back to ``mmap``),
and the mmap threshold is glibc's own adaptive ceiling, 32 MiB: a fixed lower
one made 16-32 MiB activations fault on every pass.

Why opt-in: the cost is resident memory. Freed heap at the top of each malloc
arena (up to 8 per core) stays mapped up to :data:`TRIM_THRESHOLD`, so threads
that serve large requests keep more: a review measured 16 threads doing 10 MB
requests keeping 650-960 MiB tuned against 300-530 MiB untuned. PyTorch's
CPU tuning guides reach the same end by preloading jemalloc or tcmalloc; a
process that does, or that sets glibc's own malloc variables, is left as it
is. Never applied to a training job that attaches an agent.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading
from collections.abc import Callable

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "TRIM_DELAY", "trim_free_memory", "trim_soon", "tune_malloc"]

log = logging.getLogger("layertap.server")

#: Blocks below this come from the heap, never a fresh ``mmap``: glibc's own adaptive ceiling.
MMAP_THRESHOLD = 32 << 20
#: Free heap kept at the top of each arena before glibc returns it to the kernel.
TRIM_THRESHOLD = 64 << 20
# mallopt parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_PRELOADED = ("jemalloc", "tcmalloc", "mimalloc")


def _glibc() -> bool:
    # platform.libc_ver() falls back to reading sys.executable, which can fail (musl).
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION")  # None where unset: not glibc
        return version is not None and version.startswith("glibc")
    except (AttributeError, ValueError, OSError):
        return False


def _users_own_settings() -> bool:
    if any(name.startswith("MALLOC_") and name.endswith("_") for name in os.environ):
        return True
    return "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "")


def tune_malloc() -> str | None:
    """Sets glibc's mmap and trim thresholds for this process; returns why not when it does not.

    Returns:
        None when applied; else the reason it was left alone (not glibc, an
        allocator preloaded, the user's own settings, mallopt refused).
    """
    if platform.system() != "Linux" or not _glibc():
        return "not glibc"
    if _users_own_settings():
        return "malloc settings from the environment"
    if any(name in os.environ.get("LD_PRELOAD", "") for name in _PRELOADED):
        return "another allocator is preloaded"
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return "no mallopt in libc.so.6"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "mallopt refused the values"
    return None


#: Seconds :func:`trim_soon` waits, so that many streams ending together cost one trim.
TRIM_DELAY = 1.0
_trim_lock = threading.Lock()
_trim_timer: threading.Timer | None = None
_malloc_trim: Callable[[int], int] | None = None


def trim_free_memory() -> bool:
    """Gives the free memory of every glibc malloc arena back to the kernel (``malloc_trim(0)``).

    Why: memory that many threads freed (gRPC workers, the host-transfer
    thread) stays in their arenas. Measured on the 2-vCPU VM: after 30 wide
    subscribers left, the server kept hundreds of MiB it no longer used
    until trimmed (docs/benchmarks.md, session 9).

    Returns:
        False where there is no glibc ``malloc_trim`` (nothing was done).
    """
    global _malloc_trim
    if _malloc_trim is None:
        if platform.system() != "Linux" or not _glibc():
            return False
        try:
            fn = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            return False
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
        _malloc_trim = fn
    _malloc_trim(0)
    return True


def trim_soon(delay: float = TRIM_DELAY) -> None:
    """Trims :data:`TRIM_DELAY` seconds from now on a daemon timer; calls meanwhile share that trim.

    Never blocks the caller: a trim walks every arena and takes their locks.
    """
    global _trim_timer
    with _trim_lock:
        if _trim_timer is not None:
            return
        _trim_timer = threading.Timer(delay, _run_trim)
        _trim_timer.name = "layertap-trim"
        _trim_timer.daemon = True
        _trim_timer.start()


def _run_trim() -> None:
    global _trim_timer
    with _trim_lock:
        _trim_timer = None
    try:
        trim_free_memory()
    except Exception:  # reclaiming memory is best effort
        log.debug("malloc_trim failed", exc_info=True)
