"""``layertap.Fleet`` against two serving replicas and one target that is down."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from support.e2e import wait_for
from support.prom import free_port

import layertap

pytestmark = pytest.mark.e2e


@pytest.fixture
def replicas(make_server):
    """Two live demo servers (same seed, same weights) and a loopback port nobody listens on."""
    live = [make_server(), make_server()]
    return [s.address for s in live], f"127.0.0.1:{free_port()}"


def test_unary_calls_merge_live_targets_and_report_the_dead_one(replicas):
    live, dead = replicas
    with layertap.Fleet([*live, dead], timeout=5) as fleet:
        layers = fleet.layers()
        assert [e.target for e in layers.errors] == [dead] and not layers.ok
        assert isinstance(layers.errors[0].error, layertap.ServerUnavailable) and layers.errors[0].rank is None
        by_target = layers.by_target()
        assert list(by_target) == live  # target order, the dead one absent
        with layertap.Client(live[0]) as one:
            assert [x.name for x in by_target[live[0]]] == [x.name for x in one.layers()]
        assert all(item.rank is None for item in layers)  # serving replicas have no rank

        stats = fleet.stats()
        assert [i.target for i in stats] == live and all(i.value.taps == 0 for i in stats)

        # Active capture on both replicas at once: fc is the last layer, so it is the model's output.
        x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
        captured = fleet.capture("fc", input=x)
        assert [e.target for e in captured.errors] == [dead]
        with layertap.Client(live[1]) as one:
            want = one.infer(x)
        for item in captured:
            np.testing.assert_allclose(item.value, want, rtol=1e-5, atol=1e-6)

        drift = fleet.drift()
        assert drift.items == [] and [e.target for e in drift.errors] == [dead]  # no baselines anywhere


def test_watch_merges_streams_and_survives_a_dead_target(replicas):
    live, dead = replicas
    stop = threading.Event()

    def traffic(target: str) -> None:
        x = np.zeros((1, 3, 32, 32), np.float32)
        with layertap.Client(target) as c:
            while not stop.is_set():
                c.infer(x)

    with layertap.Fleet([dead, *live], timeout=5) as fleet:
        stream = fleet.watch("fc", reducers="moments", queue_size=100, timeout=60)
        threads = [threading.Thread(target=traffic, args=(t,), daemon=True) for t in live]
        for t in threads:
            t.start()
        try:
            seen: dict[str, int] = {}
            for item in stream:
                assert item.value.layer == "fc" and item.rank is None and item.value.rank is None
                seen[item.target] = seen.get(item.target, 0) + 1
                if len(seen) == 2 and min(seen.values()) >= 3:
                    break
            assert sorted(seen) == sorted(live)
            assert [e.target for e in stream.errors] == [dead]
            assert isinstance(stream.errors[0].error, layertap.ServerUnavailable)
        finally:
            stop.set()
            stream.close()
            for t in threads:
                t.join(10)
        assert list(stream) == []  # closed: iteration ends
        # Closing cancelled every member's subscription: their stream taps and hooks are gone.
        assert wait_for(lambda: all(i.value.subscribers == 0 and i.value.active_hooks == 0
                                    for i in fleet.stats()), 10)


def test_bad_targets_and_use_after_close():
    with pytest.raises(layertap.InvalidArgument, match="targets"):
        layertap.Fleet([])
    with pytest.raises(layertap.InvalidArgument, match="targets"):
        layertap.Fleet("127.0.0.1:1")  # type: ignore[arg-type]
    with pytest.raises(layertap.InvalidArgument, match="each target once"):
        layertap.Fleet(["127.0.0.1:5", "127.0.0.1:5"])
    fleet = layertap.Fleet(["127.0.0.1:5"])
    fleet.close()
    with pytest.raises(layertap.ClientClosed):
        fleet.layers()
    with pytest.raises(layertap.ClientClosed):
        fleet.watch("fc")


def test_a_malformed_target_closes_the_channels_already_open(monkeypatch):
    opened: list[layertap.Client] = []
    real = layertap._fleet.Client

    def tracked(*args, **kwargs):
        client = real(*args, **kwargs)
        opened.append(client)
        return client

    monkeypatch.setattr(layertap._fleet, "Client", tracked)
    with pytest.raises(layertap.InvalidArgument):
        layertap.Fleet(["127.0.0.1:5", "127.0.0.1:6", ""])  # an empty target is refused
    assert len(opened) == 2 and all(c.closed for c in opened)


def test_closing_the_fleet_ends_its_open_streams(replicas):
    live, _dead = replicas
    fleet = layertap.Fleet(live, timeout=5)
    stream = fleet.watch("fc", reducers="moments", timeout=60)
    assert wait_for(lambda: all(i.value.active_hooks > 0 for i in fleet.stats()), 10)
    done = threading.Event()

    def drain() -> None:
        for _ in stream:
            pass
        done.set()

    threading.Thread(target=drain, daemon=True).start()
    fleet.close()
    assert done.wait(10)  # iteration ended, no member error for a close we asked for
    assert stream.errors == []
    with layertap.Fleet(live, timeout=5) as again:
        assert wait_for(lambda: all(i.value.subscribers == 0 and i.value.active_hooks == 0
                                    for i in again.stats()), 10)
