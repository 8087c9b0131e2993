"""Hostile-input fuzzing: the test suite's strategies and checks, for many more cases.

Starts one in-process server (as tests/e2e/test_hostile.py does), sends
``--cases`` requests drawn from ``tests/support/hostile.py`` over every RPC
and judges each with ``tests/support/hostile_check.py``. Unlike the test it
never stops at a problem: it counts them and prints the first few. Prints
cases run, codes seen per RPC, wall time, the slowest answer per RPC, and the
process's RSS (server and client together) before and after.

    python benchmarks/fuzz.py --cases 10000

Exit status 1 when any case had a problem.
"""

from __future__ import annotations

import argparse
import platform
import re
import resource
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the shared strategies live with the tests

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from support.hostile import Case  # noqa: E402
from support.hostile_check import LogWatch, Target, server_config  # noqa: E402
from support.rpc_table import RPCS, SHARES  # noqa: E402

from layertap.server.app import start_server  # noqa: E402


def rss_mib() -> float:
    """Resident set size now, from /proc (Linux); NaN elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def plan(cases: int, only: str | None) -> dict[str, int]:
    """Cases per RPC: the test's shares scaled to ``cases`` (all of them for ``only``)."""
    if only:
        return {only: cases}
    total = sum(SHARES.values())
    out = {rpc: cases * share // total for rpc, share in SHARES.items()}
    for rpc in sorted(SHARES, key=SHARES.__getitem__, reverse=True)[: cases - sum(out.values())]:
        out[rpc] += 1  # the rounding remainder goes to the largest shares
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=10000, help="requests to send (default 10000)")
    ap.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    ap.add_argument("--rpc", choices=sorted(RPCS), help="fuzz only this RPC")
    ap.add_argument("--show", type=int, default=10, help="problems to print in full (default 10)")
    args = ap.parse_args()

    logs = LogWatch().install()
    with tempfile.TemporaryDirectory(prefix="layertap-fuzz-") as baselines:
        srv = start_server(server_config(baseline_dir=baselines))
        target = Target(f"127.0.0.1:{srv.port}", logs, srv)
        target.settle()
        logs.take()
        slowest: dict[str, float] = defaultdict(float)
        problems: list[tuple[Case, str]] = []
        rss_before = rss_mib()
        start = time.monotonic()

        def one(case: Case) -> None:
            outcome = target.run(case)
            slowest[case.rpc] = max(slowest[case.rpc], outcome.seconds)
            problems.extend((case, p) for p in outcome.problems)

        for rpc, n in plan(args.cases, args.rpc).items():
            settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
                     suppress_health_check=list(HealthCheck), print_blob=False)(
                seed(args.seed)(given(RPCS[rpc].cases)(one)))()
        wall = time.monotonic() - start
        rss_after = rss_mib()
        health = target.settle()
        target.close()
        srv.state.taps.close()
        srv.stop(0)
    logs.uninstall()

    run = sum(target.codes.values())
    print(f"layertap fuzz: {run} cases, seed {args.seed}, python {platform.python_version()}, "
          f"{platform.machine()}")
    print(f"wall {wall:.1f} s ({run / wall:.0f} cases/s); slowest first answer {target.max_seconds * 1000:.0f} ms")
    print(f"RSS {rss_before:.0f} MiB before, {rss_after:.0f} MiB after (peak {peak_rss_mib():.0f} MiB)")
    print(f"\n{'rpc':36} {'cases':>6} {'slowest ms':>10}  codes")
    per_rpc: dict[str, Counter[str]] = defaultdict(Counter)
    for (rpc, code), n in target.codes.items():
        per_rpc[rpc][code] += n
    for rpc in sorted(per_rpc):
        codes = ", ".join(f"{c} {n}" for c, n in per_rpc[rpc].most_common())
        print(f"{rpc:36} {sum(per_rpc[rpc].values()):>6} {slowest[rpc] * 1000:>10.0f}  {codes}")
    print(f"\nproblems: {len(problems)}" + (f" (+ at the end: {health})" if health else ""))
    # The same fault shows in many cases: one line per distinct problem, its first case in full.
    first: dict[str, tuple[Case, str]] = {}
    kinds: Counter[str] = Counter()
    for case, why in problems:
        key = re.sub(r"\d+(\.\d+)?", "N", why.splitlines()[0])[:200]
        kinds[key] += 1
        first.setdefault(key, (case, why))
    for key, n in kinds.most_common(args.show):
        case, why = first[key]
        print(f"- {n} x {key}\n  first: {why}\n  {case!r}"[:8000])
    return 1 if problems or health else 0


if __name__ == "__main__":
    sys.exit(main())
