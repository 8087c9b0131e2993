"""Incidents of Generate passes: they keep the pass's phase, position and request ids, and a decode step,
which reads a KV cache no input copy holds, is recorded without a replay (its input is never retained)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from layertap.server.host.inputs import ModelInputs
from layertap.server.host.model_host import PHASE_DECODE, PHASE_PREFILL, ModelHost, RequestRows
from layertap.server.host.sources import InputSpec, LoadedModel
from layertap.server.record.recorder import Recorder
from layertap.server.record.store import IncidentStore
from layertap.server.stream.broker import Broker
from layertap.server.taps.engine import TapEngine
from layertap.server.taps.tap_files import reducer_spec
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def rig(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh()).eval()
    host = ModelHost(LoadedModel(model, "m", "test", [InputSpec("input", torch.float32, (-1, -1, 8))]))
    engine = TapEngine(host, Broker(), rng=random.Random(0))
    clock = Clock()
    recorder = engine.sinks.add(Recorder(engine, IncidentStore(tmp_path), record_bytes=1 << 20, clock=clock))
    yield host, engine, recorder, clock
    recorder.close()
    engine.close()


def tap_spec(name: str, phase: int) -> pb.TapSpec:
    # Any value above 1e-6 in magnitude fires: every pass of its phase records an incident.
    return pb.TapSpec(name=name, selector="0", reducers=[reducer_spec("abs_max", "r"), reducer_spec("moments", "r")],
                      phases=[phase], triggers=pb.Triggers(abs_max_above=1e-6))


def one_pass(host: ModelHost, phase: int, requests: tuple[RequestRows, ...], *, named: bool) -> int:
    x = torch.from_numpy(np.random.default_rng(phase).standard_normal((3, 4 if phase == PHASE_PREFILL else 1, 8))
                         .astype(np.float32))
    inputs = ModelInputs.positional([x]) if named else None
    with host.pass_context(phase=phase, requests=requests, tokens=x.shape[1], inputs=inputs) as ctx, \
            torch.inference_mode():
        host.module(x)
    return ctx.index


def incidents(engine: TapEngine, recorder: Recorder, n: int) -> dict[str, pb.Incident]:
    assert engine.flush(10) and recorder.wait_idle(10)
    got = recorder.store.entries()
    assert len(got) == n, [(r.tap, r.replay_note) for r in got]
    return {r.tap: r for r in got}


def test_incidents_keep_the_passs_place_and_decode_steps_are_not_replayed(rig) -> None:
    host, engine, recorder, clock = rig
    engine.create(tap_spec("prefill", pb.PHASE_PREFILL))
    engine.create(tap_spec("decode", pb.PHASE_DECODE))
    prefill = (RequestRows("a", slice(0, 2), (4, 4), 0), RequestRows("b", slice(2, 3), (2,), 2))
    first = one_pass(host, PHASE_PREFILL, prefill, named=True)
    decode = (RequestRows("a", slice(0, 2), (5, 5)), RequestRows("b", slice(2, 3), (5,)))
    second = one_pass(host, PHASE_DECODE, decode, named=True)
    got = incidents(engine, recorder, 2)

    pre = got["prefill"]
    assert pre.pass_index == first and pre.replayed and pre.replay_matches, pre.replay_note
    assert [(s.phase, s.has_position, list(s.request_ids)) for s in pre.summaries] == [
        (PHASE_PREFILL, False, ["a", "b"])]
    _, tensors = recorder.store.read(pre.id)
    assert [t.header.layer for t in tensors] == ["", "0"]  # the input, then the layer
    for t in tensors:
        h = t.header
        assert (h.pass_index, h.phase, h.has_position, list(h.request_ids)) == (first, PHASE_PREFILL, False, ["a", "b"])

    dec = got["decode"]
    assert dec.pass_index == second and not dec.replayed and dec.tensor_count == 0
    assert "decode step" in dec.replay_note and "KV cache" in dec.replay_note
    (s,) = dec.summaries
    assert (s.phase, s.position, s.has_position, list(s.request_ids)) == (PHASE_DECODE, 5, True, ["a", "b"])
    # The decode step's input was never retained: nothing held, nothing counted lost.
    assert recorder.retention is not None
    assert (recorder.retention.held_bytes, recorder.retention.queued_bytes, recorder.retention.lost) == (0, 0, 0)

    # A prefill whose pass did not name its inputs is recorded without a replay, and says why.
    clock.now += 3600  # past the rate limit
    one_pass(host, PHASE_PREFILL, prefill, named=False)
    assert engine.flush(10) and recorder.wait_idle(10)
    latest = recorder.store.entries(tap="prefill")[0]
    assert not latest.replayed and "did not name its inputs" in latest.replay_note
    assert latest.summaries[0].phase == PHASE_PREFILL
