"""One OpenMP worker team per server process, whatever the clients ask for.

libgomp gives each thread that enters a parallel region a team of its own and
keeps it until that thread exits. Two teams put more OpenMP threads than cores
in the process, libgomp then stops spinning between regions, and every
forward slows down (1.6x measured on the 2-core CPU machine; see
``layertap.server.host.model_thread``). These tests run a real server in a
fresh process, drive every RPC that runs torch work (loading, Infer,
captures, streams with distribution reducers, Grad-CAM, a /metrics scrape),
and count the OpenMP worker threads left: only the model thread's team.
They fail without loading the model on a thread that exits
(``in_own_thread``), and, for a model whose tensors are strided views,
without encoding them with numpy's copy instead of torch's parallel one
(``codec.host_bytes``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

SCRIPT = textwrap.dedent(r'''
    import json, os, sys, threading, time, urllib.request
    import numpy as np
    import torch
    from torch import nn
    import layertap
    from layertap.server.app import start_server
    from layertap.server.config import ServerConfig
    from layertap.server.host.sources import InputSpec, LoadedModel

    def suspects():
        """Native threads Python does not know, named like the process or one of its Python threads.

        OpenMP workers take the name of the thread that started them (the
        process's name on Python 3.11; the thread's own on 3.14, which names
        OS threads); gRPC's C threads name themselves (grpc_global_tim,
        event_engine...); numpy's OpenBLAS pool starts at import.
        """
        python = {t.native_id for t in threading.enumerate()}
        own = open("/proc/self/comm").read().strip()
        names = (own, "layertap", "Thread", "MainThread")
        return sum(1 for tid in os.listdir("/proc/self/task") if int(tid) not in python
                   and open(f"/proc/self/task/{tid}/comm").read().strip().startswith(names))

    def settled():
        """:func:`suspects` once threads that are ending have gone: a thread the /metrics server started for
        a request has left threading's table before its OS thread exits, and was counted as a team's worker.
        A team's workers stay for the process's life, so the fewest over a short spell counts every one."""
        seen = []
        for _ in range(5):
            seen.append(suspects())
            time.sleep(0.1)
        return min(seen)

    class Permute(nn.Module):
        def forward(self, x):
            return x.permute(0, 2, 3, 1)  # a strided view, as ConvNeXt's and Swin's Permute modules give

    before = suspects()  # numpy's OpenBLAS threads, before any torch work
    strided = sys.argv[1] == "strided"
    cfg = ServerConfig(port=0, metrics_port=0, compile_reducers=False)
    if strided:  # small layers: building them runs no parallel region on this thread
        model = nn.Sequential(nn.Conv2d(3, 8, 3), Permute()).eval()
        srv = start_server(cfg, LoadedModel(model, "strided", "test", [InputSpec("input", torch.float32, (-1, 3, 66, 66))]))
    else:
        srv = start_server(cfg)
    side = 66 if strided else 32
    x = np.random.default_rng(0).standard_normal((32, 3, side, side)).astype(np.float32)
    layer = "1" if strided else "layer1"
    with layertap.Client(f"127.0.0.1:{srv.port}", timeout=60) as c:
        for _ in range(3):
            c.infer(x)
        c.capture(layer, input=x)
        c.create_tap(layer, reducers=["moments", "histogram", "quantiles", "per_channel"])
        c.infer(x)
        assert srv.state.taps.flush(30)
        if not strided:
            c.explain(x[:2], "layer4")
        urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=30).read()
        c.infer(x)
    print(json.dumps({"workers": settled() - before, "threads": torch.get_num_threads()}))
    srv.stop(0)
''')


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through Linux's /proc")
@pytest.mark.parametrize("model", ["demo", "strided"])
def test_a_server_keeps_one_openmp_team(model: str) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, model], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # One team: the model thread plus threads - 1 workers (0 on a 1-core machine).
    assert seen["workers"] <= seen["threads"] - 1, seen
