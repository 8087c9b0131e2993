"""The model thread: one thread for every call, errors come back, a closed one refuses."""

from __future__ import annotations

import threading

import pytest

from layertap.server.errors import Unavailable
from layertap.server.host.model_thread import ModelThread


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
