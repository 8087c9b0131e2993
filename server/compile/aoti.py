"""The basic-statistics kernel ahead-of-time compiled (AOTInductor) for dense CPU tensors.

Why: a dynamo-compiled call walks Python layers (guards, AOTAutograd's
runtime wrappers, inductor's Python wrapper allocating a dozen buffers)
around one C++ kernel. On the 2-core CPU machine that was ~25 us of a ~30 us
call on a small tensor, and about twice that inside a forward, where the
model's kernels have evicted it from the caches. AOTInductor compiles the same
:func:`~layertap.server.compile.kernel.basic_stats_body` into a
shared library whose C++ wrapper is called once: measured in the demo model's
hooks, 18.6 us per call against 39.7 us (benchmarks/overhead.py and
docs/benchmarks.md).

Scope: CPU tensors in the ``dense`` form, and the ``batch`` form's stacked
small tensors (:mod:`.batched`). The exported program has one dynamic
dimension, the element count (two for ``batch``: rows and row length);
``rows`` tensors need a dynamic stride, and CUDA is unmeasured here, so
both keep the dynamo kernel. There
are no guards: the caller's signature (dtype, device, form) and
:func:`~layertap.server.compile.kernel.canonical_form` (more than
``SHIFT_SAMPLE`` elements) are the whole contract, and grad, inference and
autocast modes do not reach a library that dispatches nothing.

Packages are cached on disk (``<inductor cache>/layertap-aoti``) under a key
of torch's and Python's versions, the source of the body's module, the host's CPU flags and
C++ toolchain (the code is built for the native CPU) and the signature, so a
restart loads instead of compiling (cold compile ~15-20 s on 2 cores, load
well under a second). A package that does not load is counted and rebuilt
over (an atomic rename, never an unlink first: replicas sharing the volume
never find it missing or lose a package they just wrote), never fatal.
Every load touches the package; packages and leftover temporary files
nobody has loaded for ``STALE_DAYS`` (from older torch versions, older
bodies, or hosts gone from a shared volume) are deleted, once per process,
so the cache does not grow with every upgrade.
"""

from __future__ import annotations

import functools
import getpass
import hashlib
import inspect
import logging
import os
import platform
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from layertap.server.compile.kernel import BATCH, DENSE, SHIFT_SAMPLE, Signature, body_of
from layertap.server.reducers import stats_body

__all__ = ["STALE_DAYS", "AotiKernel", "applies", "cache_dir", "load_or_compile", "package_path", "prune"]

log = logging.getLogger("layertap.server.compiled")

# torch 2.13's export pickles pytree specs through a deprecated isinstance
# check and warns on every compile; nothing here can act on it.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)


def _native_loader() -> Any:
    """torch's C++ package loader, or None (a torch without AOTInductor)."""
    return getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)


def applies(sig: Signature) -> bool:
    """Whether the signature gets the AOTInductor kernel (dense CPU, a torch with AOTInductor).

    Asks the C++ side: touching ``torch._inductor`` imports dynamo and
    inductor, ~70 MiB of resident memory a server that only loads packages
    never needs.
    """
    return sig.device.type == "cpu" and sig.form in (DENSE, BATCH) and _native_loader() is not None


def cache_dir() -> Path:
    """Where packages live: beside inductor's own cache, so one volume keeps both.

    Inductor's default when ``TORCHINDUCTOR_CACHE_DIR`` is unset, worked out
    here rather than imported (see :func:`applies`).
    """
    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not root:
        try:
            user = getpass.getuser()
        except (KeyError, ModuleNotFoundError, OSError):  # no passwd entry (a container's arbitrary uid)
            getuid = getattr(os, "getuid", None)
            user = f"uid_{getuid()}" if callable(getuid) else "unknown_user"
        root = os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
    return Path(root) / "layertap-aoti"


@functools.cache
def _host_build() -> str:
    """What the compiled code depends on beyond torch: inductor builds CPU code
    with ``-march=native``, so a package from another CPU can die of SIGILL on
    its first call (a load would succeed), on a cache volume shared by hosts.

    The CPU's feature flags decide what inductor's vector ISA pick and
    ``-march=native`` can use; the compiler named by ``CXX`` goes in too.
    Nothing here imports inductor (see :func:`applies`).
    """
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            flags = next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return "\n".join([platform.machine(), platform.processor(), flags, os.environ.get("CXX", "")])


def package_path(sig: Signature) -> Path:
    """The package file of a signature; modes are left out (they do not reach the library)."""
    key = "\n".join([torch.__version__, sys.version, inspect.getsource(body_of(sig.form)),
                     inspect.getsource(stats_body),  # and every function the body calls
                     inspect.getsource(_Body), str(SHIFT_SAMPLE), _host_build(),
                     sig.device.type, str(sig.dtype), sig.form])
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return cache_dir() / f"basic_stats-{str(sig.dtype).removeprefix('torch.')}-{sig.form}-{digest}.pt2"


class _Body(torch.nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.body = body_of(form)

    def forward(self, x: torch.Tensor, rnd: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x, rnd, on)
        return out


def _compile(path: Path, example: tuple[torch.Tensor, torch.Tensor, torch.Tensor], form: str = DENSE) -> None:
    """Exports the form's body and writes its package to ``path`` atomically (a rename).

    Dynamic: the element count (dense), or the rows and the row length (batch).
    """
    count = torch.export.Dim("n", min=SHIFT_SAMPLE + 1)
    if form == BATCH:
        rows = torch.export.Dim("rows", min=1)
        dynamic: tuple[Any, ...] = ({0: rows, 1: count}, {0: rows}, None)
    else:
        dynamic = ({0: count}, None, None)
    with torch.no_grad():
        program = torch.export.export(_Body(form), example, dynamic_shapes=dynamic, strict=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{path.stem}-", suffix=".tmp.pt2", dir=path.parent)
    os.close(fd)
    try:
        torch._inductor.aoti_compile_and_package(program, package_path=tmp)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would make replicas running as other users rebuild it
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class AotiKernel:
    """A loaded package, called as a kernel ``(x, rnd, on) -> statistics``.

    Args:
        compiled: ``torch._inductor.aoti_load_package``'s model, or torch's
            C++ ``AOTIModelPackageLoader`` itself.
    """

    def __init__(self, compiled: Any) -> None:
        loader = getattr(compiled, "loader", compiled)
        # The loader's run skips the pytree flattening of the model's __call__.
        self._run = loader.run if hasattr(loader, "run") else None
        self._compiled = compiled

    def __call__(self, x: torch.Tensor, rnd: torch.Tensor, on: torch.Tensor) -> torch.Tensor | None:
        if self._run is not None:
            out: torch.Tensor = self._run([x, rnd, on])[0]
            return out
        result: torch.Tensor | None = self._compiled(x, rnd, on)
        return result


#: Packages not loaded for this long are deleted by :func:`prune`.
STALE_DAYS = 30.0


def prune(directory: Path, now: float | None = None, keep: Path | set[Path] | None = None) -> int:
    """Deletes packages and temporary files in ``directory`` unused for ``STALE_DAYS``; returns how many.

    "Unused" is the modification time, which every load refreshes. ``keep``
    (the package this process is about to load) is never deleted, however
    old: a server restarted after a long run or downtime reuses it (a set
    keeps each of its paths). A file
    that vanishes or cannot be deleted meanwhile (another replica pruning the
    same volume) is skipped.
    """
    kept = keep if isinstance(keep, set) else {keep} if keep is not None else set()
    cutoff = (time.time() if now is None else now) - STALE_DAYS * 86400
    removed = 0
    try:
        entries = list(directory.glob("basic_stats-*.pt2"))
    except OSError:
        return 0
    for path in entries:
        if path in kept:
            continue
        try:
            if path.stat().st_mtime < cutoff:
                path.unlink()
                removed += 1
        except OSError:
            continue
    if removed:
        log.info("compiled basic statistics: deleted %d package(s) unused for %g days from %s",
                 removed, STALE_DAYS, directory)
    return removed


_pruned: set[Path] = set()


def _prune_once(directory: Path, keep: set[Path]) -> None:
    if directory not in _pruned:
        _pruned.add(directory)
        prune(directory, keep=keep)


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass  # a read-only volume: the package still loads, it may be pruned elsewhere


def _load(path: Path) -> AotiKernel:
    """The package's kernel through torch's C++ loader alone.

    ``aoti_load_package`` wraps the same loader but imports dynamo and
    inductor to do it: measured, +80 MiB resident against +1 MiB.
    """
    native = _native_loader()
    if native is not None:
        try:
            # path, model name, single-threaded, runners, device
            return AotiKernel(native(str(path), "model", False, 1, -1))
        except TypeError:  # another torch's constructor: take the public way
            pass
    return AotiKernel(torch._inductor.aoti_load_package(str(path)))


def load_or_compile(sig: Signature, example: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[AotiKernel, bool]:
    """The signature's kernel from its cached package, compiling it first when missing or unreadable.

    Returns:
        The kernel, and whether a cached package was unreadable (then rebuilt, or
        replaced meanwhile by another process sharing the cache).
    """
    path = package_path(sig)
    # Every form of this dtype is kept: a tap compiles both ahead, and prune runs at the first load only.
    _prune_once(path.parent, keep={package_path(sig._replace(form=f)) for f in (DENSE, BATCH)})
    bad = False
    seen = _identity(path)
    if seen is not None:
        try:
            kernel = _load(path)
            _touch(path)  # in use: prune keeps it
            return kernel, False
        except Exception as exc:  # noqa: BLE001 - a bad cache file is rebuilt, never fatal
            bad = True
            log.warning("compiled basic statistics: cached package %s does not load (%s: %s); rebuilding it",
                        path.name, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            now = _identity(path)
            if now is not None and now != seen:  # a replica sharing the volume rebuilt it meanwhile
                try:
                    kernel = _load(path)
                    _touch(path)
                    return kernel, True
                except Exception:  # noqa: BLE001 - that one is bad too: rebuild below
                    seen = now
    # The rebuilt package replaces the bad one atomically (_compile renames):
    # nothing is unlinked first, so a replica sharing the volume that has just
    # written a good package never finds the path missing or loses its file.
    try:
        _compile(path, example, sig.form)
    except BaseException:
        if bad and _identity(path) == seen:
            path.unlink(missing_ok=True)  # still the very file that failed: do not leave it for the next start
        raise
    return _load(path), bad


def _identity(path: Path) -> tuple[int, int, int] | None:
    """Which file ``path`` names now (inode, size, mtime), or None: a replica's rename changes it."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns
