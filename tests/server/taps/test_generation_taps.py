"""Taps on Generate passes: each summary names its pass's place, phases filter taps, and a request's
inline tap reduces exactly its own rows (without its prompt padding in a prefill).

Every pass is driven the way the Generate loop drives it: ``host.pass_context(phase=..., requests=...,
tokens=...)`` around a forward in inference mode. Values are checked against float64 numpy references of
the tensors the layers really produced.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from support.sync_guard import NoSyncMode
from torch import nn

from layertap.server.errors import InvalidField
from layertap.server.host.model_host import PHASE_DECODE, PHASE_NONE, PHASE_PREFILL, ModelHost, RequestRows
from layertap.server.host.sources import InputSpec, LoadedModel
from layertap.server.stream.broker import Broker
from layertap.server.taps.engine import TapEngine
from layertap.server.taps.tap_files import reducer_spec
from layertap.v1 import telemetry_pb2 as pb
from tests.support.reductions import count_reductions
from tests.support.summaries import drain, results

pytestmark = pytest.mark.unit

BASIC = ("moments", "minmax", "nonfinite", "zero_fraction")
HIDDEN = 8


class Rotary(nn.Module):
    """Like a decoder's rotary embedding: one ``(1, tokens, hidden)`` table for the whole batch."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        t = torch.arange(h.shape[1] * HIDDEN, dtype=h.dtype).reshape(1, h.shape[1], HIDDEN)
        return torch.cos(t / 7.0)


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(HIDDEN, HIDDEN)
        self.rotary = Rotary()
        self.block = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(torch.tanh(self.block(h) + self.rotary(h)))


@pytest.fixture
def rig():
    torch.manual_seed(0)
    host = ModelHost(LoadedModel(Toy().eval(), "toy", "test", [InputSpec("input", torch.float32, (-1, -1, HIDDEN))]))
    broker = Broker(default_queue_size=10_000)
    engine = TapEngine(host, broker, rng=random.Random(0))
    yield host, broker, engine
    engine.close()


def spec(selector: str, *reducers: str, phases: tuple[int, ...] = (), every: int = 0,
         point: int = pb.POINT_OUTPUT) -> pb.TapSpec:
    return pb.TapSpec(selector=selector, point=point, reducers=[reducer_spec(r, "r") for r in reducers],
                      phases=phases, sampling=pb.Sampling(every_n=every))


def step(host: ModelHost, x: torch.Tensor, phase: int = PHASE_NONE, requests: tuple[RequestRows, ...] = (),
         layers: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """One pass as the Generate loop runs it; returns ``layers``' outputs as float64 (hooked after the taps)."""
    seen: dict[str, np.ndarray] = {}
    handles = [host.modules[n].register_forward_hook(
        lambda _m, _a, o, _n=n: seen.__setitem__(_n, o.detach().double().numpy().copy())) for n in layers]
    try:
        tokens = x.shape[1] if phase else 0
        with host.pass_context(phase=phase, requests=requests, tokens=tokens), torch.inference_mode():
            host.module(x)
    finally:
        for h in handles:
            h.remove()
    return seen


def check(s: pb.Summary, ref: np.ndarray) -> None:
    """Every basic result of ``s`` equals the float64 reference on exactly ``ref``."""
    res = results(s)
    assert res["moments"].moments.count == ref.size
    np.testing.assert_allclose(res["moments"].moments.mean, ref.mean(), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(res["moments"].moments.std, ref.std(), rtol=1e-9, atol=1e-12)
    assert res["minmax"].minmax.min == ref.min() and res["minmax"].minmax.max == ref.max()
    assert res["zero_fraction"].zero_fraction.count == ref.size
    assert res["zero_fraction"].zero_fraction.fraction == np.count_nonzero(ref == 0) / ref.size
    assert list(s.request_ids) and s.phase in (PHASE_PREFILL, PHASE_DECODE)


def x_of(batch: int, tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((batch, tokens, HIDDEN)).astype(np.float32))


def place(s: pb.Summary) -> tuple[int, int | None, list[str]]:
    return s.phase, (s.position if s.has_position else None), list(s.request_ids)


@pytest.mark.parametrize("reducers", [BASIC, ("moments", "histogram")], ids=["wire", "messages"])
def test_every_summary_names_its_passs_place(rig, reducers) -> None:
    host, broker, engine = rig
    tap = engine.create(spec("block", *reducers))
    sub = broker.subscribe([tap.id])
    # A prefill of two requests whose prompts differ in length: no one position.
    step(host, x_of(3, 5), PHASE_PREFILL, (RequestRows("a", slice(0, 2), (5, 5), 0), RequestRows("b", slice(2, 3), (3,), 2)))
    step(host, x_of(2, 1), PHASE_DECODE, (RequestRows("a", slice(0, 2), (6, 6)),))  # one position: 6
    step(host, x_of(1, 1), PHASE_DECODE, (RequestRows("c", slice(0, 1), (0,)),))  # position 0 is a position
    step(host, x_of(2, 4))  # a plain forward
    got = sorted(drain(engine, sub), key=lambda s: s.pass_index)
    assert [place(s) for s in got] == [
        (PHASE_PREFILL, None, ["a", "b"]), (PHASE_DECODE, 6, ["a"]), (PHASE_DECODE, 0, ["c"]), (PHASE_NONE, None, [])]
    assert got[2].has_position and not got[3].has_position
    assert [s.results[0].moments.count for s in got] == [3 * 5 * HIDDEN, 2 * HIDDEN, HIDDEN, 2 * 4 * HIDDEN]


def test_a_phase_filtered_tap_sees_only_its_phases_and_spends_no_sampling_on_others(rig) -> None:
    host, broker, engine = rig
    decode = engine.create(spec("block", "moments", phases=(pb.PHASE_DECODE,), every=2))
    plain = engine.create(spec("block", "moments", phases=(pb.PHASE_UNSPECIFIED,)))
    both = engine.create(spec("block", "moments", phases=(pb.PHASE_PREFILL, pb.PHASE_DECODE, pb.PHASE_DECODE)))
    anything = engine.create(spec("block", "moments"))
    assert (decode.phases, both.phases, anything.phases) == ({PHASE_DECODE}, {PHASE_PREFILL, PHASE_DECODE}, None)
    sub = broker.subscribe([t.id for t in (decode, plain, both, anything)])
    rows = (RequestRows("a", slice(0, 1), (4,)),)
    phases = [PHASE_DECODE, PHASE_PREFILL, PHASE_DECODE, PHASE_NONE, PHASE_DECODE]
    for i, phase in enumerate(phases):
        step(host, x_of(1, 4 if phase != PHASE_DECODE else 1, i), phase, rows if phase else ())
    got = drain(engine, sub)
    by_tap = {t.id: sorted((s.pass_index, s.phase) for s in got if s.tap == t.id)
              for t in (decode, plain, both, anything)}
    assert [p for _i, p in by_tap[anything.id]] == phases
    assert [p for _i, p in by_tap[plain.id]] == [PHASE_NONE]
    assert [p for _i, p in by_tap[both.id]] == [PHASE_DECODE, PHASE_PREFILL, PHASE_DECODE, PHASE_DECODE]
    # every_n=2 counts the tap's own passes: decode steps 1 and 3, not the prefill or plain pass between.
    assert [p for _i, p in by_tap[decode.id]] == [PHASE_DECODE, PHASE_DECODE]
    assert decode.hits == 2


def test_unknown_phases_are_refused_by_index(rig) -> None:
    _host, _broker, engine = rig
    with pytest.raises(InvalidField) as err:
        engine.create(spec("block", "moments", phases=(pb.PHASE_PREFILL, 7)))  # type: ignore[arg-type]
    assert err.value.field == "spec.phases[1]" and "PHASE_DECODE" in str(err.value)
    with pytest.raises(InvalidField) as err:
        engine.create(spec("block", "moments", phases=(-1,)), field_prefix="taps[2]")  # type: ignore[arg-type]
    assert err.value.field == "taps[2].phases[0]"
    assert not engine.all_taps()


def test_a_request_tap_reduces_its_rows_without_their_padding(rig) -> None:
    host, broker, engine = rig
    mine = engine.create(spec("block", *BASIC), request_id="b")
    table = engine.create(spec("rotary", *BASIC), request_id="b")  # batch 1: reduced whole
    whole = engine.create(spec("block", *BASIC))
    sub = broker.subscribe([mine.id, table.id, whole.id])
    # Prefill: "a" row 0, "b" rows 1-2 with 2 columns of shared left padding, 6 tokens.
    prefill = (RequestRows("a", slice(0, 1), (6,), 0), RequestRows("b", slice(1, 3), (4, 4), 2))
    ref = step(host, x_of(3, 6, 1), PHASE_PREFILL, prefill, ("block", "rotary"))
    # Decode: "b" first now, rows 0-1, different positions; a pad here must not cut anything.
    decode = (RequestRows("b", slice(0, 2), (4, 5), 1), RequestRows("a", slice(2, 3), (6,)))
    ref2 = step(host, x_of(3, 1, 2), PHASE_DECODE, decode, ("block",))
    step(host, x_of(1, 1, 3), PHASE_DECODE, (RequestRows("a", slice(0, 1), (7,)),))  # no "b": its taps are silent
    step(host, x_of(3, 6, 4))  # nor on a plain forward
    got = drain(engine, sub)
    mine_s = sorted((s for s in got if s.tap == mine.id), key=lambda s: s.pass_index)
    assert len(mine_s) == 2
    check(mine_s[0], ref["block"][1:3, 2:])
    assert place(mine_s[0]) == (PHASE_PREFILL, 4, ["b"])
    check(mine_s[1], ref2["block"][0:2])
    assert place(mine_s[1]) == (PHASE_DECODE, None, ["b"])
    table_s = [s for s in got if s.tap == table.id and s.phase == PHASE_PREFILL]
    check(table_s[0], ref["rotary"])  # (1, 6, 8): not the batch, so the whole table, padding included
    assert len(table_s) == 1 and place(table_s[0]) == (PHASE_PREFILL, 4, ["b"])
    whole_s = sorted((s for s in got if s.tap == whole.id), key=lambda s: s.pass_index)
    check(whole_s[0], ref["block"])
    assert place(whole_s[0]) == (PHASE_PREFILL, None, ["a", "b"])
    assert len(whole_s) == 4 and mine.hits == 2


def test_request_taps_never_reuse_the_whole_tensors_or_another_requests_result(rig, monkeypatch) -> None:
    host, broker, engine = rig
    engine.use_op = False  # the plan path's reuse keys (the whole tensor's taps fire as op calls otherwise)
    taps = [engine.create(spec("block", *BASIC)), engine.create(spec("block", *BASIC), request_id="a"),
            engine.create(spec("block", *BASIC), request_id="b"), engine.create(spec("block", *BASIC), request_id="a"),
            engine.create(spec("block", *BASIC))]
    sub = broker.subscribe([t.id for t in taps])
    runs: list[tuple[int, ...]] = []
    count_reductions(monkeypatch, lambda _plan, t: runs.append(tuple(t.shape)))
    requests = (RequestRows("a", slice(0, 2), (5, 5), 1), RequestRows("b", slice(2, 4), (5, 5), 3))
    ref = step(host, x_of(4, 5, 5), PHASE_PREFILL, requests, ("block",))["block"]
    got = {s.tap: s for s in drain(engine, sub)}
    check(got[taps[0].id], ref)
    check(got[taps[1].id], ref[0:2, 1:])
    check(got[taps[2].id], ref[2:4, 3:])
    check(got[taps[3].id], ref[0:2, 1:])
    check(got[taps[4].id], ref)
    # The second tap of "a" and the second whole tap reused; "b" and "a" each ran once on their own rows.
    assert sorted(runs) == sorted([(4, 5, HIDDEN), (2, 4, HIDDEN), (2, 2, HIDDEN)])
    assert engine.plans.reuse.reused == 2


def test_a_request_tap_on_inputs_and_with_every_reducer_never_syncs(rig) -> None:
    host, broker, engine = rig
    every = ["moments", "minmax", "abs_max", "zero_fraction", "nonfinite", "norm", "histogram", "quantiles",
             "per_channel"]
    tap = engine.create(spec("**", *every), request_id="b")
    inputs = engine.create(spec("head", *BASIC, point=pb.POINT_INPUT), request_id="b")
    sub = broker.subscribe([tap.id, inputs.id])
    x = x_of(3, 6, 6)
    requests = (RequestRows("a", slice(0, 1), (6,)), RequestRows("b", slice(1, 3), (3, 3), 3))
    seen: dict[str, np.ndarray] = {}
    handle = host.modules["head"].register_forward_pre_hook(
        lambda _m, a: seen.__setitem__("head", a[0].detach().double().numpy().copy()))
    with NoSyncMode(), host.pass_context(phase=PHASE_PREFILL, requests=requests, tokens=6), torch.inference_mode():
        host.module(x)
    handle.remove()
    got = drain(engine, sub)
    assert engine.reducer_errors == 0 and not tap.disabled, tap.last_error
    assert {s.layer for s in got if s.tap == tap.id} == set(tap.layers)
    (head_in,) = [s for s in got if s.tap == inputs.id]
    check(head_in, seen["head"][1:3, 3:])


def test_a_request_tap_watches_forward_points_only(rig) -> None:
    _host, _broker, engine = rig
    for point in (pb.POINT_GRAD_OUTPUT, pb.POINT_GRAD_INPUT, pb.POINT_PARAM_GRAD):
        with pytest.raises(InvalidField) as err:
            engine.create(spec("block", "moments", point=point), request_id="a")
        assert err.value.field == "spec.point"


def test_a_tap_file_names_phases_in_lower_case(tmp_path, rig) -> None:
    from layertap.server.taps.tap_files import load_tap_config

    _host, _broker, engine = rig
    path = tmp_path / "taps.yaml"
    path.write_text("taps:\n  - {name: steps, selector: block, reducers: [moments], phases: [decode, PHASE_PREFILL]}\n"
                    "  - {name: plain, selector: block, reducers: [moments], phases: [unspecified]}\n")
    steps, plain = load_tap_config(path)
    assert list(steps.phases) == [pb.PHASE_DECODE, pb.PHASE_PREFILL] and list(plain.phases) == [pb.PHASE_UNSPECIFIED]
    assert engine.create(steps, forever=True).phases == {PHASE_DECODE, PHASE_PREFILL}
    path.write_text("taps:\n  - {selector: block, reducers: [moments], phases: [moments, decoding]}\n")
    with pytest.raises(InvalidField, match=r"unknown phase 'moments'; valid: unspecified, prefill, decode") as err:
        load_tap_config(path)
    assert err.value.field == "taps[0].phases[0]"
