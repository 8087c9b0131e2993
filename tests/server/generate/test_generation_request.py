"""A Generate request's event queue and the capture bytes its steps hold, on their own."""

from __future__ import annotations

import threading

import pytest
import torch

from layertap.server.generate.request import GenerationRequest, StepEvent

pytestmark = pytest.mark.unit


def test_a_step_queued_while_the_call_closes_gives_its_bytes_back() -> None:
    """The generator reserves a step's capture bytes and queues it; close() drains the queue. A close()
    that lands between the two must still see the step: otherwise its bytes stay held for good."""
    held: list[int] = []

    def reserve(nbytes: int):  # type: ignore[no-untyped-def]
        held.append(nbytes)
        return lambda: held.remove(nbytes)

    req = GenerationRequest("gen-x", [[1, 2]], max_new_tokens=4, capture_bytes=1 << 20, reserve=reserve)
    queued, go = threading.Event(), threading.Event()
    real = req._events

    class Paused:
        """The generator paused right before its item lands in the queue."""

        def put(self, item: object) -> None:
            queued.set()
            go.wait(10)
            real.put(item)  # type: ignore[arg-type]

        def get_nowait(self) -> object:
            return real.get_nowait()

    req._events = Paused()  # type: ignore[assignment]
    step = StepEvent(2, 1, [], [("model.layers.0", 0, "", torch.zeros(4))])
    producer = threading.Thread(target=req._put, args=(step,))
    producer.start()
    assert queued.wait(10)
    closer = threading.Thread(target=req.close)
    closer.start()
    go.set()
    producer.join(10)
    closer.join(10)
    assert held == []  # 16 bytes were reserved, and given back by close()


def test_a_step_after_close_takes_no_bytes() -> None:
    held: list[int] = []
    req = GenerationRequest("gen-y", [[1]], max_new_tokens=2, capture_bytes=1 << 20,
                            reserve=lambda n: (held.append(n), lambda: held.remove(n))[1])
    req.close()
    step = StepEvent(2, 1, [], [("l", 0, "", torch.zeros(8))])
    req._put(step)
    assert held == [] and step.captures == [] and step.dropped_captures == 1

