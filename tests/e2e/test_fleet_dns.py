"""``Fleet("dns:///name:port")``: real replicas on 127.0.0.1 and 127.0.0.2, one port, behind one name.

A Kubernetes headless Service resolves to every ready pod's address, all
serving the same port. Here the injected resolver plays that DNS: the test
changes its answer to scale the fleet up and down. (``localhost`` resolves
to 127.0.0.1 only on these machines, so the system resolver cannot.)
"""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
from support.e2e import wait_for

import layertap

pytestmark = pytest.mark.e2e

NAME = "layertap-headless.ml.svc.cluster.local"


class Dns:
    """A resolver whose answer the test sets; counts the lookups."""

    def __init__(self, *ips: str) -> None:
        self.ips: list[str] | None = list(ips)
        self.lookups = 0

    def __call__(self, host: str, port: int) -> list[str]:
        assert host == NAME
        self.lookups += 1
        if self.ips is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return list(self.ips)


def replicas(make_server, hosts: list[str], **config):  # type: ignore[no-untyped-def]
    """Servers on each of ``hosts``, all on one port (the first one's free port); returns (port, servers)."""
    first = make_server(host=hosts[0], **config)
    return first.port, [first, *(make_server(host=h, port=first.port, **config) for h in hosts[1:])]


def test_a_name_stands_for_every_replica_and_follows_scaling(make_server) -> None:
    port, (one, two) = replicas(make_server, ["127.0.0.1", "127.0.0.2"])
    a, b = f"127.0.0.1:{port}", f"127.0.0.2:{port}"
    dns = Dns("127.0.0.2", "127.0.0.1")
    with layertap.Fleet(f"dns:///{NAME}:{port}", resolver=dns, resolve_every=3600, timeout=5) as fleet, \
            layertap.Client(b) as cb:
        assert fleet.targets == [a, b]  # by address
        cb.create_tap("fc", name="only-on-b", reducers="moments")  # tells the replicas apart
        stats = fleet.stats()
        assert stats.ok and {i.target: i.value.taps for i in stats} == {a: 0, b: 1}
        assert [i.target for i in fleet.layers()].count(a) == len(cb.layers())

        # Scale up: a third replica, found by the next resolution (forced by set_baseline, see below).
        (three,) = [make_server(host="127.0.0.3", port=port)]
        c = f"127.0.0.3:{port}"
        dns.ips = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
        assert fleet.targets == [a, b]  # not due yet

        # A fleet baseline installs on every replica found, the new one included.
        stop = threading.Event()

        def traffic(target: str) -> None:
            x = np.zeros((2, 3, 32, 32), np.float32)
            with layertap.Client(target) as client:
                while not stop.is_set():
                    client.infer(x)

        feeders = [threading.Thread(target=traffic, args=(t,), daemon=True) for t in (a, b, c)]
        for t in feeders:
            t.start()
        try:
            result = fleet.set_baseline("fc", passes=4, window=2, wait=60)
        finally:
            stop.set()
            for t in feeders:
                t.join(10)
        assert result.ok and [i.target for i in result] == [a, b, c] == fleet.targets
        (tap,) = {i.value.tap for i in result}
        for srv in (one, two, three):
            with layertap.Client(f"{srv.state.config.host}:{port}") as member:
                assert {d.state for d in member.drift() if d.tap == tap} == {"ready"}
        drift = fleet.drift()
        assert drift.ok and sorted({i.target for i in drift}) == [a, b, c]

        # Scale down: replica b goes away. The call that finds it unreachable reports it,
        # and makes the next one resolve again, which no longer lists it.
        two.state.taps.close()
        two.stop(0)
        dns.ips = ["127.0.0.1", "127.0.0.3"]
        failed = fleet.stats()
        assert [e.target for e in failed.errors] == [b] and isinstance(failed.errors[0].error, layertap.ServerUnavailable)
        after = fleet.stats()
        assert after.ok and [i.target for i in after] == [a, c] == fleet.targets


def test_periodic_resolution_and_a_name_that_does_not_resolve(make_server) -> None:
    port, _ = replicas(make_server, ["127.0.0.1", "127.0.0.2"])
    dns = Dns()
    dns.ips = None  # no record yet (a headless Service with no ready pod: NXDOMAIN)
    text = f"dns:///{NAME}:{port}"
    with layertap.Fleet(text, resolver=dns, resolve_every=0.2, timeout=5) as fleet:
        assert fleet.targets == []
        res = fleet.metadata()
        assert res.items == [] and [e.target for e in res.errors] == [text]
        assert isinstance(res.errors[0].error, layertap.ServerUnavailable) and NAME in str(res.errors[0].error)
        stream = fleet.watch("fc")
        assert list(stream) == [] and [e.target for e in stream.errors] == [text]

        dns.ips = ["127.0.0.1", "127.0.0.2"]
        assert wait_for(lambda: fleet.metadata().ok and len(fleet.targets) == 2, 5)  # the next due resolution
        # A DNS failure later keeps the replicas found before: a hiccup never empties a fleet.
        dns.ips = None
        lookups = dns.lookups
        assert wait_for(lambda: fleet.stats().ok and dns.lookups > lookups, 5)
        assert len(fleet.targets) == 2


def test_dns_targets_mix_with_static_ones_and_are_checked(make_server) -> None:
    port, _ = replicas(make_server, ["127.0.0.1", "127.0.0.2"])
    dns = Dns("127.0.0.1", "127.0.0.2")
    # A static member that the name also lists is one member, not two.
    with layertap.Fleet([f"127.0.0.1:{port}", f"dns:///{NAME}:{port}"], resolver=dns) as fleet:
        assert fleet.targets == [f"127.0.0.1:{port}", f"127.0.0.2:{port}"]
    for bad in (f"dns:///{NAME}", "dns://8.8.8.8/name:50051", "dns:///:50051"):
        with pytest.raises(layertap.InvalidArgument, match="dns:"):
            layertap.Fleet(bad, resolver=dns)
    with pytest.raises(layertap.InvalidArgument, match="each target once"):
        layertap.Fleet([f"dns:///{NAME}:{port}", f"dns:///{NAME}:{port}"], resolver=dns)


def test_tls_members_are_dialled_by_address_and_verified_against_the_name(make_server, tmp_path) -> None:
    """The certificate names the Service only, never a pod address, as cert-manager's would."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert(NAME, "layertap.ml.svc")
    ca_path, cert_path, key_path = tmp_path / "ca.pem", tmp_path / "tls.crt", tmp_path / "tls.key"
    ca.cert_pem.write_to_path(str(ca_path))
    cert_path.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    key_path.write_bytes(cert.private_key_pem.bytes())
    port, _ = replicas(make_server, ["127.0.0.1", "127.0.0.2"], tls_cert=str(cert_path), tls_key=str(key_path))

    with layertap.Fleet(f"dns:///{NAME}:{port}", tls=str(ca_path), resolver=Dns("127.0.0.1", "127.0.0.2"),
                        timeout=5) as fleet:
        meta = fleet.metadata()
        assert meta.ok and [i.target for i in meta] == [f"127.0.0.1:{port}", f"127.0.0.2:{port}"]
    # Without the name, the pod address fails verification: the override is what makes it work.
    with layertap.Client(f"127.0.0.2:{port}", tls=str(ca_path), timeout=3) as direct, \
            pytest.raises(layertap.ServerUnavailable):
        direct.metadata()
    with layertap.Client(f"127.0.0.2:{port}", tls=str(ca_path), tls_server_name=NAME, timeout=5) as named:
        assert named.metadata().model_name
