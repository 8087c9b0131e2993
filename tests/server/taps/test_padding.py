"""Padding left out of taps: a padded batch's statistics are those of its sequences without padding.

A toy token model that declares an ``attention_mask`` (position-wise, so a
valid position's activation does not depend on the padding around it) runs
padded batches through ``ModelHost``; every reference is float64 numpy over
the valid positions of the tensors the layers really produced, or over the
same sequences run one by one without padding.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch
from support.sync_guard import NoSyncMode
from torch import nn

from layertap.server.errors import InvalidField
from layertap.server.host.inputs import ModelInputs
from layertap.server.host.model_host import PHASE_DECODE, PHASE_PREFILL, ModelHost, RequestRows
from layertap.server.host.padding import PassPadding, host_mask, left_padding_mask
from layertap.server.host.sources import InputSpec, LoadedModel
from layertap.server.record.replay import Share, replay
from layertap.server.reducers.transfer import PassBuffer
from layertap.server.stream.broker import Broker
from layertap.server.taps.engine import TapEngine
from layertap.server.taps.tap_files import reducer_spec, tap_spec_from_dict
from layertap.v1 import telemetry_pb2 as pb
from tests.support.reductions import count_reductions
from tests.support.summaries import drain, results

pytestmark = pytest.mark.unit

VOCAB, HIDDEN, CLASSES = 32, 8, 5
BASIC = ("moments", "minmax", "zero_fraction")
EDGES = [-1.0, -0.5, 0.0, 0.25, 0.5, 1.0]


class Toy(nn.Module):
    """Embedding, a block and a head: every position on its own, as padding must leave it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.block = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(torch.relu(self.block(self.embed(input_ids))))


INPUTS = [InputSpec("input_ids", torch.int64, (-1, -1), vocab=VOCAB),
          InputSpec("attention_mask", torch.int64, (-1, -1), required=False, keyword=True, shape_of="input_ids")]


@pytest.fixture
def rig():
    torch.manual_seed(0)
    host = ModelHost(LoadedModel(Toy().eval(), "toy", "test", list(INPUTS)))
    broker = Broker(default_queue_size=10_000)
    engine = TapEngine(host, broker, rng=random.Random(0))
    yield host, broker, engine
    engine.close()


def spec(selector: str, *reducers: str | pb.ReducerSpec, keep_padding: bool = False,
         point: int = pb.POINT_OUTPUT) -> pb.TapSpec:
    return pb.TapSpec(selector=selector, point=point, keep_padding=keep_padding,
                      reducers=[r if isinstance(r, pb.ReducerSpec) else reducer_spec(r, "r") for r in reducers])


def histogram() -> pb.ReducerSpec:
    return pb.ReducerSpec(kind=pb.REDUCER_KIND_HISTOGRAM, histogram=pb.HistogramParams(edges=EDGES))


def per_channel(dim: int | None = None) -> pb.ReducerSpec:
    params = pb.PerChannelParams() if dim is None else pb.PerChannelParams(dim=dim)
    return pb.ReducerSpec(kind=pb.REDUCER_KIND_PER_CHANNEL, per_channel=params)


def outputs(host: ModelHost, ids: torch.Tensor, layers: tuple[str, ...] = ("block", "head")) -> dict[str, np.ndarray]:
    """``layers``' outputs of a local forward of ``ids`` (no pass, no taps), as float64."""
    seen: dict[str, np.ndarray] = {}
    handles = [host.modules[n].register_forward_hook(
        lambda _m, _a, o, _n=n: seen.__setitem__(_n, o.detach().cpu().double().numpy())) for n in layers]
    try:
        with torch.inference_mode():
            host.module(ids)
    finally:
        for h in handles:
            h.remove()
    return seen


def unpadded(host: ModelHost, ids: torch.Tensor, mask: torch.Tensor, layer: str) -> np.ndarray:
    """``layer``'s outputs for each sequence run alone, without its padding, as one (valid, ...) array."""
    return np.concatenate([outputs(host, row[m.bool()].unsqueeze(0), (layer,))[layer][0] for row, m in zip(ids, mask)])


def check_basic(s: pb.Summary, ref: np.ndarray) -> None:
    res = results(s)
    assert res["moments"].moments.count == ref.size
    np.testing.assert_allclose(res["moments"].moments.mean, ref.mean(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(res["moments"].moments.std, ref.std(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose([res["minmax"].minmax.min, res["minmax"].minmax.max], [ref.min(), ref.max()], rtol=1e-6)
    assert res["zero_fraction"].zero_fraction.fraction == np.count_nonzero(ref == 0) / ref.size


def confidence(logits: np.ndarray) -> dict[str, float]:
    rows = logits.reshape(-1, logits.shape[-1])
    e = np.exp(rows - rows.max(1, keepdims=True))
    p = np.sort(e / e.sum(1, keepdims=True), 1)
    entropy = -(p * np.log(p)).sum(1)
    margin = p[:, -1] - p[:, -2]
    return {"rows": len(rows), "entropy_mean": entropy.mean(), "entropy_max": entropy.max(),
            "top1_mean": p[:, -1].mean(), "top1_min": p[:, -1].min(), "margin_mean": margin.mean(),
            "margin_min": margin.min()}


def batch(side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Three sequences of 6, 4 and 1 tokens padded to 6 on ``side``, ids 0 (a real id) at the padding."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (3, 6), generator=gen)
    mask = torch.ones(3, 6, dtype=torch.long)
    for row, pad in ((1, 2), (2, 5)):
        cols = slice(0, pad) if side == "left" else slice(6 - pad, 6)
        mask[row, cols], ids[row, cols] = 0, 0
    return ids, mask


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_changes_nothing(rig, side: str) -> None:
    host, broker, engine = rig
    every = (*BASIC, per_channel(-1), histogram(), "quantiles")  # -1: a non-token model's default is dim 1
    taps = [engine.create(spec("block", *every)), engine.create(spec("head", "logits")),
            engine.create(spec("block", *every, keep_padding=True)), engine.create(spec("head", "logits", keep_padding=True))]
    sub = broker.subscribe([t.id for t in taps])
    ids, mask = batch(side)
    host.run([("input_ids", ids), ("attention_mask", mask)])
    got = {s.tap: s for s in drain(engine, sub)}
    whole = outputs(host, ids)
    valid = mask.bool().numpy()
    for name in ("block", "head"):  # the valid positions of the padded batch are the unpadded sequences'
        np.testing.assert_allclose(whole[name][valid], unpadded(host, ids, mask, name), rtol=1e-6, atol=1e-7)
    for s, block, head in ((got[taps[0].id], whole["block"][valid], whole["head"][valid]),
                           (got[taps[2].id], whole["block"], whole["head"])):
        kept = s is got[taps[2].id]
        flat = block.reshape(-1, HIDDEN)
        assert flat.shape[0] == (18 if kept else 11)
        check_basic(s, flat)
        res = results(s)
        pc = res["per_channel"].per_channel
        assert (pc.dim, pc.channels) == (-1, HIDDEN)
        np.testing.assert_allclose(pc.mean, flat.mean(0), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(pc.std, flat.std(0), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(pc.abs_max, np.abs(flat).max(0), rtol=1e-6)
        h = res["histogram"].histogram
        assert list(h.counts) == np.histogram(flat, [-np.inf, *EDGES, np.inf])[0].tolist()
        assert h.population == flat.size
        q = res["quantiles"].quantiles
        np.testing.assert_allclose(q.values, np.quantile(flat, list(q.probabilities)), rtol=1e-6, atol=1e-7)
        lg = results(got[taps[3 if kept else 1].id])["logits"].logits
        want = confidence(head.reshape(-1, CLASSES))
        assert (lg.rows, lg.classes) == (want.pop("rows"), CLASSES)
        for name, value in want.items():
            assert getattr(lg, name) == pytest.approx(value, abs=1e-6), name


def test_no_padding_and_no_mask_reduce_whole(rig) -> None:
    host, broker, engine = rig
    tap = engine.create(spec("block", *BASIC))
    sub = broker.subscribe([tap.id])
    ids, _mask = batch("left")
    host.run([("input_ids", ids), ("attention_mask", torch.ones_like(ids))])
    host.run([("input_ids", ids)])
    ref = outputs(host, ids)["block"]
    got = drain(engine, sub)
    assert len(got) == 2
    for s in got:
        check_basic(s, ref)


def test_a_model_without_a_mask_input_never_leaves_anything_out() -> None:
    host = ModelHost(LoadedModel(Toy().eval(), "toy", "test", [INPUTS[0]]))
    assert not host.masked
    with host.pass_context(attention_mask=torch.zeros(2, 3)) as ctx:
        assert ctx.attention_mask is None


def test_the_mask_is_read_on_the_host_only() -> None:
    ids, mask = batch("left")
    assert host_mask(ModelInputs((ids,), {"attention_mask": mask}), INPUTS) is mask
    assert host_mask(ModelInputs((ids, mask)), INPUTS) is mask  # bound by position
    assert host_mask(ModelInputs((ids,)), INPUTS) is None
    assert host_mask(ModelInputs((ids,), {"attention_mask": mask[0]}), INPUTS) is None  # not (batch, tokens)
    assert host_mask(None, INPUTS) is None
    assert left_padding_mask([0, 0], 4) is None
    np.testing.assert_array_equal(left_padding_mask([2, 0], 3).numpy(), [[False, False, True], [True, True, True]])
    padding = PassPadding(mask)
    cut = padding.cut()
    assert cut is not None and (cut.lead, cut.valid, cut.excluded) == ((3, 6), 11, 7)
    assert padding.cut() is cut  # once per pass
    assert padding.cut(slice(0, 1), 0) is None  # a row without padding: nothing to leave out
    assert padding.cut(slice(1, 2), 2) is None  # its padding already cut with the rows
    assert cut.key != padding.cut(slice(1, 3), 1).key  # type: ignore[union-attr]


def test_a_tap_skipped_this_pass_never_gives_its_module_call_the_whole_tensor(rig) -> None:
    """Two basic taps share the module's op call; the first to fire is skipped this pass (another phase)
    and holds no padding: the call still leaves the padding out, for the tap that sees the pass."""
    host, broker, engine = rig
    skipped = spec("block", *BASIC)
    skipped.phases.append(pb.PHASE_DECODE)
    engine.create(skipped)
    seeing = engine.create(spec("block", *BASIC))
    assert engine._layout is not None and len(engine._layout.modules) == 1  # one shared call
    sub = broker.subscribe([seeing.id])
    ids, mask = batch("left")
    host.run([("input_ids", ids), ("attention_mask", mask)])
    (got,) = drain(engine, sub)
    check_basic(got, outputs(host, ids)["block"][mask.bool().numpy()])


def test_equal_taps_share_one_selection_and_never_the_whole_tensors_result(rig, monkeypatch) -> None:
    host, broker, engine = rig
    engine.use_op = False  # the plan path's reuse keys (keep_padding taps fire as op calls otherwise)
    taps = [engine.create(spec("block", *BASIC)), engine.create(spec("block", *BASIC, keep_padding=True)),
            engine.create(spec("block", *BASIC)), engine.create(spec("block", *BASIC, keep_padding=True))]
    sub = broker.subscribe([t.id for t in taps])
    runs: list[tuple[int, ...]] = []
    count_reductions(monkeypatch, lambda _plan, t: runs.append(tuple(t.shape)))
    ids, mask = batch("right")
    host.run([("input_ids", ids), ("attention_mask", mask)])
    got = {s.tap: s for s in drain(engine, sub)}
    whole = outputs(host, ids)["block"]
    for i in (0, 2):
        check_basic(got[taps[i].id], whole[mask.bool().numpy()])
        check_basic(got[taps[i + 1].id], whole)
    assert sorted(runs) == [(3, 6, HIDDEN), (11, HIDDEN)] and engine.plans.reuse.reused == 2


def test_per_channel_names_axes_of_the_unfolded_tensor(rig) -> None:
    host, broker, engine = rig
    with pytest.raises(InvalidField) as err:
        engine.create(spec("block", "moments", per_channel(1)))
    assert err.value.field == "spec.reducers[1].per_channel.dim" and "keep_padding" in str(err.value)
    with pytest.raises(InvalidField):
        engine.create(spec("block", per_channel(0)), field_prefix="taps[0]")
    kept = engine.create(spec("block", per_channel(1), keep_padding=True))  # token positions, padding included
    explicit = engine.create(spec("block", per_channel(2)))
    backwards = engine.create(spec("block", per_channel(-1)))
    token_axis = engine.create(spec("block", per_channel(-2)))  # refused only once a tensor shows the axis
    plain = engine.create(spec("block", per_channel()))
    with pytest.raises(InvalidField) as err:
        engine.set_layer_reducers(plain.id, "block", [per_channel(1)])
    assert err.value.field.endswith("per_channel.dim")
    sub = broker.subscribe([t.id for t in (kept, explicit, backwards, token_axis, plain)])
    ids, mask = batch("left")
    host.run([("input_ids", ids), ("attention_mask", mask)])
    got = {s.tap: results(s)["per_channel"].per_channel for s in drain(engine, sub) if s.results}
    ref = outputs(host, ids)["block"]
    assert got[kept.id].channels == 6
    np.testing.assert_allclose(got[kept.id].mean, ref.mean(axis=(0, 2)), rtol=1e-6, atol=1e-7)
    valid = ref[mask.bool().numpy()]
    for tap, dim in ((explicit, 2), (backwards, -1), (plain, 2)):
        assert (got[tap.id].dim, got[tap.id].channels) == (dim, HIDDEN)
        np.testing.assert_allclose(got[tap.id].mean, valid.mean(0), rtol=1e-6, atol=1e-7)
    assert token_axis.disabled and "batch or token axis" in token_axis.last_error and "keep_padding" in token_axis.last_error


def test_a_prefill_leaves_out_each_rows_padding_once(rig) -> None:
    host, broker, engine = rig
    whole = engine.create(spec("block", *BASIC))
    mine = engine.create(spec("block", *BASIC), request_id="a")
    other = engine.create(spec("block", *BASIC), request_id="b")
    kept = engine.create(spec("block", *BASIC, keep_padding=True), request_id="a")
    sub = broker.subscribe([t.id for t in (whole, mine, other, kept)])
    # "a": two prompts of 5 and 3 tokens (rows 0-1, one shared column of padding), "b": 6 tokens (row 2).
    pads = [1, 3, 0]
    ids = torch.randint(1, VOCAB, (3, 6), generator=torch.Generator().manual_seed(4))
    mask = left_padding_mask(pads, 6)
    assert mask is not None
    requests = (RequestRows("a", slice(0, 2), (5, 3), 1), RequestRows("b", slice(2, 3), (6,), 0))
    with host.pass_context(phase=PHASE_PREFILL, requests=requests, tokens=6, attention_mask=mask), \
            torch.inference_mode():
        host.module(input_ids=ids, attention_mask=mask)
    decode = torch.randint(1, VOCAB, (3, 1), generator=torch.Generator().manual_seed(5))
    with host.pass_context(phase=PHASE_DECODE, requests=requests, tokens=1,
                           attention_mask=left_padding_mask([0, 0, 0], 1)), torch.inference_mode():
        host.module(input_ids=decode)
    got = {(s.tap, s.phase): s for s in drain(engine, sub)}
    ref, valid = outputs(host, ids)["block"], mask.numpy()
    check_basic(got[whole.id, PHASE_PREFILL], ref[valid])
    check_basic(got[mine.id, PHASE_PREFILL], ref[0:2, 1:][valid[0:2, 1:]])  # its rows, its shared pad, then row 1's
    assert results(got[mine.id, PHASE_PREFILL])["moments"].moments.count == (5 + 3) * HIDDEN
    check_basic(got[other.id, PHASE_PREFILL], ref[2:3])
    check_basic(got[kept.id, PHASE_PREFILL], ref[0:2, 1:])
    step = outputs(host, decode)["block"]
    check_basic(got[whole.id, PHASE_DECODE], step)
    check_basic(got[mine.id, PHASE_DECODE], step[0:2])


def test_leaving_padding_out_never_syncs(rig) -> None:
    host, broker, engine = rig
    every = ["moments", "minmax", "abs_max", "zero_fraction", "nonfinite", "norm", "histogram", "quantiles",
             "per_channel", "logits"]
    taps = [engine.create(spec("**", *every)), engine.create(spec("embed", *BASIC, point=pb.POINT_INPUT)),
            engine.create(spec("block", *BASIC), request_id="a")]
    sub = broker.subscribe([t.id for t in taps])
    ids, mask = batch("left")
    bound = host.validate_inputs([("input_ids", ids), ("attention_mask", mask)])
    requests = (RequestRows("a", slice(0, 2), (6, 4), 0), RequestRows("b", slice(2, 3), (1,), 5))
    with NoSyncMode() as mode, host.pass_context(inputs=bound, phase=PHASE_PREFILL, requests=requests, tokens=6), \
            torch.inference_mode():
        host.forward(host.to_device(bound))
    got = drain(engine, sub)
    assert engine.reducer_errors == 0, [t.last_error for t in taps]
    assert torch.ops.aten.index_select.default in mode.ops
    ref = outputs(host, ids)["block"]
    (block,) = [s for s in got if s.tap == taps[0].id and s.layer == "block"]
    check_basic(block, ref[mask.bool().numpy()])
    (ids_in,) = [s for s in got if s.tap == taps[1].id]
    assert results(ids_in)["moments"].moments.count == 11  # the (batch, tokens) ids themselves, less padding
    (mine,) = [s for s in got if s.tap == taps[2].id]
    check_basic(mine, ref[0:2][mask[0:2].bool().numpy()])


def test_a_replay_checks_the_valid_positions_the_live_pass_reduced(rig) -> None:
    host, broker, engine = rig
    taps = [engine.create(spec("block", *BASIC)), engine.create(spec("block", *BASIC, keep_padding=True))]
    sub = broker.subscribe([t.id for t in taps])
    ids, mask = batch("left")
    inputs = host.validate_inputs([("input_ids", ids), ("attention_mask", mask)])
    host.run(inputs)
    got = {s.tap: s for s in drain(engine, sub)}
    shares = [Share(t, [got[t.id]], 1 << 20, lambda _layer, _t: []) for t in taps]
    replay(host, shares, inputs)
    assert [s.problems for s in shares] == [[], []]
    # The check does compare: the whole tensor's statistics are not the live summary's.
    wrong = Share(taps[0], [got[taps[1].id]], 1 << 20, lambda _layer, _t: [])
    replay(host, [wrong], inputs)
    assert wrong.problems and "moments" in wrong.problems[0]


def test_a_tap_file_keeps_padding_by_its_proto_name() -> None:
    assert tap_spec_from_dict({"selector": "block", "reducers": ["moments"], "keep_padding": True}, "taps[0]").keep_padding
    assert not tap_spec_from_dict({"selector": "block", "reducers": ["moments"]}, "taps[0]").keep_padding


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_leaving_padding_out_never_syncs_on_cuda() -> None:
    """The index goes to the device pinned and without waiting; the hooks select and reduce with no sync."""
    torch.manual_seed(0)
    host = ModelHost(LoadedModel(Toy().eval(), "toy", "test", list(INPUTS)), device="cuda")
    broker = Broker(default_queue_size=10_000)
    engine = TapEngine(host, broker, rng=random.Random(0))  # no stats kernel: eager, no compile in the debug mode's way
    assert engine.stats is None
    try:
        taps = [engine.create(spec("block", *BASIC, per_channel(), histogram())), engine.create(spec("head", "logits")),
                engine.create(spec("block", *BASIC), request_id="a")]
        sub = broker.subscribe([t.id for t in taps])
        ids, mask = batch("left")
        bound = host.validate_inputs([("input_ids", ids), ("attention_mask", mask)])
        on_device = host.to_device(bound)
        requests = (RequestRows("a", slice(0, 2), (6, 4), 0), RequestRows("b", slice(2, 3), (1,), 5))
        gate = threading.Event()
        # Park the host-transfer thread: its event wait is the pass's one sync, after the debug mode ends.
        engine.transfer.submit(PassBuffer().finish(), lambda _values: gate.wait(30))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(2):  # the first pass also fills the pinned pool
                with host.pass_context(inputs=bound, phase=PHASE_PREFILL, requests=requests, tokens=6), \
                        torch.inference_mode():
                    host.forward(on_device)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            gate.set()
        got = drain(engine, sub)
        assert engine.reducer_errors == 0, [t.last_error for t in taps]
        ref = outputs(host, ids.cuda())
        valid = mask.bool().numpy()
        blocks = [s for s in got if s.tap == taps[0].id]
        assert len(blocks) == 2
        for s in blocks:
            check_basic(s, ref["block"][valid])
        assert results([s for s in got if s.tap == taps[1].id][0])["logits"].logits.rows == 11
        check_basic([s for s in got if s.tap == taps[2].id][0], ref["block"][0:2][valid[0:2]])
    finally:
        engine.close()


def test_a_two_dim_tensor_under_a_per_channel_plan_is_reduced_whole(rig) -> None:
    """Folded, a (batch, tokens) tensor has no feature axis left: a plan with a per-channel reducer reads
    it whole (padding kept) rather than failing on the first padded pass; other plans still leave it out."""
    host, broker, engine = rig
    channels = engine.create(spec("embed", "moments", per_channel(), point=pb.POINT_INPUT))
    plain = engine.create(spec("embed", "moments", point=pb.POINT_INPUT))
    sub = broker.subscribe([channels.id, plain.id])
    ids, mask = batch("left")
    host.run([("input_ids", ids), ("attention_mask", mask)])
    got = {s.tap: results(s) for s in drain(engine, sub) if s.results}
    assert not channels.disabled, channels.last_error
    assert got[channels.id]["moments"].moments.count == ids.numel()
    assert got[plain.id]["moments"].moments.count == int(mask.sum())
