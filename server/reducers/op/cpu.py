"""The op's CPU kernel: ``tap_stats.c``, built at first use and called through ctypes.

Why built here and not at install: the package stays pure Python (one wheel
for every platform), and a C compiler is already what inductor needs on CPU.
The library is cached by the source's hash under ``$LAYERTAP_CACHE_DIR``
(default ``~/.cache/layertap``), so it builds once per machine in about a
second. Without a compiler :func:`load` returns None and the op runs
:func:`~.reference.reference_stats` instead, the same numbers in aten ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
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


def cache_dir() -> Path:
    return Path(os.environ.get("LAYERTAP_CACHE_DIR") or Path.home() / ".cache" / "layertap")


class CpuKernel:
    """The loaded C function with its argument types set."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.layertap_tap_stats
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
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
        nd = x.dim()
        dims = (ctypes.c_int64 * (2 * nd))(*x.shape, *x.stride())
        rc = self._fn(x.data_ptr(), DTYPE_CODES[x.dtype], nd, dims, ctypes.addressof(dims) + 8 * nd,
                      out.data_ptr(), out.shape[0], row.data_ptr(), flag.data_ptr(),
                      None if mask is None else mask.data_ptr(), mask_inner)
        if rc == 1:
            raise ValueError(f"tap_stats: x has {nd} dims, at most {MAX_DIMS} are read")
        if rc == 2:
            raise ValueError(f"tap_stats: row is not a row of out ({out.shape[0]} rows)")


@functools.cache
def load() -> CpuKernel | None:
    """The compiled kernel, built on first call; None when no C compiler could build it."""
    source = _SOURCE.read_bytes()
    name = f"tap_stats-{hashlib.sha256(source).hexdigest()[:16]}.so"
    # A read-only home (some containers) falls back to the temp dir.
    for folder in (cache_dir(), Path(tempfile.gettempdir()) / f"layertap-{os.getuid()}"):
        target = folder / name
        if target.exists() or _build(target):
            return CpuKernel(ctypes.CDLL(str(target)))
    return None


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
        subprocess.run([compiler, "-O3", "-shared", "-fPIC", "-o", tmp, str(_SOURCE), "-lm"],
                       check=True, capture_output=True, timeout=120)
        os.replace(tmp, target)
        return True
    except (OSError, subprocess.SubprocessError) as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        detail = getattr(exc, "stderr", b"") or b""
        log.warning("could not build the CPU tap kernel in %s (%s %s): tap statistics run in aten ops",
                    target.parent, exc, detail.decode(errors="replace")[-500:])
        return False
