"""Telemetry threads run nicer than the model thread (Linux), so under full load telemetry yields first."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import urllib.request

import numpy as np
import pytest

from layertap import Client
from layertap.server.host.priority import DEFAULT_TELEMETRY_NICE, lower_this_thread, set_telemetry_nice

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")]


def nice_of(prefix: str, old: set[int]) -> list[int]:
    """Nice values of the threads named ``prefix*`` started since ``old`` (other tests' servers may linger)."""
    return [os.getpriority(os.PRIO_PROCESS, t.native_id) for t in threading.enumerate()
            if t.name.startswith(prefix) and t.native_id is not None and t.native_id not in old]


@pytest.mark.parametrize("nice", [DEFAULT_TELEMETRY_NICE, 0])
def test_telemetry_threads_are_nicer_than_the_model_thread(make_server, nice: int) -> None:
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    old = {t.native_id for t in threading.enumerate() if t.native_id is not None}
    srv = make_server(metrics_port=0, telemetry_nice=nice)
    with Client(f"127.0.0.1:{srv.port}", timeout=60) as client:
        client.create_tap("layer1", reducers=["moments"])  # hooks are in when this returns
        client.infer(np.zeros((2, 3, 32, 32), np.float32))
        assert srv.state.taps.flush(30)  # the host-transfer thread has run a pass
        urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=30).read()
    want = min(19, base + nice)
    assert nice_of("layertap-model", old) == [base]  # inference keeps its priority
    assert nice_of("layertap-host-transfer", old) == [want]
    assert nice_of("layertap-metrics", old) == [want]


def test_a_thread_started_by_a_nice_thread_inherits_it_and_bad_values_are_refused() -> None:
    seen: list[int | None] = []

    def child() -> None:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    def parent() -> None:
        seen.append(lower_this_thread(3))
        t = threading.Thread(target=child)
        t.start()
        t.join()

    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=parent)
    t.start()
    t.join()
    assert seen == [min(19, base + 3)] * 2
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # the caller is untouched
    for bad in (20, -1, 2.5, True):
        with pytest.raises(ValueError, match=f"--telemetry-nice {bad}"):
            set_telemetry_nice(bad)  # type: ignore[arg-type]


def test_the_cli_refuses_a_bad_value_before_loading_the_model() -> None:
    done = subprocess.run([sys.executable, "-m", "layertap.cli", "serve", "--port", "0", "--telemetry-nice", "-1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--telemetry-nice -1" in done.stderr
