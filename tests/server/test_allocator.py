"""glibc malloc tuning (``host.allocator``): freed pass memory is reused, not page-faulted back in.

Each case runs in a fresh interpreter: mallopt settings are process-wide.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc only")

#: Allocates and frees a pass's worth of activation-sized blocks (every page
#: written), then prints the minor page faults one more such pass costs.
SCRIPT = textwrap.dedent("""
    import resource, sys
    import numpy as np
    from layertap.server.host.allocator import tune_malloc
    if sys.argv[1] == "tune":
        print(tune_malloc())
    def one_pass():
        blocks = [np.ones(n // 8) for n in (512 << 10, 1 << 20, 2 << 20, 256 << 10, 1 << 20, 3 << 20)]
        del blocks
    for _ in range(5):
        one_pass()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        one_pass()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
""")


def _run(mode: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120,
                          env={**clean, **env})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.splitlines()


def test_tuned_passes_reuse_freed_memory_instead_of_faulting() -> None:
    # 7.25 MiB of blocks per pass: glibc's defaults fault most of it in again
    # (~1,700 faults); tuned, the freed blocks are reused.
    (default,) = _run("default")
    why, tuned = _run("tune")
    assert why == "None"
    assert float(default) > 500 and float(tuned) < 50, (default, tuned)


def test_the_users_own_settings_are_left_alone() -> None:
    why, _ = _run("tune", MALLOC_TRIM_THRESHOLD_="1000000")
    assert why == "malloc settings from the environment"
    why, _ = _run("tune", LD_PRELOAD="/nonexistent/libjemalloc.so.2")
    assert why == "another allocator is preloaded"


@pytest.mark.parametrize("flag", [[], ["--no-malloc-tuning"]])
def test_layertap_serve_tunes_its_own_process_unless_told_not_to(flag: list[str]) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-m", "layertap.cli", "serve", "--smoke", "--port", "0",
                           "--no-metrics", *flag], capture_output=True, text=True, timeout=300, env=clean)
    assert done.returncode == 0, done.stderr[-2000:]
    assert ("malloc: freed memory up to 64 MiB" in done.stderr) == (not flag), done.stderr[-2000:]
