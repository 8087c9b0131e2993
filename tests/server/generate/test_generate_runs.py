"""Decode steps run back to back on the model thread, until anything else wants the model.

A tiny random Llama on a real ModelHost and Generator; the counts are of
model-thread calls and passes, so nothing here depends on timing except
waiting for a generation to be running.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from support import hf_models

from layertap.server.generate.generator import Generator
from layertap.server.generate.request import GenerationRequest
from layertap.server.host.model_host import ModelHost
from layertap.server.host.model_thread import PassLock
from layertap.server.host.sources import load_model

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> ModelHost:
    path, _ = hf_models.save("llama", Path(tmp_path_factory.mktemp("m")), max_position_embeddings=4096)
    return ModelHost(load_model(f"hf:{path}"))


def request(i: int, n: int, **kwargs: object) -> GenerationRequest:
    return GenerationRequest(f"r{i}", [[5, 6, 7]], max_new_tokens=n, **kwargs)  # type: ignore[arg-type]


def running(r: GenerationRequest, tokens: int = 5) -> None:
    end = time.monotonic() + 30
    while len(r.generated[0]) < tokens:
        assert time.monotonic() < end, "the generation never started"
        time.sleep(0.001)


def counted(host: ModelHost, r: GenerationRequest) -> tuple[int, int]:
    """(model-thread calls, passes) of ``r`` generated alone to its end."""
    gen = Generator(host, max_new_tokens=4000)
    try:
        calls, passes = host.model_thread.calls, host.passes
        gen.submit(r)
        assert r.done.wait(60)
        return host.model_thread.calls - calls, host.passes - passes
    finally:
        gen.close()


def test_alone_a_generation_runs_many_steps_per_model_thread_call(host: ModelHost) -> None:
    calls, passes = counted(host, request(0, 200))
    assert passes == 200 and calls <= 200 // 32 + 2, (passes, calls)


def test_a_request_waiting_for_a_row_does_not_end_every_run(host: ModelHost) -> None:
    """Rows full: the waiting request cannot join, so it must not cut every run to one step (the review's case)."""
    gen = Generator(host, max_new_tokens=4000, max_rows=1)
    try:
        a = request(0, 200)
        gen.submit(a)
        running(a)
        b = request(1, 5)
        gen.submit(b)  # waits for a's row
        calls, passes = host.model_thread.calls, host.passes
        assert a.done.wait(60)
        calls, passes = host.model_thread.calls - calls, host.passes - passes
        assert b.done.wait(60) and len(b.generated[0]) == 5
    finally:
        gen.close()
    assert calls * 4 < passes, f"{passes} passes in {calls} model-thread calls"


def test_while_the_model_is_wanted_each_call_decodes_one_step(host: ModelHost, monkeypatch) -> None:
    """What a tap change or a queued Infer gets (model_wanted, tested below): the run ends after the current step."""
    monkeypatch.setattr(host, "model_wanted", lambda: True)
    calls, passes = counted(host, request(0, 30))
    assert passes == 30 and calls >= 30, (passes, calls)


def test_model_wanted_sees_a_blocked_lock_taker_and_a_queued_call(host: ModelHost) -> None:
    assert not host.model_wanted()
    lock = host.pass_lock()
    entered = threading.Event()
    lock.acquire()
    try:
        t = threading.Thread(target=lambda: (entered.set(), lock.acquire(), lock.release()))
        t.start()
        entered.wait(5)
        end = time.monotonic() + 5
        while not host.model_wanted():
            assert time.monotonic() < end, "a thread blocked on the model lock is not seen"
            time.sleep(0.001)
    finally:
        lock.release()
    t.join(5)
    assert not host.model_wanted()
    release = threading.Event()
    first = threading.Thread(target=lambda: host.on_model_thread(release.wait, 10))
    first.start()
    second = threading.Thread(target=lambda: host.on_model_thread(lambda: None))
    end = time.monotonic() + 5
    while host.model_thread.calls < 1:
        time.sleep(0.001)
    second.start()
    while not host.model_wanted():
        assert time.monotonic() < end, "a call queued behind the running one is not seen"
        time.sleep(0.001)
    release.set()
    first.join(5), second.join(5)
    assert not host.model_wanted()


def test_a_step_capture_keeps_one_step_per_call(host: ModelHost) -> None:
    """Step captures are charged to the capture budget until the client takes them: one step per call."""
    gen = Generator(host, max_new_tokens=4000)
    try:
        a = request(0, 40, capture_layers=["model.layers.0"])
        calls, passes = host.model_thread.calls, host.passes
        gen.submit(a)
        for _ in a.events():  # the client takes each step's capture
            if a.done.is_set():
                break
        assert a.done.wait(60)
        calls, passes = host.model_thread.calls - calls, host.passes - passes
    finally:
        gen.close()
    assert passes == 40 and calls >= 40, (passes, calls)


def test_pass_lock_keeps_rlock_semantics() -> None:
    """threading.Condition over it releases every level of a reentrant hold; a timed non-blocking acquire is refused."""
    lock = PassLock()
    with pytest.raises(ValueError):
        lock.acquire(False, 1)
    cond = threading.Condition(lock)
    got: list[bool] = []

    def other() -> None:
        ok = lock.acquire(timeout=1.0)
        got.append(ok)
        if ok:
            lock.release()

    with cond, lock:
        t = threading.Thread(target=other)
        t.start()
        cond.wait(timeout=1.5)
    t.join()
    assert got == [True]
