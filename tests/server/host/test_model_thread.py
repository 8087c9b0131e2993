"""The model thread: one thread for every call, errors come back, a closed one refuses."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from layertap.server.errors import Unavailable
from layertap.server.host.model_thread import ModelThread

pytestmark = pytest.mark.e2e


def test_calls_from_many_threads_run_on_one_and_errors_come_back() -> None:
    model = ModelThread()
    ran_on: list[str] = []
    callers = [threading.Thread(target=model.call, args=(lambda: ran_on.append(threading.current_thread().name),))
               for _ in range(6)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(10)
    assert len(ran_on) == 6 and len(set(ran_on)) == 1 and ran_on[0].startswith("layertap-model")
    with pytest.raises(ZeroDivisionError):
        model.call(lambda: 1 / 0)
    # A call made from the model thread itself runs inline (a queued call would wait on itself).
    assert model.call(lambda: model.call(lambda: threading.current_thread().name)) == ran_on[0]
    model.close()


def test_a_closed_model_thread_refuses_calls_as_unavailable() -> None:
    model = ModelThread()
    assert model.call(lambda: 7) == 7
    model.close()
    with pytest.raises(Unavailable, match="shutting down"):
        model.call(lambda: 7)


SCRIPT = textwrap.dedent("""
        import signal, sys, time, torch
        # Python's own Ctrl-C handler, which it leaves out when started with SIGINT
        # ignored (pytest run as a background job of a non-interactive shell).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from layertap.server.host.model_thread import in_own_thread
        def work():
            print("started", flush=True)
            end = time.monotonic() + 3
            while time.monotonic() < end:
                torch.randn(256, 256) @ torch.randn(256, 256)
            print("work done", flush=True)
        in_own_thread(work)
        print("not reached", flush=True)
    """)


@pytest.mark.skipif(sys.platform == "win32", reason="sends SIGINT")
@pytest.mark.parametrize("presses", [1, 2, 3])
def test_ctrl_c_during_torch_work_on_its_own_thread_waits_for_it_then_stops(presses: int) -> None:
    """A process that exits with a thread inside torch's C++ aborts (SIGABRT): one or two
    interrupts wait for the work, then raise; a third leaves at once (exit 130)."""
    # The script installs Python's SIGINT handler itself: a preexec_fn doing it
    # runs between fork and exec in this multi-threaded process, which Python
    # warns is unsafe (a CI run saw the child die before its first line).
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    if first != "started\n":
        proc.kill()
        pytest.fail(f"the child did not start: {first!r}, exit {proc.wait()}, stderr {proc.stderr.read()[-2000:]!r}")
    for _ in range(presses):
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert "waiting for work to finish" in err and "terminate called" not in err, err[-2000:]
    if presses < 3:
        assert proc.returncode == -signal.SIGINT, (proc.returncode, err[-2000:])  # KeyboardInterrupt, not SIGABRT
        assert out == "work done\n"
    else:
        assert proc.returncode == 130 and out == "", (proc.returncode, err[-2000:])
