"""The latency reducer against torch.profiler, on a model with one heavy layer."""

from __future__ import annotations

import statistics
import urllib.request

import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from support.e2e import wait_for
from torch import nn
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile, record_function

from layertap import Client, InvalidArgument
from layertap.server.host.sources import InputSpec, LoadedModel

pytestmark = pytest.mark.e2e

WIDTH = 768
ROWS = 512
PASSES = 9


class MatMul(nn.Module):
    """Real work: a (ROWS x WIDTH) @ (WIDTH x WIDTH) matmul, a few ms on one core."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight) @ self.weight


class OneHeavyLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.light_in = nn.ReLU()
        self.heavy = MatMul()
        self.light_out = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.light_out(self.heavy(self.light_in(x)))


def _loaded() -> LoadedModel:
    torch.manual_seed(0)
    return LoadedModel(OneHeavyLayer().eval(), "one-heavy", "factory",
                       [InputSpec("input", torch.float32, (-1, WIDTH))])


class _Ranges:
    """A ``record_function`` range around each named module, as a user would profile it."""

    def __init__(self, model: nn.Module, layers: list[str]) -> None:
        modules = dict(model.named_modules())
        self._open: dict[str, record_function] = {}
        self._handles = []
        for name in layers:
            self._handles += [modules[name].register_forward_pre_hook(lambda _m, _a, _n=name: self._enter(_n)),
                              modules[name].register_forward_hook(lambda _m, _a, _o, _n=name: self._exit(_n))]

    def _enter(self, name: str) -> None:
        self._open[name] = rf = record_function(f"layer::{name}")
        rf.__enter__()

    def _exit(self, name: str) -> None:
        self._open.pop(name).__exit__(None, None, None)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def test_heavy_layer_ranks_first_and_agrees_with_torch_profiler(make_server):
    srv = make_server(_loaded())
    layers = ["light_in", "heavy", "light_out"]
    x = np.random.default_rng(0).standard_normal((ROWS, WIDTH)).astype(np.float32)
    seen: dict[str, list[float]] = {name: [] for name in layers}
    with Client(f"127.0.0.1:{srv.port}") as client, client.watch("*", reducers=["latency"], timeout=60) as stream:
        it = iter(stream)
        assert wait_for(lambda: client.stats().subscribers == 1)  # the stream tap is in place
        client.infer(x)  # warm-up pass (allocator, first matmul)
        while next(it).layer != layers[-1]:
            pass
        # The profiler's ranges wrap the very passes the reducer times (the model thread is profiled too).
        ranges = _Ranges(srv.state.host.module, layers)
        try:
            with profile(activities=[ProfilerActivity.CPU],
                         experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
                for _ in range(PASSES):
                    client.infer(x)
                    while True:
                        s = next(it)
                        seen[s.layer].append(s.results["latency"].seconds * 1000.0)
                        if s.layer == layers[-1]:
                            break
        finally:
            ranges.remove()
    profiled: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.name.startswith("layer::"):
            profiled.setdefault(ev.name.removeprefix("layer::"), []).append(ev.cpu_time_total / 1000.0)
    assert all(len(profiled[name]) == len(seen[name]) == PASSES for name in layers), (profiled, seen)
    served = {name: statistics.median(v) for name, v in seen.items()}
    reference = {name: statistics.median(v) for name, v in profiled.items()}
    assert max(served, key=served.__getitem__) == "heavy", served
    compared = [name for name in layers if reference[name] > 1.0 or served[name] > 1.0]
    assert "heavy" in compared, reference
    for name in compared:
        assert served[name] == pytest.approx(reference[name], rel=0.2), (name, served, reference)


def test_latency_gauge_holds_the_latest_sampled_pass(make_server):
    srv = make_server(_loaded(), metrics_port=0)
    x = np.ones((4, WIDTH), dtype=np.float32)
    with Client(f"127.0.0.1:{srv.port}") as client:
        info = client.create_tap("heavy", reducers=["latency", "moments"], name="lat")
        with client.subscribe([info.id], timeout=60) as stream:
            assert wait_for(lambda: client.stats().subscribers == 1)
            client.infer(x)
            got = next(iter(stream))
        assert got.results["latency"].seconds > 0 and np.isfinite(got.results["latency"].seconds)

        def gauge() -> float | None:
            with urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10) as r:
                text = r.read().decode()
            for fam in text_string_to_metric_families(text):
                for s in fam.samples:
                    if s.name == "layertap_layer_latency_seconds" and s.labels["tap"] == "lat":
                        assert s.labels["layer"] == "heavy"
                        return float(s.value)
            return None

        assert wait_for(lambda: gauge() == got.results["latency"].seconds)
        client.delete_tap(info.id)
        assert wait_for(lambda: gauge() is None)


def test_latency_needs_the_output_point(make_server):
    srv = make_server(_loaded())
    with Client(f"127.0.0.1:{srv.port}") as client:
        with pytest.raises(InvalidArgument) as err:
            client.create_tap("heavy", reducers=["latency"], point="input")
        assert err.value.field == "spec.point"


def test_profile_command_ranks_the_heavy_layer_first(make_server, tmp_path, capsys):
    from layertap.cli import main

    srv = make_server(_loaded())
    np.save(tmp_path / "x.npy", np.ones((ROWS, WIDTH), dtype=np.float32))
    assert main(["profile", f"127.0.0.1:{srv.port}", "--input", str(tmp_path / "x.npy"), "--passes", "3",
                 "--top", "2", "--timeout", "60"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "Self CPU %" in lines[1] and "# of Calls" in lines[1]
    rows = [line.split() for line in lines[3:-2]]
    assert [r[0] for r in rows][:1] == ["heavy"] and len(rows) == 2  # --top 2 of the 3 layers (the root is untapped)
    assert all(r[-1] == "3" for r in rows)  # one call per profiled pass, warm-up excluded
    assert lines[-1].startswith("Self CPU time total:")


class Nested(nn.Module):
    """``block`` times its child's pre-hooks along with it; ``block.0`` must not."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(WIDTH, 32))  # real work, of the order of the input tap's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


#: Reducers of an input tap: a sort (quantiles) and a histogram of the input, far dearer than the Linear.
HEAVY_INPUT_REDUCERS = ["quantiles", "histogram", "moments", "minmax", "zero_fraction", "nonfinite", "abs_max"]


def heavy_input_reducers(i: int) -> list:
    """HEAVY_INPUT_REDUCERS with a histogram of its own: taps with equal reducers on one layer
    share one reduction (taps.reuse), so each tap must differ to add its cost."""
    return [{"histogram": {"bins": 64 + i}} if r == "histogram" else r for r in HEAVY_INPUT_REDUCERS]


def test_an_input_tap_added_after_the_latency_tap_is_not_timed(make_server):
    torch.manual_seed(0)
    srv = make_server(LoadedModel(Nested().eval(), "nested", "factory", [InputSpec("input", torch.float32, (-1, WIDTH))]))
    x = np.random.default_rng(1).standard_normal((4 * ROWS, WIDTH)).astype(np.float32)

    def medians(client: Client, stream_it) -> dict[str, float]:
        seen: dict[str, list[float]] = {"block": [], "block.0": []}
        for _ in range(PASSES):
            client.infer(x)
            while True:
                s = next(stream_it)
                seen[s.layer].append(s.results["latency"].seconds)
                if s.layer == "block":  # the parent's forward ends last
                    break
        return {name: statistics.median(v) for name, v in seen.items()}

    with Client(f"127.0.0.1:{srv.port}") as client, \
            client.watch("re:^block(\\.0)?$", reducers=["latency"], timeout=120) as stream:
        it = iter(stream)
        assert wait_for(lambda: client.stats().subscribers == 1)
        client.infer(x)  # warm-up pass
        while next(it).layer != "block":
            pass
        alone = medians(client, it)
        for i in range(4):
            client.create_tap("block.0", point="input", reducers=heavy_input_reducers(i), name=f"heavy-input-{i}")
        tapped = medians(client, it)
    # The parent's span holds the input tap's pre-hook whatever the order: that is its cost.
    cost = tapped["block"] - alone["block"]
    assert cost > 2 * alone["block.0"], (alone, tapped)  # the input tap is dear enough to be seen
    # Timed inside, the child gains the whole cost (measured before the fix: 184 ms of 184). Outside,
    # measured on a 2-vCPU VM: -10 to +0.7 ms of 9 to 330 ms (the cost varies with the process's state).
    assert tapped["block.0"] - alone["block.0"] < 0.1 * cost, (alone, tapped)
