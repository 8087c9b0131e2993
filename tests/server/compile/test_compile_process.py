"""Variants built by a child process (``server/compile/process.py``): real children, real packages."""
from __future__ import annotations

import pickle
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from layertap.server.compile.process import ProcessVariant
from layertap.server.compile.serving import CompiledServing
from layertap.server.compile.skeleton import SMALL_BYTES, skeleton_bytes
from layertap.server.taps.graph import GraphFeed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(16, 64)  # 4 KiB + bias: travels by value
        self.big = nn.Linear(64, 512)  # 128 KiB: a placeholder
        self.fc2 = nn.Linear(512, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.big(torch.relu(self.fc1(x)))))


def _variant(model: nn.Module, key: tuple[str, ...], tmp_path: Path,
             free: dict[int | str, tuple[int, ...]] | None = None) -> ProcessVariant:
    (tmp_path / "skeleton").write_bytes(skeleton_bytes(model))
    return ProcessVariant(model, key, str(tmp_path / "skeleton"), GraphFeed.statistics, free or {0: (0,)}, {},
                          str(tmp_path))


def _reference(t: torch.Tensor) -> np.ndarray:
    """The eight basic statistics of ``t`` in float64 numpy (shift K = 0 is not assumed: K is read back)."""
    x = t.detach().double().numpy().reshape(-1)
    return np.array([(x == 0).sum(), np.isnan(x).sum(), np.isfinite(x).sum(), x.min(), x.max()])


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[_Net, ProcessVariant]:
    model = _Net().eval()
    v = _variant(model, ("big", "fc1"), tmp_path_factory.mktemp("pkg"))
    with torch.inference_mode():
        v.compile((torch.zeros(2, 16),), {})
    return model, v


def test_the_skeleton_carries_small_tensors_and_placeholders_for_large_ones() -> None:
    model = _Net()
    data = skeleton_bytes(model)
    assert len(data) < model.big.weight.numel() * 4 // 2, "the large weight crossed by value"
    copy = pickle.loads(data)
    assert torch.equal(copy.fc1.weight, model.fc1.weight), "a small tensor must cross by value"
    assert copy.big.weight.shape == model.big.weight.shape and isinstance(copy.big.weight, nn.Parameter)
    assert model.big.weight.untyped_storage().nbytes() > SMALL_BYTES >= model.fc1.weight.untyped_storage().nbytes()
    assert not copy._forward_hooks and copy.fc1.weight is not model.fc1.weight


def test_a_childs_package_equals_the_eager_model_on_the_live_weights(built) -> None:
    model, v = built
    seen: dict[str, torch.Tensor] = {}
    hooks = [getattr(model, n).register_forward_hook(lambda _m, _a, o, n=n: seen.__setitem__(n, o.clone()))
             for n in ("big", "fc1")]
    try:
        for batch in (2, 3, 17):
            x = torch.randn(batch, 16)
            with torch.inference_mode():
                result = v.run((x,), {})
                want = model(x)
            assert result is not None
            out, stats, shapes = result
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
            assert shapes == [(batch, 512), (batch, 64)], "shapes read from the inputs' dims"
            assert stats is not None and stats.dtype == torch.float64 and stats.shape == (2, 8)
            for row, name in enumerate(("big", "fc1")):
                zeros, nan, count, lo, hi = _reference(seen[name])
                got = stats[row].numpy()
                assert (got[0], got[1], got[2]) == (zeros, nan, count)
                np.testing.assert_allclose(got[6:8], [lo, hi], rtol=1e-6)
                k = got[5]
                ref = seen[name].double().numpy().reshape(-1) - k
                np.testing.assert_allclose(got[3:5], [ref.sum(), (ref * ref).sum()], rtol=1e-6, atol=1e-9)
        # The package's constants are the model's own tensors: a change in place is seen, no reload.
        with torch.no_grad():
            model.fc2.bias.add_(1.0)
        try:
            x = torch.randn(4, 16)
            with torch.inference_mode():
                result = v.run((x,), {})
                assert result is not None
                torch.testing.assert_close(result[0], model(x), rtol=1e-5, atol=1e-5)
        finally:
            with torch.no_grad():
                model.fc2.bias.sub_(1.0)
    finally:
        for h in hooks:
            h.remove()


def test_inputs_the_package_was_not_built_for_never_reach_it(built) -> None:
    _, v = built
    with torch.inference_mode():
        assert v.run((torch.zeros(4, 16, dtype=torch.float64),), {}) is None, "dtype"
        assert v.run((torch.zeros(4, 16, 1),), {}) is None, "rank"
        assert v.run((torch.zeros(4, 15),), {}) is None, "a fixed dim"
        assert v.run((torch.zeros(16, 4).t(),), {}) is None, "not contiguous"
        assert v.run((torch.zeros(1, 16),), {}) is None, "batch 1: below the traced range (torch specializes 1)"
        assert v.run((), {"x": torch.zeros(4, 16)}) is None, "by keyword"
        assert v.run((torch.zeros(4, 16), torch.zeros(4, 16)), {}) is None, "an extra input"
        assert v.run((torch.zeros(4, 16),), {}) is not None


class _Raises(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("the forward refuses to be traced")


def test_a_childs_failure_names_its_exception(tmp_path: Path) -> None:
    v = _variant(_Raises(), (), tmp_path)
    with pytest.raises(RuntimeError, match=r"exited with 1: ValueError: the forward refuses to be traced"):
        v.compile((torch.zeros(2, 16),), {})
    assert v.shapes_compiled == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["skeleton"], "the job's files were left behind"


def test_cancel_kills_the_child_at_once(tmp_path: Path) -> None:
    v = _variant(_Net(), ("big",), tmp_path)
    errors: list[BaseException] = []

    def compile_() -> None:
        try:
            v.compile((torch.zeros(2, 16),), {})
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            errors.append(exc)

    t = threading.Thread(target=compile_)
    t.start()
    deadline = time.monotonic() + 60
    while v._child is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert v._child is not None, "no child started"
    started = time.monotonic()
    v.cancel()
    t.join(30)
    assert not t.is_alive() and time.monotonic() - started < 10
    assert errors and "cancelled" in str(errors[0])


class _Locked(nn.Module):
    """Holds a lock: its skeleton cannot be pickled."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.lock = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _assert_compiles_in_the_server_process(model: nn.Module) -> None:
    """Its untapped graph (input (-1, 8)) compiles, in the thread, without a failure."""
    graph = CompiledServing(model.eval(), {0: (0,)}, fallback="eager")
    assert graph.where == "process"
    try:
        with torch.inference_mode():
            graph.prepare((torch.zeros(2, 8),), {})
        assert graph.wait_idle(240)
        assert graph.where == "thread" and graph.state(()) == "ready" and graph.compile_failures == 0
    finally:
        assert graph.close()


def test_a_model_that_does_not_pickle_compiles_in_the_server_process() -> None:
    _assert_compiles_in_the_server_process(_Locked())


class _PlainTensor(nn.Module):
    """A large tensor held as a plain attribute, not a buffer: export lifts it as a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 256)
        self.table = torch.randn(256, 128, generator=torch.Generator().manual_seed(3))  # 128 KiB: a placeholder
        self.scale = torch.tensor(0.5)  # a small one: by value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) @ self.table) * self.scale


def test_a_large_plain_tensor_attribute_is_served_from_the_model_not_the_placeholder(tmp_path: Path) -> None:
    model = _PlainTensor().eval()
    v = _variant(model, (), tmp_path)
    with torch.inference_mode():
        v.compile((torch.zeros(2, 8),), {})
        x = torch.randn(5, 8)
        result = v.run((x,), {})
        assert result is not None
        torch.testing.assert_close(result[0], model(x), rtol=1e-5, atol=1e-5)


class _Sum(nn.Module):
    """Two inputs whose batch dims export traces as one symbol."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None, *, scale: torch.Tensor | None = None) -> Any:
        out = self.fc(x) + (y if y is not None else 0)
        return out * scale if scale is not None else out


def test_inputs_traced_as_one_size_must_agree_or_the_package_is_not_called(tmp_path: Path) -> None:
    model = _Sum().eval()
    v = _variant(model, ("fc",), tmp_path, {0: (0,), 1: (0,)})
    with torch.inference_mode():
        v.compile((torch.zeros(2, 8), torch.zeros(2, 8)), {})
        assert v.run((torch.zeros(5000, 8), torch.zeros(2, 8)), {}) is None, "out-of-bounds reads"
        assert v.run((torch.zeros(3, 8), torch.zeros(4, 8)), {}) is None
        x, y = torch.randn(6, 8), torch.randn(6, 8)
        result = v.run((x, y), {})
        assert result is not None
        torch.testing.assert_close(result[0], model(x, y), rtol=1e-5, atol=1e-5)


def test_keyword_and_none_inputs_compile_and_any_keyword_order_is_served(tmp_path: Path) -> None:
    model = _Sum().eval()
    v = _variant(model, ("fc",), tmp_path, {0: (0,), "y": (0,), "scale": (0,)})
    with torch.inference_mode():
        v.compile((torch.zeros(2, 8),), {"y": None, "scale": torch.zeros(2, 8)})
        x, s = torch.randn(4, 8), torch.randn(4, 8)
        result = v.run((x,), {"scale": s, "y": None})
        assert result is not None
        torch.testing.assert_close(result[0], model(x, scale=s), rtol=1e-5, atol=1e-5)
        assert v.run((x,), {"scale": s, "y": torch.zeros(4, 8)}) is None, "None was traced: a tensor is not it"
        assert v.run((x,), {"scale": s}) is None


class _Shrinks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)  # no padding: (s - 2)
        self.flat = nn.Flatten()  # 4 * (s - 2)^2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.flat(self.conv(x))


def test_tapped_output_sizes_computed_from_input_sizes_are_read_back(tmp_path: Path) -> None:
    model = _Shrinks().eval()
    (tmp_path / "skeleton").write_bytes(skeleton_bytes(model))
    # The batch and the height free (not the width too: a third symbol doubled the compile, ~95 s on 2 cores).
    v = ProcessVariant(model, ("conv", "flat"), str(tmp_path / "skeleton"), GraphFeed.statistics, {0: (0, 2)}, {},
                       str(tmp_path))
    with torch.inference_mode():
        v.compile((torch.zeros(2, 3, 9, 9),), {})
        result = v.run((torch.randn(3, 3, 7, 9),), {})
    assert result is not None
    assert result[2] == [(3, 4, 5, 7), (3, 140)]


def test_a_model_the_child_cannot_import_compiles_in_the_server_process() -> None:
    """A file factory's model: its class lives in a module only the server registered."""
    import sys
    import types

    mod = types.ModuleType("layertap_test_unimportable")
    exec("import torch\nclass Net(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
         "        self.fc = torch.nn.Linear(8, 8)\n    def forward(self, x):\n        return self.fc(x)\n", mod.__dict__)
    sys.modules[mod.__name__] = mod
    try:
        _assert_compiles_in_the_server_process(mod.Net())
    finally:
        del sys.modules[mod.__name__]


def test_close_while_a_child_compiles_kills_it_and_removes_the_work_dir() -> None:
    graph = CompiledServing(_Net().eval(), {0: (0,)}, fallback="eager")
    with torch.inference_mode():
        graph.prepare((torch.zeros(2, 16),), {})
    deadline = time.monotonic() + 60
    while graph._child is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert graph._child is not None
    workdir = graph._workdir
    started = time.monotonic()
    assert graph.close(30)
    assert time.monotonic() - started < 15
    assert workdir is not None and not Path(workdir).exists()
    assert graph.state(()) != "ready"


def test_the_exported_program_reduces_a_shared_output_once_and_bounds_the_counts(tmp_path: Path) -> None:
    # What the child exports: one set of reductions for a tensor two taps share. Its counts are
    # int32 lanes, so the server's guards refuse an input whose tapped tensor reaches 2**31 elements
    # (here 2**31 / 786432 = 2730.7 rows: no whole-number range export could have recorded).
    from torch.export import Dim

    from layertap.server.compile.child import _Tapped

    width = 3 * 2**18
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 16), nn.Sequential(nn.ReLU(), nn.Linear(16, width))).eval()
    wrapper = _Tapped(model, ("1", "1.1"), GraphFeed.statistics, lambda _shapes: None, 1, []).eval()
    with torch.no_grad():
        program = torch.export.export(wrapper, (torch.zeros(2, 1),), dynamic_shapes=(({0: Dim.AUTO},),),
                                      strict=False)
    amins = [n for n in program.graph.nodes if n.op == "call_function" and "amin" in str(n.target)]
    assert len(amins) == 1, f"{len(amins)} min reductions for one shared tensor"
    v = _variant(model, ("1", "1.1"), tmp_path)
    x = torch.randn(3, 1)
    with torch.inference_mode():
        v.compile((torch.zeros(2, 1),), {})
        result = v.run((x,), {})
        assert result is not None and result[1] is not None
        assert torch.equal(result[1][0], result[1][1])
        ref = model(x).double().numpy().reshape(-1)
        assert result[1][0, 2].item() == ref.size and result[1][0, 0].item() == (ref == 0).sum()
        np.testing.assert_allclose(result[1][0, 6:8].numpy(), [ref.min(), ref.max()], rtol=1e-6)
        package = v._packages[0]
        assert package.flat((torch.zeros(2**31 // width, 1),), {}) is not None
        assert package.flat((torch.zeros(2**31 // width + 1, 1),), {}) is None, "int32 counts would overflow"
    # Changed in place between the two hooks (an inplace ReLU returns its input): reduced again.
    inplace = nn.Sequential(nn.Linear(16, 32), nn.ReLU(inplace=True)).eval()
    w = _Tapped(inplace, ("0", "1"), GraphFeed.statistics, lambda _shapes: None, 1, []).eval()
    with torch.no_grad():
        xi = torch.randn(3, 16)
        program = torch.export.export(w, (torch.zeros(3, 16),), strict=False)
        _out, got = program.module()(xi)
        pre = inplace[0](xi)
    assert got[0, 6] < 0 <= got[1, 6], "the ReLU's tap reported the Linear's minimum"
    post = torch.relu(pre).double()
    torch.testing.assert_close(got[1, 6:8], torch.stack([post.min(), post.max()]))
    torch.testing.assert_close(got[0, 6:8], torch.stack([pre.min(), pre.max()]).double())


class _Block(nn.Module):
    """torchvision's BasicBlock: an inplace ReLU and an in-place residual add on bn2's output."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        out += x
        return self.relu(out)


def test_a_parent_that_changes_its_childs_output_in_place_gets_its_own_statistics(tmp_path: Path) -> None:
    # The block returns bn2's very tensor, changed in place after bn2's hook: two reductions, each right.
    torch.manual_seed(0)
    model = nn.Sequential(_Block()).eval()
    key = ("0.bn2", "0", "0.bn1")
    seen: dict[str, torch.Tensor] = {}
    hooks = [model.get_submodule(k).register_forward_hook(lambda _m, _a, o, k=k: seen.__setitem__(k, o.clone()))
             for k in key]
    x = torch.randn(3, 4, 6, 6)
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    v = _variant(model, key, tmp_path)
    with torch.inference_mode():
        v.compile((torch.zeros(2, 4, 6, 6),), {})
        result = v.run((x,), {})
    assert result is not None and result[1] is not None
    for row, k in enumerate(key):
        ref = seen[k].double()
        assert result[1][row, 0].item() == (ref == 0).sum().item(), k
        np.testing.assert_allclose(result[1][row, 6:8].numpy(), [ref.min().item(), ref.max().item()],
                                   rtol=1e-5, atol=1e-6, err_msg=k)
