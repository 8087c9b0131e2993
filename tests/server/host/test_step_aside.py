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
from layertap.server.host.step_aside import Passes, step_aside

pytestmark = pytest.mark.e2e


def _tick(counter: list[int]) -> None:
    counter[0] += 1


class _Busy:
    """Python work on a thread of its own, counting its function calls until told to stop."""

    def __init__(self, passes: Passes, max_wait: float = 10.0, run_slice: float = 0.025) -> None:
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

        wrapped = step_aside(work, passes, max_wait, run_slice)

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
        assert passes.slices == 0 and passes.waited_seconds >= 0.1
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


def test_after_max_wait_of_waiting_it_runs_a_slice_then_waits_again() -> None:
    # A pass that needs a lock the compile holds must not wait for ever, nor a compile under a load
    # that never pauses.
    passes = Passes()
    busy = _Busy(passes, max_wait=0.05, run_slice=0.1)
    try:
        passes.begin()
        _wait_for(lambda: passes.slices == 1)
        assert busy.progress(0.03) > 100  # its slice, though the call still runs
        _wait_for(lambda: passes.waits >= 2 and busy.progress(0.03) == 0)  # and then it waits again
        passes.end()
    finally:
        busy.finish()


def test_short_back_to_back_calls_do_not_starve_it() -> None:
    # Each call ends before max_wait: the waiting still adds up to a slice.
    passes = Passes()
    busy = _Busy(passes, max_wait=0.05, run_slice=0.02)
    stop = threading.Event()

    def calls() -> None:
        while not stop.is_set():
            passes.begin()
            time.sleep(0.005)
            passes.end()

    caller = threading.Thread(target=calls, daemon=True)
    try:
        caller.start()
        assert busy.progress(1.0) > 100
        assert passes.slices >= 3
    finally:
        stop.set()
        caller.join(10)
        busy.finish()


def test_overlapping_calls_keep_it_throttled_after_a_slice() -> None:
    # Two clients: serving work never pauses, and the compile still waits between its slices.
    passes = Passes()
    busy = _Busy(passes, max_wait=0.05, run_slice=0.02)
    try:
        passes.begin()
        passes.begin()
        _wait_for(lambda: passes.slices >= 3)
        waited = passes.waited_seconds
        assert waited >= 0.1  # most of the time went to waiting, not to the compile
        passes.end()
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
    passes = Passes()
    thread = ModelThread("test-step-aside", passes=passes)
    try:
        assert not passes.running
        assert thread.call(lambda: passes.running) is True
        assert thread.call(lambda: passes.running, inline=True) is True
        assert not passes.running
        with pytest.raises(RuntimeError):
            thread.call(lambda: (_ for _ in ()).throw(RuntimeError("x")))
        assert not passes.running  # a call that raised still ends
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
    assert not any(t.is_alive() for t in threads)
    assert most[0] == 1


def test_the_switch_interval_is_short_while_a_compile_runs_and_restored_after() -> None:
    before = sys.getswitchinterval()
    seen = step_aside(sys.getswitchinterval, Passes())()
    assert seen <= 0.0005 < before
    assert sys.getswitchinterval() == before


def test_an_infer_is_serving_work_from_its_request_to_its_response(demo_server: Any, client: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # Its decode and encode run on an RPC thread, outside the model-thread call.
    from layertap.server.rpc import inference

    seen: list[str] = []
    for name in ("decode_inputs", "tensor_to_proto"):
        original = getattr(inference, name)

        def spy(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            seen.append(f"{_name} {demo_server.state.passes.running}")
            return _original(*args, **kwargs)

        monkeypatch.setattr(inference, name, spy)
    client.infer(np.zeros((1, 3, 32, 32), dtype=np.float32))
    assert seen and all(s.endswith("True") for s in seen), seen
    assert {s.split()[0] for s in seen} == {"decode_inputs", "tensor_to_proto"}
    assert not demo_server.state.passes.running


def test_a_compiled_models_background_compile_runs_through_step_aside(make_server: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from layertap.server.compile.variant import Variant
    from layertap.server.host import step_aside as module
    from layertap.server.host.sources import InputSpec, LoadedModel

    seen: list[tuple[bool, bool]] = []
    original = Variant.compile

    def compile_(self: Variant, *args: Any) -> Any:
        seen.append((sys.gettrace() is not None, module._ONE_AT_A_TIME._is_owned()))  # type: ignore[attr-defined]
        return original(self, *args)

    monkeypatch.setattr(Variant, "compile", compile_)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8)).eval()
    srv = make_server(LoadedModel(model, "lin", "factory", [InputSpec("x", torch.float32, (-1, 8))]),
                      compile_model=True, compile_where="thread")
    assert srv.state.host.graph.wait_idle(120)
    assert seen and all(s == (True, True) for s in seen), seen


def test_an_exclusive_stretch_waits_for_model_calls_and_holds_new_ones() -> None:
    # torch.export's non-strict tracer raises on a pass's module calls while it traces.
    passes = Passes()
    events: list[str] = []
    in_call = threading.Event()
    release = threading.Event()

    def model_call(name: str) -> None:
        with passes.model_call():
            events.append(f"{name} start")
            in_call.set()
            release.wait(10)
            events.append(f"{name} end")

    first = threading.Thread(target=model_call, args=("first",))
    first.start()
    assert in_call.wait(10)

    def stretch() -> None:
        with passes.exclusive():
            events.append("exclusive")
            time.sleep(0.05)

    holder = threading.Thread(target=stretch)
    holder.start()
    _wait_for(lambda: passes.exclusive_held)
    in_call.clear()
    second = threading.Thread(target=model_call, args=("second",))
    second.start()
    time.sleep(0.05)
    assert events == ["first start"]  # the stretch waits for the running call; the new one waits too
    release.set()
    for t in (first, holder, second):
        t.join(10)
    assert events == ["first start", "first end", "exclusive", "second start", "second end"]


def test_a_nested_model_call_and_an_exclusive_stretch_on_a_model_call_never_wait_for_themselves() -> None:
    passes = Passes()
    done: list[str] = []

    def run() -> None:
        with passes.model_call():
            with passes.exclusive():  # on the model thread itself: its own call must not block it
                with passes.model_call():  # nested: the outer call already counts
                    done.append("ok")

    t = threading.Thread(target=run)
    t.start()
    t.join(5)
    assert done == ["ok"] and not passes.exclusive_held


def test_passes_never_run_inside_an_fx_trace_of_a_compile() -> None:
    # fx's Tracer patches nn.Module.__call__ for the process and raises on modules not its own: without
    # the exclusive stretch most passes here raised "module is not installed as a submodule".
    import torch
    from torch import nn

    registry = Passes()
    thread = ModelThread("test-fx-trace", passes=registry)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).eval()
    errors: list[BaseException] = []
    count = [0]
    stop = threading.Event()

    def passes() -> None:
        while not stop.is_set():
            try:
                with torch.no_grad():
                    thread.call(model, torch.randn(2, 8))
            except Exception as exc:  # noqa: BLE001 - what the test looks for
                errors.append(exc)
            count[0] += 1

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) + 1

    def compile_() -> None:  # inductor's lowering traces loop bodies this way
        # Traces go on until passes have run between them (bounded): a slow machine gets more traces, not
        # a weaker check. 200 traces at least, so each pass meets a trace in flight many times over.
        deadline = time.monotonic() + 60
        traced = 0
        while traced < 200 or (count[0] <= 20 and time.monotonic() < deadline):
            torch.fx.symbolic_trace(f)
            traced += 1

    loop = threading.Thread(target=passes, daemon=True)
    loop.start()
    try:
        # max_wait 0: it never waits for passes as such, only the fx traces' exclusivity acts.
        step_aside(compile_, registry, max_wait=0.0)()
    finally:
        stop.set()
        loop.join(10)
        thread.close()
    assert count[0] > 20 and not errors, (count[0], errors[:1])


def test_an_exclusive_stretch_left_open_is_closed_when_the_compile_ends() -> None:
    # A debugger or a RecursionError that switches tracing off inside an fx trace loses its 'return' event.
    import torch

    passes = Passes()

    def g(x: torch.Tensor) -> torch.Tensor:
        sys.settrace(None)
        return x + 1

    def compile_() -> bool:
        torch.fx.symbolic_trace(g)
        return passes.exclusive_held

    assert step_aside(compile_, passes)() is True  # left open by the lost event...
    assert not passes.exclusive_held  # ...and closed at the compile's end


def test_a_model_call_waits_for_an_exclusive_stretch_at_most_exclusive_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    from layertap.server.host import step_aside as module

    monkeypatch.setattr(module, "EXCLUSIVE_WAIT", 0.1)
    passes = Passes()
    passes.enter_exclusive(1.0)
    try:
        start = time.monotonic()
        with passes.model_call():
            waited = time.monotonic() - start
        # Its 0.1 s, not the default EXCLUSIVE_WAIT (5 s): half of that is room for a busy machine.
        assert 0.09 <= waited < 2.5 and passes.exclusive_timeouts == 1
    finally:
        passes.leave_exclusive()


def test_two_servers_in_one_process_share_one_pass_registry(make_server: Any) -> None:
    """torch's fx patches reach every module of the process: a compile for one server steps aside for
    the other's passes too, so app.py hands both hosts the process's one registry."""
    from layertap.server.app import process_compilation

    a, b = make_server(), make_server()
    shared = process_compilation().passes
    assert a.state.passes is b.state.passes is shared
    assert a.state.host.model_thread.passes is b.state.host.model_thread.passes is shared
    seen = a.state.host.model_thread.call(lambda: shared.running)
    assert seen is True and not shared.running
