"""One OpenMP worker team per server process, whatever the clients ask for.

libgomp gives each thread that enters a parallel region a team of its own and
keeps it until that thread exits. Two teams put more OpenMP threads than cores
in the process, libgomp then stops spinning between regions, and every
forward slows down (1.6x measured on the 2-core CPU machine; see
``layertap.server.host.model_thread``). This test runs a real server in a
fresh process, drives every RPC that runs torch work (loading, Infer,
captures, streams with distribution reducers, Grad-CAM, a /metrics scrape),
and counts the OpenMP worker threads left: only the model thread's team.
Without loading the model on a thread that exits (``in_own_thread``), the
main thread keeps a second team and this test fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(r'''
    import json, os, threading, urllib.request
    import numpy as np
    import torch
    import layertap
    from layertap.server.app import start_server
    from layertap.server.config import ServerConfig

    def unnamed_native():
        """Threads with the process's own name that Python does not know.

        gRPC's C threads name themselves (grpc_global_tim, event_engine...);
        Python 3.11 threads keep the name of the process, and so do OpenMP's
        workers and numpy's OpenBLAS pool (started at import).
        """
        python = {t.native_id for t in threading.enumerate()}
        own = open("/proc/self/comm").read().strip()
        return sum(1 for tid in os.listdir("/proc/self/task") if int(tid) not in python
                   and open(f"/proc/self/task/{tid}/comm").read().strip() == own)

    before = unnamed_native()  # numpy's OpenBLAS threads, before any torch work
    srv = start_server(ServerConfig(port=0, metrics_port=0, compile_reducers=False))
    x = np.random.default_rng(0).standard_normal((32, 3, 32, 32)).astype(np.float32)
    with layertap.Client(f"127.0.0.1:{srv.port}", timeout=60) as c:
        for _ in range(3):
            c.infer(x)
        c.capture("layer1", input=x)
        with c.watch("layer*", reducers=["moments", "histogram", "quantiles", "per_channel"]) as stream:
            c.infer(x)
            next(stream)
        c.explain(x[:2], "layer4")
        urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=30).read()
        c.infer(x)
    print(json.dumps({"workers": unnamed_native() - before, "threads": torch.get_num_threads()}))
    srv.stop(0)
''')


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through Linux's /proc")
def test_a_server_keeps_one_openmp_team() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # One team: the model thread plus threads - 1 workers (0 on a 1-core machine).
    assert seen["workers"] <= seen["threads"] - 1, seen
