"""The op's CPU kernel: ``tap_stats.c``, built at first use and called through ctypes.

Why built here and not at install: the package stays pure Python (one wheel
for every platform), and a C compiler is already what inductor needs on CPU.
The library is built with ``-march=native`` and cached by the source's and
the CPU's hash under ``$LAYERTAP_CACHE_DIR`` (default ``~/.cache/layertap``),
so it builds once per machine in about a second. Without a compiler :func:`load` returns None and the op runs
:func:`~.reference.reference_stats` instead, the same numbers in aten ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path
from typing import Final

import torch

__all__ = ["DTYPE_CODES", "MAX_DIMS", "CpuKernel", "cache_dir", "load"]

log = logging.getLogger("layertap.server")

#: tap_stats.c's dtype codes: the float dtypes the op reads.
DTYPE_CODES: Final = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}
#: tap_stats.c's MAX_DIMS.
MAX_DIMS = 16
_SOURCE = Path(__file__).with_name("tap_stats.c")
#: ``struct.pack`` of 2 * n int64s, per n.
_PACK: Final = tuple(struct.Struct(f"={2 * n}q").pack for n in range(MAX_DIMS + 1))


def cache_dir() -> Path:
    return Path(os.environ.get("LAYERTAP_CACHE_DIR") or Path.home() / ".cache" / "layertap")


class CpuKernel:
    """The loaded C function with its argument types set."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.layertap_tap_stats
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_char_p,
                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_int64]
        self._fn = fn
        self._lib = lib  # the function lives as long as the library

    def __call__(self, x: torch.Tensor, out: torch.Tensor, row: torch.Tensor, flag: torch.Tensor,
                 mask: torch.Tensor | None, mask_inner: int) -> None:
        """Merges x's statistics into ``out[row]``; the caller checked every argument's dtype and device.

        Raises:
            ValueError: x has more than :data:`MAX_DIMS` dims, or ``row`` is not a row of ``out``.
        """
        shape = x.shape
        nd = len(shape)
        # Sizes then strides, packed as int64s: cheaper than a ctypes array (a per-call object).
        dims = _PACK[nd](*shape, *x.stride()) if nd <= MAX_DIMS else b""
        rc = self._fn(x.data_ptr(), DTYPE_CODES[x.dtype], nd, dims, out.data_ptr(), out.shape[0], row.data_ptr(),
                      flag.data_ptr(), None if mask is None else mask.data_ptr(), mask_inner)
        if rc == 1:
            raise ValueError(f"tap_stats: x has {nd} dims, at most {MAX_DIMS} are read")
        if rc == 2:
            raise ValueError(f"tap_stats: row is not a row of out ({out.shape[0]} rows)")


@functools.cache
def load() -> CpuKernel | None:
    """The compiled kernel, built on first call; None when no C compiler could build it."""
    key = hashlib.sha256(_SOURCE.read_bytes() + _machine().encode()).hexdigest()[:16]
    name = f"tap_stats-{key}.so"
    # A read-only home (some containers) falls back to the temp dir.
    for folder in (cache_dir(), Path(tempfile.gettempdir()) / f"layertap-{os.getuid()}"):
        target = folder / name
        if target.exists() or _build(target):
            return CpuKernel(ctypes.CDLL(str(target)))
    return None


def _machine() -> str:
    """What ``-march=native`` depends on: the architecture and the CPU's feature flags.

    A cache directory shared by machines of different CPUs (a network home) then holds one build each."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()} {flags}"


def _build(target: Path) -> bool:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        log.warning("no C compiler found: tap statistics run in aten ops on CPU (slower)")
        return False
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Built beside the target and renamed: processes building at once never load half a file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        # Native: the vector loop (four float64 lanes) then runs on the machine's widest SIMD; a
        # compiler that does not know the flag builds the portable code.
        for native in (["-march=native"], []):
            done = subprocess.run([compiler, "-O3", *native, "-shared", "-fPIC", "-o", tmp, str(_SOURCE), "-lm"],
                                  capture_output=True, timeout=120)
            if done.returncode == 0:
                break
        done.check_returncode()
        os.replace(tmp, target)
        return True
    except (OSError, subprocess.SubprocessError) as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        detail = getattr(exc, "stderr", b"") or b""
        log.warning("could not build the CPU tap kernel in %s (%s %s): tap statistics run in aten ops",
                    target.parent, exc, detail.decode(errors="replace")[-500:])
        return False
