"""``Fleet.spread_baseline``: a replica added after the fleet baseline gets that reference, unchanged."""

from __future__ import annotations

import json
import threading

import grpc
import numpy as np
import pytest
from test_fleet_dns import NAME, Dns, replicas

import layertap
from layertap import _convert
from layertap._fleet_baseline import baseline_tap_id
from layertap.server.drift.names import baseline_tap_id as server_tap_id
from layertap.v1 import telemetry_pb2 as pb
from layertap.v1 import telemetry_pb2_grpc

pytestmark = pytest.mark.e2e


def test_the_client_names_baseline_taps_as_the_server_does() -> None:
    for selector in ("fc", "layer*", "re:^layer[12]$", "model.layers.*.mlp"):
        for point in ("output", "input", "grad_output"):
            for name in ("", "my-baseline"):
                for derive in ("", "entropy", "top1_prob"):
                    req = _convert.set_baseline_request(selector, passes=1, window=1, point=point, thresholds=None,
                                                        name=name, derive=derive)
                    assert baseline_tap_id(req) == server_tap_id(req), (selector, point, name, derive)


def _frozen(address: str, tap: str) -> list[dict]:
    with grpc.insecure_channel(address) as ch:
        resp = telemetry_pb2_grpc.TelemetryServiceStub(ch).ExportBaseline(pb.ExportBaselineRequest(tap=tap), timeout=10)
    return [json.loads(layer.frozen) for layer in resp.layers]


def test_a_replica_added_later_gets_the_fleet_baseline_unchanged(make_server) -> None:
    port, _ = replicas(make_server, ["127.0.0.1", "127.0.0.2"])
    a, c = f"127.0.0.1:{port}", f"127.0.0.3:{port}"
    dns = Dns("127.0.0.1", "127.0.0.2")
    with layertap.Fleet(f"dns:///{NAME}:{port}", resolver=dns, timeout=10) as fleet:
        with pytest.raises(layertap.NotFound, match="set_baseline first"):
            fleet.spread_baseline("fc", window=2)
        stop = threading.Event()

        def traffic(target: str) -> None:
            rng = np.random.default_rng(abs(hash(target)) % 1000)
            with layertap.Client(target) as client:
                while not stop.is_set():
                    client.infer(rng.standard_normal((2, 3, 32, 32)).astype(np.float32))

        feeders = [threading.Thread(target=traffic, args=(t,), daemon=True) for t in fleet.targets]
        for t in feeders:
            t.start()
        try:
            installed = fleet.set_baseline("fc", passes=4, window=2, wait=60)
        finally:
            stop.set()
            for t in feeders:
                t.join(10)
        assert installed.ok and len(installed) == 2
        (tap,) = {i.value.tap for i in installed}
        reference = _frozen(a, tap)

        make_server(host="127.0.0.3", port=port)  # scaled up: it has no baseline
        dns.ips = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
        spread = fleet.spread_baseline("fc", window=2)
        assert spread.ok and [(i.target, i.value.tap, i.value.layers) for i in spread] == [(c, tap, ["fc"])]
        copied = _frozen(c, tap)
        for key in ("edges", "counts", "count", "mean", "m2", "passes", "created_at"):
            assert [d[key] for d in copied] == [d[key] for d in reference], key  # the same reference, not a new one
        with layertap.Client(c) as new:
            assert {(d.tap, d.state) for d in new.drift()} == {(tap, "ready")}
        assert fleet.spread_baseline("fc", window=2).items == []  # every member has it now
