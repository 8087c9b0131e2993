"""glibc malloc tuning (``host.allocator``, ``--malloc-tuning``): freed pass memory is reused, not page-faulted back in.

Each case runs in a fresh interpreter: mallopt settings are process-wide.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(
    platform.system() != "Linux" or not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"),
    reason="glibc only")]

#: Allocates and frees a pass's worth of activation-sized blocks (every page
#: written; with a 24 MiB one when asked), then prints the minor page faults
#: one more such pass costs. Transparent huge pages are off for the process: on a host with
#: THP "always" a fault maps 2 MiB, and the untuned count would say nothing.
SCRIPT = textwrap.dedent("""
    import ctypes, resource, sys
    import numpy as np
    ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
    from layertap.server.host.allocator import tune_malloc
    if sys.argv[1] == "tune":
        print(tune_malloc())
    sizes = [512 << 10, 1 << 20, 2 << 20, 256 << 10, 1 << 20, 3 << 20] + [24 << 20] * (sys.argv[2] == "big")
    def one_pass():
        blocks = [np.ones(n // 8) for n in sizes]
        del blocks
    for _ in range(5):
        one_pass()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        one_pass()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
""")


def _clean_env() -> dict[str, str]:
    """This environment without any malloc settings or preloaded allocator of the caller's."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}


def _run(mode: str, size: str = "small", **env: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode, size], capture_output=True, text=True, timeout=120,
                          env={**_clean_env(), **env})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.splitlines()


def test_tuned_passes_reuse_freed_memory_instead_of_faulting() -> None:
    # 7.25 MiB of blocks per pass: glibc's adaptive defaults trim and fault
    # most of it in again (~1,700 faults); tuned, the freed blocks are reused.
    (default,) = _run("default")
    why, tuned = _run("tune")
    assert why == "None"
    assert float(default) > 500 and float(tuned) < 50, (default, tuned)


def test_tuned_passes_reuse_blocks_up_to_glibcs_own_ceiling() -> None:
    # A 24 MiB activation: glibc's adaptation serves it from the heap after
    # the first free; a fixed threshold below it would fault it every pass.
    why, tuned = _run("tune", "big")
    assert why == "None" and float(tuned) < 50, tuned


def test_the_users_own_settings_are_left_alone() -> None:
    for env in ({"MALLOC_TRIM_THRESHOLD_": "1000000"}, {"MALLOC_MMAP_MAX_": "0"},
                {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1000000"}):
        why, _ = _run("tune", **env)  # type: ignore[arg-type]
        assert why == "malloc settings from the environment", env
    why, _ = _run("tune", GLIBC_TUNABLES="glibc.pthread.rseq=0")  # not a malloc setting
    assert why == "None"
    why, _ = _run("tune", LD_PRELOAD="/nonexistent/libjemalloc.so.2")
    assert why == "another allocator is preloaded"


@pytest.mark.parametrize("flag", [[], ["--malloc-tuning"]])
def test_layertap_serve_tunes_only_when_asked(flag: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "layertap.cli", "serve", "--smoke", "--port", "0",
                           "--no-metrics", *flag], capture_output=True, text=True, timeout=300, env=_clean_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert ("malloc tuning: freed memory up to 64 MiB" in done.stderr) == bool(flag), done.stderr[-2000:]
