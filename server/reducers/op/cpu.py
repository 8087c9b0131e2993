"""The op's CPU kernel: ``tap_stats_op.cpp`` (around ``tap_stats.c``), built at first use and registered
with the dispatcher.

Why built here and not at install: the package stays pure Python (one wheel
for every platform), and a C++ compiler is already what inductor needs on
CPU. Why C++ and not a Python kernel: a firing's host cost is the product,
and a kernel registered in C++ is reached from ``torch.ops`` in about 1.3 us,
against 6 us through a Python kernel (the dispatcher wraps every argument
back into Python). It includes only ``torch/library.h`` and
``ATen/core/Tensor.h``, so it builds in about 5 s. It is built with
``-march=native`` (the statistics loop runs on the machine's widest SIMD)
and cached by the sources', the torch build's and the CPU's hash under
``$LAYERTAP_CACHE_DIR`` (default ``~/.cache/layertap``, else the temp dir),
once per machine. Without a compiler or torch's headers :func:`load` says
so once and the op runs :func:`~.reference.reference_stats`, the same
numbers in aten ops.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

__all__ = ["cache_dir", "load"]

log = logging.getLogger("layertap.server")

_HERE = Path(__file__).parent
_SOURCES = (_HERE / "tap_stats_op.cpp", _HERE / "tap_stats.c")


def cache_dir() -> Path:
    return Path(os.environ.get("LAYERTAP_CACHE_DIR") or Path.home() / ".cache" / "layertap")


def _machine() -> str:
    """What the build depends on beyond the sources: torch's build, the architecture, the CPU's flags.

    A cache directory shared by machines of different CPUs (a network home) then holds one build each."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{torch.__version__} {torch.__file__} {platform.machine()} {flags}"


@functools.cache
def load() -> bool:
    """Builds (once per machine) and loads the kernel; False when it could not be built."""
    # This file too: it holds the build's flags.
    sources = b"".join(p.read_bytes() for p in (*_SOURCES, Path(__file__)))
    digest = hashlib.sha256(sources + _machine().encode()).hexdigest()[:16]
    name = f"tap_stats_op-{digest}.so"
    # A read-only home (some containers) falls back to the temp dir.
    for folder in (cache_dir(), Path(tempfile.gettempdir()) / f"layertap-{os.getuid()}"):
        target = folder / name
        if target.exists() or _build(target):
            try:
                torch.ops.load_library(str(target))  # type: ignore[no-untyped-call]
            except OSError as exc:
                log.warning("could not load the CPU tap kernel %s (%s): tap statistics run in aten ops", target, exc)
                return False
            return True
    return False


def _build(target: Path) -> bool:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        log.warning("no C++ compiler found: tap statistics run in aten ops on CPU (slower)")
        return False
    from torch.utils import cpp_extension  # noqa: PLC0415 - only to build, once per machine

    torch_lib = Path(torch.__file__).parent / "lib"
    # OpenMP as torch's own (AT_PARALLEL_OPENMP): at::parallel_for then runs on torch's intra-op threads,
    # and libgomp.so.1 resolves to the copy torch loaded (torch/lib, first on the path).
    common = ["-O3", "-shared", "-fPIC", "-w", "-fopenmp", "-DAT_PARALLEL_OPENMP=1",
              *(f"-I{p}" for p in cpp_extension.include_paths()),
              f"-I{_HERE}", str(_SOURCES[0]), f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Built beside the target and renamed: processes building at once never load half a file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        # Native first (the SIMD loop); a compiler that does not know the flag builds the portable code.
        done = None
        for extra in (["-march=native", "-std=c++20"], ["-std=c++20"], ["-std=c++17"]):
            done = subprocess.run([compiler, *extra, *common, "-o", tmp], capture_output=True, timeout=300)
            if done.returncode == 0:
                break
        assert done is not None
        done.check_returncode()
        os.replace(tmp, target)
        return True
    except (OSError, subprocess.SubprocessError) as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        detail = getattr(exc, "stderr", b"") or b""
        log.warning("could not build the CPU tap kernel in %s (%s %s): tap statistics run in aten ops",
                    target.parent, exc, detail.decode(errors="replace")[-800:])
        return False
