"""A background compile steps aside while a model-thread call runs (host.step_aside)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from layertap.server.host.model_thread import ModelThread
from layertap.server.host.step_aside import PASSES, Passes, step_aside


def _tick(counter: list[int]) -> None:
    counter[0] += 1


class _Busy:
    """Python work on a thread of its own, counting its function calls until told to stop."""

    def __init__(self, passes: Passes, max_wait: float = 10.0) -> None:
        self.calls = [0]
        self.stop = threading.Event()
        self.started = threading.Event()
        self.trace_after: list[object] = []
        self.error: list[BaseException] = []

        def work() -> str:
            self.started.set()
            while not self.stop.is_set():
                _tick(self.calls)
            return "done"

        wrapped = step_aside(work, passes, max_wait)

        def run() -> None:
            try:
                assert wrapped() == "done"
            except BaseException as exc:  # noqa: BLE001 - seen by the test
                self.error.append(exc)
            self.trace_after.append(sys.gettrace())

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert self.started.wait(10)

    def progress(self, seconds: float) -> int:
        before = self.calls[0]
        time.sleep(seconds)
        return self.calls[0] - before

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive() and not self.error


def _wait_for(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_a_compile_waits_while_a_call_runs_and_goes_on_after() -> None:
    passes = Passes()
    busy = _Busy(passes)
    try:
        assert busy.progress(0.05) > 100  # it runs while the model is idle
        passes.begin()
        _wait_for(lambda: passes.waits == 1)  # parked at its next call
        assert busy.progress(0.1) == 0
        passes.end()
        assert busy.progress(0.05) > 100
        assert passes.cut_short == 0 and passes.waited_seconds >= 0.1
    finally:
        passes.end() if passes.running else None
        busy.finish()
    assert busy.trace_after == [None]  # its thread's trace function is put back


def test_nested_calls_keep_it_waiting_until_the_last_ends() -> None:
    passes = Passes()
    busy = _Busy(passes)
    try:
        passes.begin()
        passes.begin()  # a second model thread (another server in the process)
        _wait_for(lambda: passes.waits == 1)
        passes.end()
        assert busy.progress(0.05) == 0
        passes.end()
        assert busy.progress(0.05) > 100
    finally:
        busy.finish()


def test_a_call_longer_than_max_wait_lets_the_compile_run_for_the_rest_of_it() -> None:
    # A pass that needs a lock the compile holds must not wait for ever.
    passes = Passes()
    busy = _Busy(passes, max_wait=0.05)
    try:
        passes.begin()
        _wait_for(lambda: passes.cut_short == 1)
        assert busy.progress(0.05) > 100  # and no second wait in the same call
        assert passes.waits == 1
        passes.end()
        passes.begin()  # a new call: it steps aside again
        _wait_for(lambda: passes.waits == 2)
        passes.end()
    finally:
        busy.finish()


def test_errors_reach_the_caller_and_the_trace_function_is_restored() -> None:
    def boom() -> None:
        raise ValueError("compile failed")

    previous = sys.gettrace()
    with pytest.raises(ValueError, match="compile failed"):
        step_aside(boom, Passes())()
    assert sys.gettrace() is previous


def test_every_model_thread_call_is_a_running_pass() -> None:
    thread = ModelThread("test-step-aside")
    try:
        assert not PASSES.running
        assert thread.call(lambda: PASSES.running) is True
        assert thread.call(lambda: 7, inline=True) == 7
        assert not PASSES.running
        with pytest.raises(RuntimeError):
            thread.call(lambda: (_ for _ in ()).throw(RuntimeError("x")))
        assert not PASSES.running  # a call that raised still ends
    finally:
        thread.close()


def test_compiles_run_one_at_a_time() -> None:
    # Torch's tracers keep process-wide state: two compiles at once break each other.
    inside, most = [0], [0]
    lock = threading.Lock()

    def compile_() -> None:
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.05)
        with lock:
            inside[0] -= 1

    threads = [threading.Thread(target=step_aside(compile_, Passes())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert most[0] == 1


def test_the_switch_interval_is_short_while_a_compile_runs_and_restored_after() -> None:
    before = sys.getswitchinterval()
    seen = step_aside(sys.getswitchinterval, Passes())()
    assert seen <= 0.0005 < before
    assert sys.getswitchinterval() == before


def test_an_infer_is_serving_work_from_its_request_to_its_response(demo_server: Any, client: Any) -> None:
    # Its decode and encode run on an RPC thread, outside the model-thread call.
    seen: list[bool] = []
    server = demo_server
    original = server.state.host.run

    def run(*args: Any, **kwargs: Any) -> Any:
        seen.append(PASSES.running)
        return original(*args, **kwargs)

    server.state.host.run = run
    client.infer(np.zeros((1, 3, 32, 32), dtype=np.float32))
    assert seen == [True]
    assert not PASSES.running
