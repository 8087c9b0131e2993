"""The flight recorder's parts: the incident ring, input retention, triggers and rows."""

from __future__ import annotations

import math

import pytest
import torch

from layertap.server.errors import InvalidField, NotFound
from layertap.server.record.replay import anomalous_rows
from layertap.server.record.retention import InputRetention
from layertap.server.record.store import IncidentStore, RingLimits, StoredTensor, new_id
from layertap.server.record.triggers import RateLimit, check_triggers, evaluate
from layertap.server.taps.tap import timestamp
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _incident(store: IncidentStore, when: float, payload: int = 1000) -> pb.Incident:
    rec = pb.Incident(id=new_id(when), tap="t", triggers=["nonfinite"], time=timestamp(when))
    data = bytes(payload)
    header = pb.CaptureHeader(layer="", point=pb.POINT_INPUT, dtype=1, shape=[payload // 4], total_bytes=payload)
    return store.write(rec, [StoredTensor(header, data)])


def test_ring_evicts_oldest_by_total_bytes(tmp_path):
    clock = Clock()
    store = IncidentStore(tmp_path, RingLimits(max_bytes=3500), clock=clock)
    recs = [_incident(store, clock.now + i) for i in range(5)]
    size = recs[0].bytes
    assert 1000 < size < 1200
    kept = store.entries()
    assert [r.id for r in kept] == [r.id for r in reversed(recs)][: 3500 // size]
    assert store.total_bytes <= 3500
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{r.id}.incident" for r in kept)


def test_ring_evicts_by_age_and_count(tmp_path):
    clock = Clock()
    store = IncidentStore(tmp_path, RingLimits(max_age_seconds=60, max_count=3), clock=clock)
    old = _incident(store, clock.now)
    clock.now += 30
    mid = _incident(store, clock.now)
    clock.now += 40  # `old` is 70 s old now
    assert [r.id for r in store.entries()] == [mid.id]
    assert not (tmp_path / f"{old.id}.incident").exists()
    for i in range(4):
        _incident(store, clock.now + i)
    assert len(store.entries()) == 3 and mid.id not in {r.id for r in store.entries()}


def test_per_incident_cap_drops_tensors_and_says_so(tmp_path):
    store = IncidentStore(tmp_path, RingLimits(max_incident_bytes=1500), clock=lambda: 2.0)
    rec = pb.Incident(id=new_id(1.0), tap="t", time=timestamp(1.0))
    header = pb.CaptureHeader(layer="a", dtype=1, shape=[250], total_bytes=1000)
    store.write(rec, [StoredTensor(header, bytes(1000)), StoredTensor(header, bytes(1000))])
    got, tensors = store.read(rec.id)
    assert (got.tensor_count, got.tensors_dropped, len(tensors)) == (1, 1, 1)
    assert got.bytes == (tmp_path / f"{rec.id}.incident").stat().st_size <= 1500


def test_restart_reloads_and_corruption_is_skipped_and_counted(tmp_path):
    store = IncidentStore(tmp_path, clock=lambda: 10.0e8)
    a, b = _incident(store, 10.0e8), _incident(store, 10.0e8 + 1)
    # A flipped byte in b's tensors: the index loads, reading it fails and drops it.
    path = tmp_path / f"{b.id}.incident"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    (tmp_path / "inc-0000000000002-00000000.incident").write_bytes(b"not an incident")
    (tmp_path / ".inc-0000000000003-00000000.incident.tmp").write_bytes(b"half written")
    again = IncidentStore(tmp_path, clock=lambda: 10.0e8)
    assert {r.id for r in again.entries()} == {a.id, b.id}
    assert again.skipped_files == 1
    assert not list(tmp_path.glob(".*.tmp"))
    assert again.read(a.id)[1][0].data == bytes(1000)
    with pytest.raises(NotFound):
        again.read(b.id)
    assert again.skipped_files == 2 and [r.id for r in again.entries()] == [a.id]
    with pytest.raises(InvalidField):
        again.get("../../etc/passwd")


def test_retention_is_bounded_and_counts_lost_passes():
    t = torch.zeros(256)  # 1 KiB
    r = InputRetention(3 * 1024)
    for i in range(5):
        r.keep(i, [t])
    assert len(r) == 3 and r.held_bytes == 3 * 1024 and r.lost == 2  # passes 0, 1 pushed out pinned
    r.forget(2)  # published nothing: not a loss
    assert r.lost == 2 and len(r) == 2
    assert r.take(4) is not None and r.lost == 3  # pass 3 was never evaluated: lost on the way
    assert r.take(4) is None and r.held_bytes == 0
    r.keep(9, [torch.zeros(2048)])  # larger than the whole bound
    assert r.lost == 4 and len(r) == 0


def test_triggers_fire_per_layer_and_rate_limit():
    trig = pb.Triggers(nonfinite=True, abs_max_above=10, mean_sigma=3)

    def summary(layer, nan=0, amax=1.0, mean=0.0, phase=pb.PHASE_UNSPECIFIED):
        return pb.Summary(tap="t", layer=layer, phase=phase, results=[
            pb.ReducerResult(nonfinite=pb.Nonfinite(nan_count=nan)), pb.ReducerResult(abs_max=pb.AbsMax(value=amax)),
            pb.ReducerResult(moments=pb.Moments(count=4, mean=mean, std=1))])

    base = {("c", pb.PHASE_UNSPECIFIED): (0.0, 0.5), ("e", pb.PHASE_DECODE): (5.0, 0.5)}
    firing = evaluate(trig, [summary("a", nan=1), summary("b", amax=11), summary("c", mean=1.6), summary("d", mean=9),
                             summary("e", mean=5.2, phase=pb.PHASE_DECODE), summary("e", mean=5.2)],
                      lambda layer, _p, phase: base.get((layer, phase)))
    assert firing is not None
    # d has no baseline; e's decode step is within its decode baseline, and its plain forward has none.
    assert firing.layers == {"a": ["nonfinite"], "b": ["abs_max"], "c": ["mean_sigma"]}
    decode = evaluate(trig, [summary("e", mean=1.0, phase=pb.PHASE_DECODE)], lambda layer, _p, phase: base.get((layer, phase)))
    assert decode is not None and decode.layers == {"e": ["mean_sigma"]}  # 8 sigma off the decode baseline
    assert firing.triggers == ["abs_max", "mean_sigma", "nonfinite"]
    assert evaluate(trig, [summary("a", mean=1.4)], lambda *_: (0.0, 0.5)) is None
    clock = Clock(0.0)
    limit = RateLimit(clock)
    assert limit.admit("t", ["nonfinite", "abs_max"], 10) == ["nonfinite", "abs_max"]
    clock.now = 9.9
    assert limit.admit("t", ["nonfinite"], 10) == [] and limit.admit("u", ["nonfinite"], 10) == ["nonfinite"]
    clock.now = 10.0
    assert limit.admit("t", ["nonfinite", "abs_max"], 10) == ["nonfinite", "abs_max"]


def test_trigger_validation_names_the_field():
    spec = pb.TapSpec(selector="x", reducers=[pb.ReducerSpec(kind=pb.REDUCER_KIND_ABS_MAX)],
                      triggers=pb.Triggers(abs_max_above=1, mean_sigma=2))
    with pytest.raises(InvalidField) as err:
        check_triggers(spec, durable=True)
    assert err.value.field == "spec.triggers.mean_sigma"
    spec.triggers.mean_sigma = 0
    check_triggers(spec, durable=True)
    with pytest.raises(InvalidField) as err:
        check_triggers(spec, durable=False, field_prefix="stream_taps[0]")
    assert err.value.field == "stream_taps[0].triggers"
    spec.point = pb.POINT_GRAD_OUTPUT
    with pytest.raises(InvalidField):
        check_triggers(spec, durable=True)
    spec.point = pb.POINT_OUTPUT
    for bad in (math.inf, 1e-300, 0.5, 86401):  # 1e-300 fired on every pass, each a replay, flooding the ring
        spec.triggers.min_interval_seconds = bad
        with pytest.raises(InvalidField) as err:
            check_triggers(spec, durable=True)
        assert err.value.field == "spec.triggers.min_interval_seconds"
    for good in (0, 1, 86400):
        spec.triggers.min_interval_seconds = good
        check_triggers(spec, durable=True)


def test_anomalous_rows_match_a_float64_reference():
    x = torch.randn(5, 3, 4, dtype=torch.float32)
    x[1, 0, 0] = float("nan")
    x[3, 2, 1] = 50.0
    x[4] += 10.0
    trig = pb.Triggers(nonfinite=True, abs_max_above=20, mean_sigma=3)
    assert anomalous_rows(x, trig, ["nonfinite"], None) == [1]
    assert anomalous_rows(x, trig, ["abs_max"], None) == [1, 3]
    rows = x.double().reshape(5, -1).mean(1)
    want = [i for i in range(5) if math.isnan(rows[i]) or abs(float(rows[i])) > 3 * 1.0]
    assert anomalous_rows(x, trig, ["mean_sigma"], (0.0, 1.0)) == want


def test_per_incident_cap_cuts_once_and_keeps_what_fits(tmp_path, monkeypatch):
    """Over the cap the cut comes from the sizes and the file is encoded once (it was once per dropped tensor)."""
    from layertap.server.record import store as store_module

    calls = []
    real = store_module.encode
    monkeypatch.setattr(store_module, "encode", lambda rec, ts, owner="": calls.append(len(ts)) or real(rec, ts, owner))
    store = IncidentStore(tmp_path, RingLimits(max_incident_bytes=20_000), clock=lambda: 2.0)
    rec = pb.Incident(id=new_id(1.0), tap="t", time=timestamp(1.0))
    tensors = [StoredTensor(pb.CaptureHeader(layer=f"l{i}", dtype=1, shape=[250], total_bytes=1000), bytes([i]) * 1000)
               for i in range(200)]
    store.write(rec, tensors)
    assert len(calls) == 1
    kept = calls[0]
    size = (tmp_path / f"{rec.id}.incident").stat().st_size
    assert size == rec.bytes <= 20_000
    # One more tensor would not have fitted.
    probe = pb.Incident()
    probe.CopyFrom(rec)
    assert len(real(probe, tensors[:kept + 1])) > 20_000
    got, stored = store.read(rec.id)
    assert (got.tensor_count, got.tensors_dropped) == (kept, 200 - kept)
    assert [t.header.layer for t in stored] == [f"l{i}" for i in range(kept)]
    assert all(t.data == bytes([i]) * 1000 for i, t in enumerate(stored))


def _file_of(store: IncidentStore, rec: pb.Incident):
    return store.dir / f"{rec.id}.incident"


def test_truncated_or_crafted_tensor_sections_are_skipped_not_internal(tmp_path):
    import struct
    import zlib

    from layertap.server.record import store as store_module

    u32 = struct.Struct("<I").pack

    def raw_file(rec: pb.Incident, body: bytes) -> None:
        """A file with a valid record (its ``bytes`` the file's size, as encode settles it) and ``body``."""
        for _ in range(3):
            rec.bytes = len(store_module.MAGIC) + 8 + 4 + len(rec.SerializeToString()) + 4 + len(body)
        head = u32(0) + rec.SerializeToString()  # no owner: the server's
        _file_of(store, rec).write_bytes(store_module.MAGIC + u32(len(head)) + u32(zlib.crc32(head)) + head
                                         + u32(zlib.crc32(body)) + body)

    def cut_short(rec: pb.Incident) -> None:
        path = _file_of(store, rec)
        raw = path.read_bytes()
        n = struct.unpack("<I", raw[8:12])[0]
        path.write_bytes(raw[:16 + n + 2])  # inside the tensor CRC

    store = IncidentStore(tmp_path, clock=lambda: 10.0e8)
    early, cut = _incident(store, 10.0e8 - 1), _incident(store, 10.0e8)
    cut_short(early)  # before a restart: the reload sees the size disagree with the record
    crafted = pb.Incident(id=new_id(10.0e8 + 1), tap="t", time=timestamp(10.0e8 + 1))
    raw_file(crafted, b"\xff\xff\xff\x7fjunk")  # a header "length" past the end
    garbled = pb.Incident(id=new_id(10.0e8 + 2), tap="t", time=timestamp(10.0e8 + 2))
    raw_file(garbled, u32(3) + b"\xff\xff\xff")  # a header that does not decode
    again = IncidentStore(tmp_path, clock=lambda: 10.0e8)
    assert again.skipped_files == 1 and early.id not in {r.id for r in again.entries()}
    assert len(again.entries()) == 3 and again.total_bytes == sum(r.bytes for r in again.entries())
    cut_short(cut)  # while the server runs: found when read
    for k, rec in enumerate((cut, crafted, garbled), start=2):
        with pytest.raises(NotFound) as err:
            again.read(rec.id)
        assert "unreadable" in str(err.value)
        assert again.skipped_files == k and rec.id not in {r.id for r in again.entries()}


def test_a_file_deleted_after_the_index_lookup_is_not_found_and_not_counted(tmp_path):
    store = IncidentStore(tmp_path, clock=lambda: 10.0e8)
    rec = _incident(store, 10.0e8)
    _file_of(store, rec).unlink()  # an eviction or delete racing the read
    with pytest.raises(NotFound) as err:
        store.read(rec.id)
    assert "unreadable" not in str(err.value)
    assert store.skipped_files == 0 and store.entries() == []


def test_read_uses_one_handle(tmp_path, monkeypatch):
    """A delete between reading the record and the tensors must not look like a corrupt file."""
    from layertap.server.record import store as store_module

    store = IncidentStore(tmp_path, clock=lambda: 10.0e8)
    rec = _incident(store, 10.0e8)
    real = store_module._read_record

    def then_delete(fh):
        got = real(fh)
        _file_of(store, rec).unlink()
        return got

    monkeypatch.setattr(store_module, "_read_record", then_delete)
    got, tensors = store.read(rec.id)
    assert got.id == rec.id and tensors[0].data == bytes(1000)
    assert store.skipped_files == 0


def test_inputs_taken_for_a_replay_stay_counted_until_released():
    t = torch.zeros(256)  # 1 KiB
    r = InputRetention(3 * 1024)
    r.keep(0, [t])
    taken = r.take(0)
    assert taken is not None and (r.held_bytes, r.queued_bytes) == (0, 1024)
    for i in range(1, 4):
        r.keep(i, [t])
        assert r.held_bytes + r.queued_bytes <= 3 * 1024
    assert len(r) == 2 and r.lost == 1  # pass 1 pushed out: the queued input holds its KiB
    r.keep(9, [torch.zeros(768)])  # 3 KiB: only fits once the queued input is released
    assert r.lost == 2 and len(r) == 2
    r.release(taken)
    assert r.queued_bytes == 0
    r.keep(10, [torch.zeros(768)])
    assert r.held_bytes == 3 * 1024 and len(r) == 1


@pytest.mark.parametrize("step", [None, 0, 42])
def test_recorded_tensors_are_headed_by_the_live_pass_and_its_step(tmp_path, step):
    from layertap.server.host.model_host import PassContext
    from layertap.server.record.recorder import _stored

    stored = _stored(torch.ones(2, 3), "fc", pb.POINT_OUTPUT, 0, 1, PassContext(9, step=step))
    clock = Clock()
    store = IncidentStore(tmp_path, clock=clock)
    rec = pb.Incident(id=new_id(clock.now), tap="t", pass_index=9, time=timestamp(clock.now))
    store.write(rec, [stored])
    _, (back,) = store.read(rec.id)
    h = back.header
    assert (h.layer, h.pass_index, h.call_index, h.has_step, h.step) == ("fc", 9, 1, step is not None, step or 0)


def test_the_owner_is_in_the_file_and_files_without_one_are_the_servers(tmp_path):
    """The owner survives a restart; a file of the first layout (no owner) loads as the server's (``""``)."""
    import struct
    import zlib

    from layertap.server.record import store as store_module

    store = IncidentStore(tmp_path, clock=lambda: 10.0e8)
    mine = store.write(pb.Incident(id=new_id(10.0e8), tap="t", time=timestamp(10.0e8)), [], owner="alice")
    ours = store.write(pb.Incident(id=new_id(10.0e8 + 1), tap="g", time=timestamp(10.0e8 + 1)), [])
    old = pb.Incident(id=new_id(10.0e8 + 2), tap="t", time=timestamp(10.0e8 + 2))
    for _ in range(3):
        old.bytes = len(store_module.MAGIC_V1) + 8 + len(old.SerializeToString()) + 4
    head, u32 = old.SerializeToString(), struct.Struct("<I").pack
    (tmp_path / f"{old.id}.incident").write_bytes(
        store_module.MAGIC_V1 + u32(len(head)) + u32(zlib.crc32(head)) + head + u32(zlib.crc32(b"")))
    again = IncidentStore(tmp_path, clock=lambda: 10.0e8)
    assert again.skipped_files == 0
    assert [again.owner_of(r.id) for r in (mine, ours, old)] == ["alice", "", ""]
    assert [r.id for r in again.entries(owner="alice")] == [mine.id]
    assert [r.id for r in again.entries(owner="")] == [old.id, ours.id]
    assert [r.id for r in again.entries(tap="t", owner="bob")] == []
    assert again.read(old.id)[0].tap == "t" and again.read(mine.id)[0].tap == "t"
    again.delete(mine.id)
    with pytest.raises(NotFound):
        again.owner_of(mine.id)


def test_the_per_incident_cap_counts_the_owner(tmp_path):
    """A long owner takes room in the file: fewer tensors fit, and the file stays under the cap."""
    store = IncidentStore(tmp_path, RingLimits(max_incident_bytes=1500), clock=lambda: 2.0)
    rec = pb.Incident(id=new_id(1.0), tap="t", time=timestamp(1.0))
    header = pb.CaptureHeader(layer="a", dtype=1, shape=[125], total_bytes=500)
    store.write(rec, [StoredTensor(header, bytes(500)), StoredTensor(header, bytes(500))], owner="o" * 600)
    assert (rec.tensor_count, rec.tensors_dropped) == (1, 1)
    assert rec.bytes == (tmp_path / f"{rec.id}.incident").stat().st_size <= 1500
    assert store.owner_of(rec.id) == "o" * 600
