"""Fleet-wide baselines: two real replicas fed different data share one merged reference.

Each replica taps ``layer1``'s input, which is exactly the batch sent, so the
float64 numpy reference is computed from the union of what both were fed:
the builders' reservoirs hold every pass's 99 percentiles (2 x 12 x 99 values,
under the reservoir's 20,000), so edges, counts and moments are exact.
"""

from __future__ import annotations

import json
import socket
import threading

import grpc
import numpy as np
import pytest
from support.e2e import wait_for
from support.models import perturbable_loaded

import layertap
from layertap.server.drift.layer import COLLECT_PROBABILITIES
from layertap.server.drift.scores import PSI_EPS
from layertap.v1 import telemetry_pb2 as pb
from layertap.v1 import telemetry_pb2_grpc

pytestmark = pytest.mark.slow

PASSES, WINDOW, BATCH = 12, 6, 256


def _feed(srv, client: layertap.Client, xs: list[np.ndarray]) -> None:  # type: ignore[no-untyped-def]
    for x in xs:
        client.infer(x)
    assert srv.state.taps.flush(10), "tap pipeline did not drain"


def _batches(rng: np.random.Generator, n: int, loc: float, scale: float) -> list[np.ndarray]:
    return [(rng.standard_normal((BATCH, 16)) * scale + loc).astype(np.float32) for _ in range(n)]


def _frozen(port: int, tap: str) -> dict:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        resp = telemetry_pb2_grpc.TelemetryServiceStub(ch).ExportBaseline(pb.ExportBaselineRequest(tap=tap), timeout=10)
    (layer,) = resp.layers
    assert layer.state == pb.BASELINE_STATE_READY and layer.WhichOneof("value") == "frozen"
    return json.loads(layer.frozen)


def _bin(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    return np.bincount(np.searchsorted(edges, values, side="right"), minlength=edges.size + 1)


def test_two_replicas_share_one_merged_reference_and_score_drift_against_it(make_server) -> None:
    a, b = make_server(perturbable_loaded()), make_server(perturbable_loaded())
    rng = np.random.default_rng(7)
    xa = _batches(rng, PASSES, 0.0, 1.0)
    xb = _batches(rng, PASSES, 1.5, 0.5)
    ignored = _batches(rng, 3, 40.0, 1.0)  # after PASSES: a held builder must not take them
    out: dict[str, object] = {}
    with layertap.Fleet([a.port, b.port]) as fleet, \
            layertap.Client(f"127.0.0.1:{a.port}") as ca, layertap.Client(f"127.0.0.1:{b.port}") as cb:
        def run() -> None:
            try:
                out["result"] = fleet.set_baseline("layer1", passes=PASSES, window=WINDOW, point="input", wait=60)
            except Exception as exc:  # noqa: BLE001 - re-raised below
                out["error"] = exc

        t = threading.Thread(target=run)
        t.start()
        assert wait_for(lambda: bool(ca.taps()) and bool(cb.taps()), 10)
        _feed(a, ca, xa + ignored)
        _feed(b, cb, xb)
        t.join(30)
        assert not t.is_alive() and "error" not in out, out
        result = out["result"]
        assert isinstance(result, layertap.FleetResult) and result.ok
        assert [i.target for i in result] == fleet.targets
        (tap,) = {i.value.tap for i in result}
        assert all(i.value.layers == ["layer1"] for i in result)

        docs = [_frozen(a.port, tap), _frozen(b.port, tap)]
        for key in ("edges", "counts", "count", "mean", "m2", "min", "max", "passes", "channel_mean", "created_at"):
            assert docs[0][key] == docs[1][key], key  # one reference, frozen once
        doc = docs[0]

        # The float64 reference from the union of both replicas' observations.
        union = np.concatenate([x.astype(np.float64).ravel() for x in xa + xb])
        pool = np.concatenate([np.quantile(x.astype(np.float64).ravel(), COLLECT_PROBABILITIES) for x in xa + xb])
        edges = np.unique(np.quantile(pool, np.linspace(0.05, 0.95, 19)))
        np.testing.assert_allclose(doc["edges"], edges, rtol=1e-12, atol=0)
        np.testing.assert_array_equal(doc["counts"], _bin(pool, edges))
        assert doc["count"] == union.size and doc["passes"] == 2 * PASSES
        np.testing.assert_allclose(doc["mean"], union.mean(), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(doc["m2"], ((union - union.mean()) ** 2).sum(), rtol=1e-5)
        assert (doc["min"], doc["max"]) == (union.min(), union.max())
        np.testing.assert_allclose(doc["channel_mean"], union.reshape(-1, 16).mean(axis=0), rtol=1e-5, atol=1e-6)
        # Replica a's own reference would have put its edges elsewhere.
        own = np.unique(np.quantile(np.concatenate([np.quantile(x.astype(np.float64).ravel(), COLLECT_PROBABILITIES)
                                                    for x in xa]), np.linspace(0.05, 0.95, 19)))
        assert not np.allclose(own, edges)

        # Each replica is scored against the one reference, on its own window.
        now = {"a": _batches(rng, WINDOW, 0.0, 1.0), "b": _batches(rng, WINDOW, 1.5, 0.5)}
        _feed(a, ca, now["a"])
        _feed(b, cb, now["b"])
        base_counts = np.asarray(doc["counts"], dtype=np.float64)
        base_std = np.sqrt(doc["m2"] / doc["count"])
        scores = {}
        for name, client in (("a", ca), ("b", cb)):
            (d,) = client.drift()
            assert d.state == "ready" and d.window_passes == WINDOW and d.baseline_passes == 2 * PASSES
            cur = np.concatenate([x.astype(np.float64).ravel() for x in now[name]])
            e = base_counts / base_counts.sum() + PSI_EPS
            q = _bin(cur, edges) / cur.size + PSI_EPS
            np.testing.assert_allclose(d.psi, np.sum((q - e) * np.log(q / e)), rtol=1e-6)
            np.testing.assert_allclose(d.mean_shift, abs(cur.mean() - doc["mean"]) / base_std, rtol=1e-5)
            scores[name] = d.mean_shift
        # The reference sits between the two: each replica drifts from it its own way.
        assert scores["a"] > 0.3 and scores["b"] > 0.3


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_member_that_is_down_is_reported_and_the_others_install(make_server) -> None:
    a = make_server(perturbable_loaded())
    dead = _dead_port()
    with layertap.Fleet([a.port, dead], timeout=2) as fleet, layertap.Client(f"127.0.0.1:{a.port}") as ca:
        done = threading.Event()
        out = {}

        def run() -> None:
            out["r"] = fleet.set_baseline("layer2", passes=3, window=2, wait=30)
            done.set()

        t = threading.Thread(target=run)
        t.start()
        assert wait_for(lambda: bool(ca.taps()), 10)
        rng = np.random.default_rng(1)
        _feed(a, ca, _batches(rng, 3, 0.0, 1.0))
        t.join(30)
        r = out["r"]
        assert [i.target for i in r] == [f"127.0.0.1:{a.port}"]
        assert [e.target for e in r.errors] == [f"127.0.0.1:{dead}"]
        assert isinstance(r.errors[0].error, layertap.ServerUnavailable)
        (d,) = ca.drift()
        assert d.state == "ready" and d.baseline_passes == 3


def test_a_member_still_collecting_past_wait_is_a_deadline(make_server) -> None:
    a = make_server(perturbable_loaded())
    with layertap.Fleet([a.port]) as fleet, pytest.raises(layertap.DeadlineExceeded, match="still collecting"):
        fleet.set_baseline("layer2", passes=3, wait=0.3)


@pytest.fixture
def held(make_server):  # type: ignore[no-untyped-def]
    """A replica holding a 2-pass builder on layer1 and layer2, and its raw stub."""
    srv = make_server(perturbable_loaded())
    ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    stub = telemetry_pb2_grpc.TelemetryServiceStub(ch)
    tap = stub.SetBaseline(pb.SetBaselineRequest(selector="re:layer[12]", passes=2, hold=True), timeout=10).tap
    yield srv, stub, tap
    ch.close()


def _refused(call, request) -> tuple[grpc.StatusCode, str]:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=10)
    return err.value.code(), err.value.details()


def test_bad_requests_get_a_status_naming_the_field(held) -> None:  # type: ignore[no-untyped-def]
    srv, stub, tap = held
    install, export = stub.InstallBaseline, stub.ExportBaseline
    invalid, missing = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
    good = pb.BaselineBuilderState(layer="layer1", point=pb.POINT_OUTPUT, passes=1, count=2, mean=0.5, m2=0.5,
                                   min=0.0, max=1.0, values=[0.0, 1.0], keys=[-0.1, -0.2])
    cases = [
        (export, pb.ExportBaselineRequest(), invalid, "tap"),
        (export, pb.ExportBaselineRequest(tap="nope"), missing, "tap"),
        (install, pb.InstallBaselineRequest(tap="nope", builders=[good]), missing, "tap"),
        (install, pb.InstallBaselineRequest(tap=tap), invalid, "builders"),
        (install, pb.InstallBaselineRequest(tap=tap, builders=[good], frozen=[b"{}"]), invalid, "builders"),
        (install, pb.InstallBaselineRequest(tap=tap, builders=[pb.BaselineBuilderState(layer="layer1", values=[1.0])]),
         invalid, "builders[0].keys"),
        (install, pb.InstallBaselineRequest(tap=tap, builders=[good, pb.BaselineBuilderState(
            layer="layer1", values=[float("nan")], keys=[-1.0], count=1)]), invalid, "builders[1].values[0]"),
        (install, pb.InstallBaselineRequest(tap=tap, builders=[pb.BaselineBuilderState(
            layer="layer1", values=[1.0], keys=[0.5], count=1)]), invalid, "builders[0].keys"),
        (install, pb.InstallBaselineRequest(tap=tap, builders=[pb.BaselineBuilderState(layer="layer3")]),
         invalid, "builders[0].layer"),
        (install, pb.InstallBaselineRequest(tap=tap, builders=[pb.BaselineBuilderState(layer="layer1", point=pb.POINT_INPUT)]),
         invalid, "builders[0].point"),
        (install, pb.InstallBaselineRequest(tap=tap, builders=[pb.BaselineBuilderState(layer="layer1", m2=-1.0)]),
         invalid, "builders[0].m2"),
        (install, pb.InstallBaselineRequest(tap=tap, builders=[pb.BaselineBuilderState(layer="layer1")]),
         grpc.StatusCode.FAILED_PRECONDITION, "builders"),
        (install, pb.InstallBaselineRequest(tap=tap, frozen=[b"\xff not json"]), invalid, "frozen[0]"),
        (install, pb.InstallBaselineRequest(tap=tap, frozen=[b'{"schema": "layertap.baseline"}']), invalid, "frozen[0]"),
    ]
    for call, request, code, field in cases:
        got, details = _refused(call, request)
        assert (got, details.split(":", 1)[0]) == (code, field), (request, got, details)
    # Nothing was installed by any refusal: both layers still collect.
    states = {layer.layer: layer.state for layer in export(pb.ExportBaselineRequest(tap=tap), timeout=10).layers}
    assert states == {"layer1": pb.BASELINE_STATE_COLLECTING, "layer2": pb.BASELINE_STATE_COLLECTING}


def test_frozen_document_for_another_layer_or_twice_is_refused(held) -> None:  # type: ignore[no-untyped-def]
    srv, stub, tap = held
    rng = np.random.default_rng(3)
    with layertap.Client(f"127.0.0.1:{srv.port}") as c:
        _feed(srv, c, _batches(rng, 2, 0.0, 1.0))
    exported = stub.ExportBaseline(pb.ExportBaselineRequest(tap=tap), timeout=10)
    builders = [layer.builder for layer in exported.layers]
    assert [b.passes for b in builders] == [2, 2]
    installed = stub.InstallBaseline(pb.InstallBaselineRequest(tap=tap, builders=builders), timeout=10)
    assert sorted(installed.layers) == ["layer1", "layer2"]
    doc = json.loads(installed.frozen[0])
    doc["layer"] = "layer3"
    for frozen, field in (([json.dumps(doc).encode()], "frozen[0].layer"), ([installed.frozen[0]] * 2, "frozen[1]")):
        code, details = _refused(stub.InstallBaseline, pb.InstallBaselineRequest(tap=tap, frozen=frozen))
        assert (code, details.split(":", 1)[0]) == (grpc.StatusCode.INVALID_ARGUMENT, field), details
    # Reinstalling the same documents is allowed and changes nothing.
    again = stub.InstallBaseline(pb.InstallBaselineRequest(tap=tap, frozen=installed.frozen), timeout=10)
    assert [json.loads(f)["edges"] for f in again.frozen] == [json.loads(f)["edges"] for f in installed.frozen]
