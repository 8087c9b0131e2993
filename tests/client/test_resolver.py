"""``dns:`` fleet targets: parsing, and the addresses they stand for."""

from __future__ import annotations

import socket

import pytest

import layertap
from layertap._resolver import DnsTarget, system_resolver

pytestmark = pytest.mark.unit


def test_parse_names_and_ports() -> None:
    t = DnsTarget.parse("dns:///layertap-headless.ml.svc.cluster.local:50051")
    assert t is not None and (t.host, t.port) == ("layertap-headless.ml.svc.cluster.local", 50051)
    assert DnsTarget.parse("dns:layertap:50051") == DnsTarget("dns:layertap:50051", "layertap", 50051)
    assert DnsTarget.parse("layertap:50051") is None  # a plain target


@pytest.mark.parametrize("bad", ["dns:///name", "dns:///:1", "dns:///name:0", "dns:///name:x", "dns://1.1.1.1/name:1"])
def test_parse_refuses_what_it_cannot_resolve(bad: str) -> None:
    with pytest.raises(layertap.InvalidArgument, match="dns:"):
        DnsTarget.parse(bad)


def test_addresses_are_grpc_targets_sorted_and_unique() -> None:
    t = DnsTarget("dns:///x:7", "x", 7)
    assert t.resolve(lambda host, port: ["10.0.0.2", "fd00::1", "10.0.0.2", "10.0.0.1"]) == [
        "10.0.0.1:7", "10.0.0.2:7", "[fd00::1]:7"]
    with pytest.raises(layertap.InvalidArgument, match="not an IP address"):
        t.resolve(lambda host, port: ["pod-0"])


def test_the_system_resolver_answers_for_loopback_and_raises_for_unknown_names() -> None:
    assert "127.0.0.1" in system_resolver("localhost", 1)
    with pytest.raises(OSError):
        system_resolver("no-such-host.invalid", 1)
    assert issubclass(socket.gaierror, OSError)
