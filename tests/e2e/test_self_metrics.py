"""The pipeline's own health on /metrics: a failing transfer or baseline is visible."""

from __future__ import annotations

import pytest
from support.e2e import batch, scrape, wait_for

import layertap

pytestmark = pytest.mark.e2e


def test_transfer_and_baseline_counters_are_exported(make_server) -> None:
    srv = make_server(metrics_port=0)
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        client.create_tap("layer1", reducers=["moments"], ttl=60)
        for i in range(3):
            client.infer(batch(2, seed=i))
        srv.state.taps.flush(5)
        assert wait_for(lambda: scrape(srv.metrics_port).get("layertap_transfer_passes_total", 0) >= 3)
        m = scrape(srv.metrics_port)
    # The same numbers the transfer thread keeps, and nothing lost or failed.
    stats = srv.state.taps.transfer.stats()
    assert m["layertap_transfer_passes_total"] == stats.processed >= 3
    assert m["layertap_transfer_dropped_passes_total"] == stats.dropped == 0
    assert m["layertap_transfer_errors_total"] == stats.errors == 0
    assert m["layertap_pinned_buffers_allocated_total"] == stats.pinned_allocations
    assert m["layertap_baseline_skipped_passes_total"] == srv.state.drift.skipped_passes() == 0
