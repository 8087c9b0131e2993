"""Hostile inputs: every RPC, ~1,000 generated requests, one real server that must stay well.

Requests mix random messages, extreme values and valid calls (see
``support/hostile.py``); ``support/hostile_check.py`` judges each answer:
a documented code only, prompt, bounded, no traceback in the log, nothing left
behind. Derandomized, so CI runs the same cases every time;
``benchmarks/fuzz.py`` runs the same strategies for longer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, Phase, given, settings
from support.e2e import scrape
from support.hostile import HEALTH, TELEMETRY, Case
from support.hostile_check import LogWatch, Target, server_config
from support.rpc_table import DEFAULT_SHARE, EXAMPLES, RPCS, SHARES, methods

from layertap.server.app import start_server
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def logs() -> Iterator[LogWatch]:
    watch = LogWatch().install()
    yield watch
    watch.uninstall()


@pytest.fixture(scope="module")
def server(logs, tmp_path_factory):  # type: ignore[no-untyped-def]
    srv = start_server(server_config(baseline_dir=str(tmp_path_factory.mktemp("baselines"))))
    yield srv
    srv.state.taps.close()
    srv.stop(0)


@pytest.fixture(scope="module")
def target(server, logs) -> Iterator[Target]:  # type: ignore[no-untyped-def]
    t = Target(f"127.0.0.1:{server.port}", logs, server)
    assert t.settle() == [], "the server holds something before the first case"
    logs.take()  # start-up lines are not the suite's
    yield t
    t.close()


def test_every_rpc_of_every_service_has_cases() -> None:
    """Derived from the descriptors: an RPC without a row of examples still gets its hostile cases."""
    from layertap.v1 import inference_pb2, telemetry_pb2

    names = {f"{s.name}.{m.name}" for f in (inference_pb2, telemetry_pb2, health_pb2)
             for s in f.DESCRIPTOR.services_by_name.values() for m in s.methods}
    assert set(RPCS) == names == set(SHARES) == set(methods())
    assert set(EXAMPLES) <= names, "a row of examples names no RPC"
    assert all(share >= DEFAULT_SHARE for share in SHARES.values())
    assert sum(SHARES.values()) >= 1000  # 1,000 over the RPCs of 2026-12; a new RPC adds its share
    streaming = {name for name, m in methods().items() if m.server_streaming}
    assert {name for name, rpc in RPCS.items() if rpc.streaming} == streaming


def test_valid_explain_cases_never_upsample_a_map_without_spatial_dims() -> None:
    """The server answers that INVALID_ARGUMENT (upsample), so a "valid" case must not ask it;
    the suite's 30 Explain cases drew none, the fuzzer's 10,000 drew five."""
    seen: set[tuple[str, bool]] = set()

    @settings(max_examples=300, deadline=None, database=None, phases=[Phase.generate], derandomize=True,
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(RPCS["TelemetryService.Explain"].cases)
    def case(c: Case) -> None:
        if c.valid:
            seen.add((c.request.layer, c.request.upsample))

    case()
    assert ("fc", True) not in seen
    assert ("fc", False) in seen and any(up for _layer, up in seen)  # both still drawn


@pytest.mark.parametrize("rpc", sorted(SHARES))
def test_hostile_requests_get_documented_prompt_answers(target: Target, rpc: str) -> None:
    @settings(max_examples=SHARES[rpc], deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(RPCS[rpc].cases)
    def case(c: Case) -> None:
        outcome = target.run(c)
        assert not outcome.problems, "\n".join(outcome.problems)

    def ran() -> int:
        return sum(n for (name, _code), n in target.codes.items() if name == rpc)

    before = ran()
    case()
    assert ran() - before == SHARES[rpc]  # hypothesis did not stop early


def test_the_server_is_well_after_the_suite(server, target: Target, logs: LogWatch) -> None:  # type: ignore[no-untyped-def]
    """Serving, answering, no hook or tap left, metrics still render, and nothing logged an error."""
    health = target.stubs[HEALTH].Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    problems: list[str] = []
    target.infer(problems, 4)
    assert problems == []
    assert target.settle() == []
    assert target.stats().active_hooks == 0
    tel = target.stubs[TELEMETRY]
    assert tel.ListLayers(pb.ListLayersRequest(), timeout=5).active_hooks == 0
    assert list(tel.ListTaps(pb.ListTapsRequest(), timeout=5).taps) == []
    # Every baseline was deleted, so none may come back at the next start.
    assert list(Path(server.state.config.baseline_dir).iterdir()) == []
    assert server.metrics_port is not None and "layertap_inference_requests_total" in scrape(server.metrics_port)
    assert logs.take() == []
    assert grpc.StatusCode.INTERNAL.name not in {code for _, code in target.codes}
