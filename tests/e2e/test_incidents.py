"""Flight recorder end to end: triggers on durable taps, retained inputs, replayed incidents."""

from __future__ import annotations

import json
import threading

import grpc
import numpy as np
import pytest
from support.e2e import batch, wait_for

from layertap import Client, Incidents
from layertap.v1 import inference_pb2, inference_pb2_grpc, telemetry_pb2, telemetry_pb2_grpc

pytestmark = pytest.mark.e2e

LAYERS = ["layer1", "layer2"]


def _tap_file(tmp_path, **triggers):
    path = tmp_path / "taps.json"
    path.write_text(json.dumps({"taps": [{
        "name": "guard", "selector": "layer[12]", "reducers": ["moments", "minmax", "abs_max", "zero_fraction", "nonfinite"],
        "triggers": {"nonfinite": True, **triggers},
    }]}))
    return str(path)


def _server(make_server, tmp_path, **overrides):
    overrides.setdefault("tap_config", _tap_file(tmp_path))
    return make_server(incident_dir=str(tmp_path / "incidents"), record_inputs=16, **overrides)


def _infer(srv, x: np.ndarray) -> int:
    """One raw Infer; returns its pass index."""
    from layertap._codec import encode_tensor

    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
        resp = inference_pb2_grpc.InferenceServiceStub(ch).Infer(inference_pb2.InferRequest(inputs=[encode_tensor(x)]))
    return resp.pass_index


def _settle(srv) -> None:
    assert srv.state.taps.flush(10)
    assert srv.state.recorder is not None and srv.state.recorder.wait_idle(30)


def test_one_nan_among_many_gives_one_replayed_incident(make_server, tmp_path):
    srv = _server(make_server, tmp_path, metrics_port=0)
    bad = batch(4, seed=7)
    bad[2, 1, 5, 9] = np.nan
    passes = [_infer(srv, bad if i == 6 else batch(4, seed=i)) for i in range(12)]
    bad_pass = passes[6]
    _settle(srv)
    with Client(srv.port) as c:
        infos = Incidents(c).list()
        assert len(infos) == 1
        info = infos[0]
        assert (info.tap, info.triggers, info.pass_index) == ("guard", ("nonfinite",), bad_pass)
        assert set(info.layers) == set(LAYERS) and info.rows == (2,)
        assert info.replayed and info.replay_matches, info.replay_note
        inc = Incidents(c).get(info.id)
    assert len(inc.inputs) == 1
    np.testing.assert_array_equal(inc.inputs[0], bad)  # NaN compares equal here
    for layer in LAYERS:
        t = inc.layers[layer]
        nan_rows = np.flatnonzero(np.isnan(t.reshape(t.shape[0], -1)).any(axis=1))
        assert nan_rows.tolist() == [2]
    # The recorded summary is the live pass's; its counts equal the replayed tensor's.
    rec, _ = srv.state.recorder.store.read(info.id)
    for s in rec.summaries:
        nf = next(r.nonfinite for r in s.results if r.WhichOneof("value") == "nonfinite")
        t = inc.layers[s.layer]
        assert nf.nan_count == int(np.isnan(t).sum()) > 0
        mm = next(r.minmax for r in s.results if r.WhichOneof("value") == "minmax")
        assert np.isnan(mm.max) or mm.max == float(np.nanmax(t))
    total = sum(v for k, v in _samples(srv.metrics_port).items()
                if k[0] == "layertap_incidents_total" and ("tap", "guard") in k[1] and ("trigger", "nonfinite") in k[1])
    assert total == 1


def _samples(port):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples}


def test_rate_limit_holds_and_subscribers_hear_of_incidents(make_server, tmp_path):
    srv = _server(make_server, tmp_path)
    bad = batch(2, seed=3)
    bad[0, 0, 0, 0] = np.inf
    events: list[telemetry_pb2.TapEvent] = []
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
        stream = telemetry_pb2_grpc.TelemetryServiceStub(ch).Subscribe(telemetry_pb2.SubscribeRequest(tap_ids=["guard"]))
        next(stream)  # subscribed before the passes run

        def read() -> None:
            try:
                for msg in stream:
                    events.extend(e for e in msg.events if e.kind == "incident")
            except grpc.RpcError as exc:  # the cancel below ends it
                assert exc.code() == grpc.StatusCode.CANCELLED

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        for _ in range(3):
            _infer(srv, bad)
        _settle(srv)
        with Client(srv.port) as c:
            (info,) = Incidents(c).list()
        assert srv.state.recorder.rate_limited == 2
        assert wait_for(lambda: len(events) == 1, 10)
        stream.cancel()
    assert (events[0].tap, events[0].message) == ("guard", info.id)


def test_restart_reloads_the_index_and_skips_a_corrupt_file(make_server, tmp_path, capsys):
    srv = _server(make_server, tmp_path)
    bad = batch(2, seed=5)
    bad[1, 2, 3, 4] = np.nan
    _infer(srv, bad)
    _settle(srv)
    first = [r.id for r in srv.state.recorder.store.entries()]
    assert len(first) == 1
    srv.state.taps.close()
    srv.stop(0)
    (tmp_path / "incidents" / "inc-0000000000001-deadbeef.incident").write_bytes(b"LTINC001garbage")
    again = _server(make_server, tmp_path)
    with grpc.insecure_channel(f"127.0.0.1:{again.port}") as ch:
        resp = telemetry_pb2_grpc.TelemetryServiceStub(ch).ListIncidents(telemetry_pb2.ListIncidentsRequest())
    assert [i.id for i in resp.incidents] == first
    assert resp.skipped_files == 1
    from layertap.cli import main

    assert main(["incidents", f"127.0.0.1:{again.port}"]) == 0
    assert first[0] in capsys.readouterr().out
    out = tmp_path / "incident.npz"
    assert main(["incidents", f"127.0.0.1:{again.port}", "get", first[0], "-o", str(out)]) == 0
    with np.load(out) as saved:
        np.testing.assert_array_equal(saved["input_0"], bad)
        assert json.loads(str(saved["incident"]))["rows"] == [1]
        assert np.isnan(saved["layer/layer1"][1]).any() and not np.isnan(saved["layer/layer1"][0]).any()
    with Client(again.port) as c:
        inc = Incidents(c).get(first[0])
        np.testing.assert_array_equal(inc.inputs[0], bad)
        Incidents(c).delete(first[0])
        assert Incidents(c).list() == []


TOKENS = {who: f"tok-{who}-0123456789abcdef" for who in ("alice", "bob", "root")}


def _secured(make_server, tmp_path):
    """A recording server with tokens: alice and bob may capture, root is admin too."""
    import hashlib

    scopes = {"alice": "infer,read,tap,capture", "bob": "infer,read,tap,capture", "root": "infer,read,tap,capture,admin"}
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{who} sha256:{hashlib.sha256(TOKENS[who].encode()).hexdigest()} {scopes[who]}\n"
                              for who in TOKENS))
    return _server(make_server, tmp_path, auth_tokens=str(tokens))


def _as(srv, who: str) -> Client:
    return Client(f"127.0.0.1:{srv.port}", token=TOKENS[who])


def test_incidents_belong_to_their_tap_s_owner_across_a_restart(make_server, tmp_path):
    """One NaN fires three taps: alice's, bob's and the server's ``guard`` (--taps). Each principal
    lists only its own incidents and is refused another's; admin sees and reads all. The owner is
    in the file, so a restarted server (the taps gone) still knows it."""
    from layertap import PermissionDenied, Triggers

    srv = _secured(make_server, tmp_path)
    with _as(srv, "alice") as alice, _as(srv, "bob") as bob:
        alice.create_tap("layer1", reducers=["nonfinite"], triggers=Triggers(nonfinite=True), name="alices")
        bob.create_tap("layer2", reducers=["nonfinite"], triggers=Triggers(nonfinite=True), name="bobs")
        bad = batch(2, seed=9)
        bad[0, 0, 0, 0] = np.nan
        alice.infer(bad)
        _settle(srv)
    for server in (srv, None):
        if server is None:  # again, from the files alone
            srv.state.taps.close()
            srv.stop(0)
            srv = _secured(make_server, tmp_path)
        with _as(srv, "alice") as alice, _as(srv, "bob") as bob, _as(srv, "root") as root:
            everything = {i.tap: i.id for i in Incidents(root).list()}
            assert set(everything) == {"alices", "bobs", "guard"}
            assert [i.tap for i in Incidents(alice).list()] == ["alices"]
            assert [i.tap for i in Incidents(bob).list()] == ["bobs"]
            assert Incidents(bob).list(tap="alices") == []
            assert Incidents(alice).get(everything["alices"]).layers["layer1"].shape[0] == 2
            for who, tap in ((bob, "alices"), (alice, "bobs"), (alice, "guard")):
                with pytest.raises(PermissionDenied) as err:
                    Incidents(who).get(everything[tap])
                assert err.value.metadata["scope"] == "admin"
                with pytest.raises(PermissionDenied):
                    Incidents(who).delete(everything[tap])
            assert {i.tap for i in Incidents(root).list()} == set(everything)  # nothing was deleted
            assert Incidents(root).get(everything["bobs"]).inputs[0].shape == (2, 3, 32, 32)
    with _as(srv, "bob") as bob, _as(srv, "root") as root:
        Incidents(bob).delete(everything["bobs"])
        Incidents(root).delete(everything["alices"])
        assert [i.tap for i in Incidents(root).list()] == ["guard"]


def test_trigger_specs_are_checked(make_server, tmp_path):
    plain = make_server()
    recording = _server(make_server, tmp_path)
    spec = telemetry_pb2.TapSpec(selector="layer1", reducers=[telemetry_pb2.ReducerSpec(kind=telemetry_pb2.REDUCER_KIND_MOMENTS)],
                                 triggers=telemetry_pb2.Triggers(nonfinite=True))
    complete = telemetry_pb2.TapSpec()
    complete.CopyFrom(spec)
    complete.reducers.append(telemetry_pb2.ReducerSpec(kind=telemetry_pb2.REDUCER_KIND_NONFINITE))
    cases = [
        (plain, complete, grpc.StatusCode.FAILED_PRECONDITION, "spec.triggers"),
        (recording, spec, grpc.StatusCode.INVALID_ARGUMENT, "spec.triggers.nonfinite"),
    ]
    bad_value = telemetry_pb2.TapSpec()
    bad_value.CopyFrom(spec)
    bad_value.triggers.abs_max_above = float("nan")
    cases.append((recording, bad_value, grpc.StatusCode.INVALID_ARGUMENT, "spec.triggers.abs_max_above"))
    for srv, s, code, field in cases:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            with pytest.raises(grpc.RpcError) as err:
                telemetry_pb2_grpc.TelemetryServiceStub(ch).CreateTap(telemetry_pb2.CreateTapRequest(spec=s))
        assert err.value.code() == code and err.value.details().startswith(field), err.value.details()
    # Stream taps cannot carry triggers.
    with grpc.insecure_channel(f"127.0.0.1:{recording.port}") as ch:
        stub = telemetry_pb2_grpc.TelemetryServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            next(iter(stub.Subscribe(telemetry_pb2.SubscribeRequest(stream_taps=[complete]))))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("stream_taps[0].triggers")
        for bad_id in ("", "../etc/passwd", "inc-1"):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.GetIncident(telemetry_pb2.GetIncidentRequest(id=bad_id)))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("id")
        with pytest.raises(grpc.RpcError) as err:
            stub.DeleteIncident(telemetry_pb2.DeleteIncidentRequest(id="inc-0000000000001-00000000"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_abs_max_trigger_without_input_retention(make_server, tmp_path):
    """--incident-dir alone records what fired, without the input or a replay."""
    srv = make_server(incident_dir=str(tmp_path / "inc"), tap_config=_tap_file(tmp_path, abs_max_above=50.0))
    big = batch(3, seed=2)
    big[1] *= 1e4
    _infer(srv, batch(3, seed=1))
    _infer(srv, big)
    _settle(srv)
    (rec,) = srv.state.recorder.store.entries()
    assert rec.triggers == ["abs_max"] and not rec.replayed and rec.tensor_count == 0
    assert "--record-inputs is off" in rec.replay_note


def test_the_client_sets_triggers_and_reads_them_back(make_server, tmp_path):
    """``create_tap(..., triggers=Triggers(...))``: the thin client's way to arm the recorder."""
    from layertap import Triggers

    srv = make_server(incident_dir=str(tmp_path / "incidents"), record_inputs=16)
    want = Triggers(nonfinite=True, abs_max_above=1e6, min_interval=5.0)
    with Client(srv.port) as c:
        info = c.create_tap("layer3", reducers=["abs_max", "nonfinite"], triggers=want, forever=True)
        assert info.spec.triggers == want
        assert [t.spec.triggers for t in c.taps() if t.id == info.id] == [want]
        bad = batch(2, seed=5)
        bad[1, 0, 3, 3] = np.nan
        c.infer(bad)
        _settle(srv)
        (incident,) = Incidents(c).list()
    assert incident.tap == info.id and incident.triggers == ("nonfinite",) and incident.rows == (1,)


def test_a_model_that_writes_its_input_in_place_is_recorded_as_sent(make_server, tmp_path):
    """Retention holds a copy taken before the forward, and the replay gets its own copy."""
    import torch
    from torch import nn

    from layertap.server.host.sources import InputSpec, LoadedModel

    class Doubles(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.mul_(2.0)  # in-place preprocessing
            return self.fc(x)

    taps = tmp_path / "fc_taps.json"
    taps.write_text(json.dumps({"taps": [{"name": "guard", "selector": "fc", "reducers": ["minmax", "nonfinite"],
                                          "triggers": {"nonfinite": True}}]}))
    torch.manual_seed(0)
    srv = _server(make_server, tmp_path, tap_config=str(taps),
                  loaded=LoadedModel(Doubles().eval(), "doubles", "factory", [InputSpec("x", torch.float32, (-1, 8))]))
    x = np.arange(16, dtype=np.float32).reshape(2, 8)
    x[1, 3] = np.nan
    _infer(srv, x)
    _settle(srv)
    with Client(srv.port) as c:
        (info,) = Incidents(c).list()
        assert info.replayed and info.replay_matches, info.replay_note
        inc = Incidents(c).get(info.id)
    np.testing.assert_array_equal(inc.inputs[0], x)
    model = srv.state.host.module
    want = (2.0 * x.astype(np.float64)) @ model.fc.weight.detach().double().numpy().T + model.fc.bias.detach().double().numpy()
    np.testing.assert_allclose(inc.layers["fc"][0], want[0], rtol=1e-5)


def test_one_pass_firing_many_taps_replays_once(make_server, tmp_path):
    """A pass yields one incident per tap, from a single replay over the union of their layers."""
    from layertap import Triggers

    srv = make_server(incident_dir=str(tmp_path / "incidents"), record_inputs=16)
    selectors = {"all": "layer*", "first": "layer1", "pair": "layer[12]", "last": "layer3"}
    with Client(srv.port) as c:
        for name, selector in selectors.items():
            for k in range(3):  # 12 trigger taps, more than the replay queue holds
                c.create_tap(selector, name=f"{name}{k}", reducers=["minmax", "nonfinite"],
                             triggers=Triggers(nonfinite=True), forever=True)
        bad = batch(3, seed=9)
        bad[1, 0, 2, 2] = np.nan
        before = srv.state.host.passes
        _infer(srv, bad)
        _settle(srv)
        infos = Incidents(c).list()
        assert srv.state.host.passes - before == 2  # the live pass and one replay
        assert srv.state.recorder.dropped == 0
        assert sorted(i.tap for i in infos) == sorted(f"{n}{k}" for n in selectors for k in range(3))
        layers_of = {t.id: set(t.layers) for t in c.taps()}
        for info in infos:
            assert info.replayed and info.replay_matches, info.replay_note
            assert info.rows == (1,)
            inc = Incidents(c).get(info.id)
            np.testing.assert_array_equal(inc.inputs[0], bad)
            assert set(inc.layers) == layers_of[info.tap]
            for t in inc.layers.values():
                nan_rows = np.flatnonzero(np.isnan(t.reshape(t.shape[0], -1)).any(axis=1))
                assert nan_rows.tolist() == [1]


def test_the_per_incident_cap_bounds_what_the_replay_holds(make_server, tmp_path):
    """Tensors past the cap are checked and dropped as they pass, never all held at once."""
    import torch

    from layertap.server.record.replay import Share, replay

    srv = make_server()
    host = srv.state.host
    with Client(srv.port) as c:
        info = c.create_tap("layer*", reducers=["minmax", "nonfinite"], forever=True)
    tap = srv.state.taps.get(info.id)
    x = torch.from_numpy(batch(2, seed=4))
    everything = Share(tap, [], 1 << 40, lambda _l, _t: [])
    full = replay(host, [everything], [x])
    sizes = [full[k].nbytes for k in everything.kept]
    assert len(sizes) >= 3 and everything.dropped == 0
    budget = sizes[0] + sizes[1] // 2
    small = Share(tap, [], budget, lambda _l, _t: [])
    held = replay(host, [small], [x])
    assert sum(t.nbytes for t in held.values()) <= budget
    room, want = budget, []
    for key in everything.kept:  # each tensor is kept while it still fits
        if full[key].nbytes <= room:
            room -= full[key].nbytes
            want.append(key)
    assert list(held) == small.kept == want and small.dropped == len(sizes) - len(want) > 0
    for key, t in held.items():
        torch.testing.assert_close(t, full[key], rtol=0, atol=0)


def test_file_cap_above_ring_cap_is_refused_at_start(make_server, tmp_path):
    with pytest.raises(ValueError) as err:
        make_server(incident_dir=str(tmp_path / "inc"), incident_max_bytes=1 << 20, incident_max_file_bytes=2 << 20)
    assert "--incident-max-file-bytes" in str(err.value) and "--incident-max-bytes" in str(err.value)
