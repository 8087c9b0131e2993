"""The compiled basic-statistics kernel: agrees with eager and numpy, and never compiles inside a pass.

Compiles cost seconds of CPU each, so this file compiles few signatures, once
(a module-scoped instance warmed up front), and the other tests reuse them.
Agreement runs OUTSIDE any dispatch mode: under one the compiled function
would run its decomposed graph, not the inductor kernel (and
``CompiledStats.stats`` declines anyway). The no-sync proof on CPU stays with
the eager path (test_no_sync); here a test checks that a mode sends the plan
there. Tolerances as in test_reducers: counts, min/max and K exact, float64
sums to ``1e-9 * max|x|`` (``**2`` for the sum of squares).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from support.sync_guard import NoSyncMode
from support.tensors import gen, plant_nonfinite
from torch import nn

from layertap.server.compile import aoti, worker
from layertap.server.compile.kernel import DENSE, ROWS, SHIFT_SAMPLE, Signature, canonical_form, signature_of
from layertap.server.compile.stats import MAX_GUARD_MISSES, CompiledStats
from layertap.server.reducers.kernels import COUNT, MAX, MIN, NAN, S1, S2, SHIFT, ZEROS, StatNeeds, fused_basic_stats
from layertap.server.reducers.plan import ReducerPlan, build_reducers
from layertap.server.reducers.spec import parse_reducer_names
from layertap.server.reducers.workspace import Workspace

pytestmark = pytest.mark.slow

ALL_NEEDS = StatNeeds(zeros=True, nan=True, count=True, sums=True, shifted=True, minmax=True)
BASIC = "moments,minmax,abs_max,zero_fraction,nonfinite,norm"
SUM_RTOL = 1e-9
WAIT = 600.0  # seconds; a cold compile on a busy 2-core machine takes ~20 s


#: Every case has more than SHIFT_SAMPLE elements (smaller ones stay eager, see below).
CASES: dict[str, Callable[[], torch.Tensor]] = {
    "f32_random": lambda: torch.randn(4, 8, 5, 5, generator=gen()) * 3 + 0.5,
    "f32_nan_inf": lambda: plant_nonfinite(torch.randn(5, 100, generator=gen(1))),
    "f32_all_nan": lambda: torch.full((3, 40), math.nan),
    "f32_only_inf": lambda: torch.tensor([math.inf, -math.inf] * 40),
    "f32_zeros_negzero": lambda: torch.tensor([-0.0, 0.0, 1.0, -0.0] * 30),
    "f32_huge": lambda: torch.randn(2, 4000, generator=gen()) * 1e30,
    "f32_offset": lambda: torch.randn(5, 2000, generator=gen()) + 1e6,
    "f16": lambda: plant_nonfinite((torch.randn(6, 50, generator=gen()) * 4).half()),
    "bf16": lambda: plant_nonfinite((torch.randn(6, 50, generator=gen()) * 4).bfloat16()),
    "bf16_huge": lambda: (torch.randn(3, 200, generator=gen()) * 1e30).bfloat16(),
    "f64": lambda: plant_nonfinite(torch.randn(300, dtype=torch.float64, generator=gen())),
    "f64_near_max": lambda: torch.tensor([1.5e308, -1.7e308, 1.0, 2.0] * 20, dtype=torch.float64),
    "int64": lambda: torch.randint(-(10**12), 10**12, (3, 70), dtype=torch.int64, generator=gen()),
    "bool": lambda: torch.rand(4, 30, generator=gen()) > 0.3,
    "channels_last": lambda: plant_nonfinite(torch.randn(2, 6, 5, 7, generator=gen())).to(memory_format=torch.channels_last),
    "transposed": lambda: torch.randn(30, 20, generator=gen()).t(),
    "offset_view": lambda: torch.randn(500, generator=gen())[3:],
    "sliced_last_dim": lambda: plant_nonfinite(torch.randn(20, 30, generator=gen()))[:, 2:],
    "sliced_merges_to_rows": lambda: torch.randn(6, 40, 50, generator=gen())[:, ::2, 3:],
    "chunk": lambda: torch.randn(64, 3 * 48, generator=gen()).chunk(3, dim=-1)[1],
}
#: The signatures the cases need, compiled once for the whole file.
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.bool)


def _sig(dtype: torch.dtype, form: str = DENSE) -> Signature:
    return Signature(torch.device("cpu"), dtype, form, grad=False, inference=True, autocast=None)


@pytest.fixture(scope="module")
def compiled() -> Iterator[CompiledStats]:
    cs = CompiledStats()
    for dtype in DTYPES:
        assert cs.compile_ahead(_sig(dtype))
    assert cs.compile_ahead(_sig(torch.float32, ROWS))
    assert cs.wait_idle(WAIT), cs.states()
    assert cs.compile_failures == 0, cs.states()
    yield cs
    cs.close()


@pytest.fixture
def use(compiled: CompiledStats) -> CompiledStats:
    """The module's compiled instance, the kernel of the plans a test builds with ``kernel=use``."""
    return compiled


def _ws(x: torch.Tensor, seed: int = 0) -> Workspace:
    return Workspace(x, gen(seed))


def _np(x: torch.Tensor) -> np.ndarray:
    return x.detach().to(torch.float64).reshape(-1).numpy().copy()


# ------------------------------------------------------------- agreement


@pytest.mark.parametrize("case", CASES)
def test_compiled_vector_agrees_with_eager_and_numpy(compiled: CompiledStats, case: str) -> None:
    x = CASES[case]()
    with torch.inference_mode():
        calls = compiled.compiled_calls
        got = compiled.stats(_ws(x), ALL_NEEDS)
        want = fused_basic_stats(_ws(x), ALL_NEEDS)
    assert got is not None, f"{case} should run compiled ({canonical_form(x)})"
    assert compiled.compiled_calls == calls + 1
    assert got.dtype == torch.float64 and got.shape == (8,)
    g, w = got.numpy(), want.numpy()
    # Exact: counts, min/max, and K (the same elements, the same median).
    np.testing.assert_array_equal(g[[ZEROS, NAN, COUNT, MIN, MAX]], w[[ZEROS, NAN, COUNT, MIN, MAX]])
    if x.is_floating_point():
        assert g[SHIFT] == w[SHIFT]
    else:  # a mean of SHIFT_SAMPLE integers: float64 summation order only
        assert g[SHIFT] == pytest.approx(w[SHIFT], rel=1e-15, abs=1e-15)
    a = _np(x)
    fin = a[np.isfinite(a)]
    scale = float(np.abs(fin).max()) if fin.size else 1.0
    for slot, tol in ((S1, SUM_RTOL * scale), (S2, SUM_RTOL * scale * scale)):
        if not math.isfinite(w[slot]):  # float64 x - K overflowed: inf, or inf - inf
            assert g[slot] == w[slot] or (math.isnan(g[slot]) and math.isnan(w[slot]))
        else:
            assert abs(g[slot] - w[slot]) <= tol * max(fin.size, 1), (slot, g[slot], w[slot])
    # Against numpy float64 directly.
    assert g[ZEROS] == np.count_nonzero(a == 0)
    assert g[NAN] == np.count_nonzero(np.isnan(a))
    assert g[COUNT] == fin.size
    if fin.size:
        assert (g[MIN], g[MAX]) == (fin.min(), fin.max())
        if not math.isinf(g[S2]):
            mean = g[SHIFT] + g[S1] / g[COUNT]
            assert abs(mean - fin.mean()) <= SUM_RTOL * scale
    else:
        assert g[MIN] > g[MAX]  # no finite element: (inf, -inf)


def test_unshifted_needs_give_k_zero_like_eager(compiled: CompiledStats) -> None:
    needs = StatNeeds(count=True, sums=True)  # norm alone: K = 0
    x = torch.randn(40, 30, generator=gen()) + 5
    with torch.inference_mode():
        got = compiled.stats(_ws(x), needs)
        want = fused_basic_stats(_ws(x), needs)
    assert got is not None
    assert got[SHIFT] == 0 == want[SHIFT]
    assert got[COUNT] == want[COUNT]
    assert got[S2].item() == pytest.approx(want[S2].item(), rel=1e-12)


@pytest.mark.parametrize("case", ["f32_nan_inf", "bf16", "int64", "channels_last", "sliced_last_dim"])
def test_plan_results_match_eager_plan(use: CompiledStats, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    x = CASES[case]()
    plan = ReducerPlan(build_reducers(parse_reducer_names(BASIC + ",histogram,quantiles")), kernel=use)
    calls = use.compiled_calls
    with torch.inference_mode():
        got = plan.decode(plan.run(x).numpy(), x.shape)
    assert use.compiled_calls == calls + 1
    eager = ReducerPlan(build_reducers(parse_reducer_names(BASIC + ",histogram,quantiles")))  # no kernel: eager
    with torch.inference_mode():
        want = eager.decode(eager.run(x).numpy(), x.shape)
    assert got[1:5] == want[1:5]  # minmax, abs_max, zero_fraction, nonfinite: exact
    # The same draws from the plan's generator: identical samples downstream.
    assert got[6:] == want[6:]
    for g, w in ((got[0].moments, want[0].moments), (got[5].norm, want[5].norm)):
        for field in g.DESCRIPTOR.fields:
            gv, wv = getattr(g, field.name), getattr(w, field.name)
            assert gv == pytest.approx(wv, rel=1e-9, abs=1e-9), (field.name, gv, wv)


@pytest.mark.parametrize(
    "name, make",
    [
        ("empty", lambda: torch.empty(3, 0, 4)),
        ("tiny", lambda: torch.randn(4, SHIFT_SAMPLE // 4)),  # shift_of reads them all
        ("scalar", lambda: torch.tensor(2.5)),
        ("expanded", lambda: torch.randn(3, 1, 90).expand(3, 4, 90)),
        ("strided_inner", lambda: torch.randn(40, 40)[:, ::2]),
        ("transposed_slice", lambda: torch.randn(30, 40)[:, 3:].t()),
    ],
)
def test_other_tensors_stay_eager(compiled: CompiledStats, name: str, make: Callable[[], torch.Tensor]) -> None:
    x = make()
    assert canonical_form(x) is None
    before = compiled.states()
    with torch.inference_mode():
        assert compiled.stats(_ws(x), ALL_NEEDS) is None
    assert compiled.states() == before  # nothing queued


def test_canonical_forms() -> None:
    assert canonical_form(torch.randn(2, 6, 5, 7).to(memory_format=torch.channels_last)) == (DENSE, (420,), (1,))
    assert canonical_form(torch.randn(6, 40, 50)[:, ::2, 3:]) == (ROWS, (120, 47), (100, 1))
    assert canonical_form(torch.randn(4, 1, 30, 20)[:, :, :, 1:]) == (ROWS, (120, 19), (20, 1))
    assert canonical_form(torch.randn(4, 9, 8)[::2, 1:, ::3]) is None


def test_under_a_dispatch_mode_the_plan_runs_eager_without_sync(use: CompiledStats) -> None:
    plan = ReducerPlan(build_reducers(parse_reducer_names(BASIC)), kernel=use)
    x = CASES["f32_nan_inf"]()
    calls = use.compiled_calls
    with torch.inference_mode(), NoSyncMode():
        plan.run(x)
    assert use.compiled_calls == calls


# ----------------------------------------------- never compile inside a pass


class _Compiles:
    """Records which thread each compile runs on: dynamo frame compiles and AOTInductor packages built."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import torch._dynamo.convert_frame as convert_frame

        self.threads: list[int] = []
        for module, name in ((convert_frame, "_compile"), (aoti, "_compile")):
            monkeypatch.setattr(module, name, self._spy(getattr(module, name)))

    def _spy(self, inner: Callable[..., object]) -> Callable[..., object]:
        def spy(*args: object, **kwargs: object) -> object:
            self.threads.append(threading.get_ident())
            return inner(*args, **kwargs)

        return spy

    def on(self, ident: int) -> int:
        return sum(t == ident for t in self.threads)


class _Net(nn.Module):
    """Outputs of a new dtype, a new shape and a sliced layout, per pass."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.act = nn.ReLU()
        self.head = nn.Linear(4 * 8 * 8, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.conv(x))
        z = self.head(y.flatten(1))
        return z[:, 8:]  # the returned module output is a slice


def test_a_pass_never_compiles_and_runs_compiled_once_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Lock()
    cs = CompiledStats(gate=gate)
    spy = _Compiles(monkeypatch)
    main = threading.get_ident()
    net = _Net().eval()
    plan = ReducerPlan(build_reducers(parse_reducer_names(BASIC)), kernel=cs)
    results: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(_m: nn.Module, _a: object, out: torch.Tensor) -> None:
        results.append((out, plan.run(out)))

    handles = [m.register_forward_hook(hook) for m in (net.conv, net.act, net)]
    try:
        with gate:  # hold the background compiles: every signature is new
            with torch.inference_mode():
                net(torch.randn(5, 3, 8, 8, generator=gen()))  # float32 dense (conv, relu), rows (the slice)
                net.double()(torch.randn(5, 3, 8, 8, dtype=torch.float64, generator=gen()))  # a new dtype
            assert len(results) == 6
            assert cs.compiled_calls == 0 and cs.eager_calls == 6
            assert spy.on(main) == 0
            assert set(cs.states().values()) <= {"queued", "compiling"} and len(cs.states()) == 4
        assert cs.wait_idle(WAIT), cs.states()
        assert cs.compiles == 4 and cs.compile_failures == 0, cs.states()
        assert spy.threads and spy.on(main) == 0  # all on the compile thread
        n_compiles = len(spy.threads)

        results.clear()
        with torch.inference_mode():
            net.float()(torch.randn(7, 3, 8, 8, generator=gen(1)))  # a new batch size
            net.double()(torch.randn(2, 3, 8, 8, dtype=torch.float64, generator=gen(2)))
            net.float().to(memory_format=torch.channels_last)(  # a new layout
                torch.randn(3, 3, 8, 8, generator=gen(3)).to(memory_format=torch.channels_last))
        assert results[-3][0].is_contiguous(memory_format=torch.channels_last)
        assert cs.compiled_calls == 9 and cs.guard_misses == 0
        assert len(spy.threads) == n_compiles  # no compile anywhere
    finally:
        for h in handles:
            h.remove()
        cs.close()
    # The compiled results decode to the eager ones (K may differ: other draws).
    eager = ReducerPlan(build_reducers(parse_reducer_names(BASIC)))  # no kernel: eager
    for out, vec in results:
        got = plan.decode(vec.numpy(), out.shape)
        with torch.inference_mode():
            want = eager.decode(eager.run(out).numpy(), out.shape)
        assert got[1:5] == want[1:5]
        assert got[0].moments.count == want[0].moments.count
        assert got[0].moments.mean == pytest.approx(want[0].moments.mean, rel=1e-9, abs=1e-9)
        assert got[0].moments.std == pytest.approx(want[0].moments.std, rel=1e-9, abs=1e-9)
        assert got[5].norm.l2 == pytest.approx(want[5].norm.l2, rel=1e-9)


def test_a_guard_miss_goes_eager_without_compiling(compiled: CompiledStats, monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards are dynamo's: the rows form (dense CPU tensors get the guard-free AOTInductor kernel)."""
    spy = _Compiles(monkeypatch)
    x = CASES["sliced_last_dim"]()
    assert compiled._compiler.ready(signature_of(x, inference=True)).backend == "direct"  # type: ignore[union-attr]
    sig = signature_of(x, inference=True)
    assert compiled.states()[sig] == "ready"
    misses = compiled.guard_misses
    # Deterministic algorithms are in dynamo's global-state guard, not in our signature.
    prior = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with torch.inference_mode():
            assert compiled.stats(_ws(x), ALL_NEEDS) is None
    finally:
        torch.use_deterministic_algorithms(prior)
    assert compiled.guard_misses == misses + 1
    assert spy.threads == []
    with torch.inference_mode():
        assert compiled.stats(_ws(x), ALL_NEEDS) is not None  # guards hold again


def test_run_only_mode_counts_misses_and_goes_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    cs = CompiledStats(direct=False, aoti=False)
    try:
        assert cs.compile_ahead(_sig(torch.float32))
        assert cs.wait_idle(WAIT) and cs.compiles == 1, cs.states()
        assert cs._compiler.ready(_sig(torch.float32)).backend == "run-only"  # type: ignore[union-attr]
        x = CASES["f32_nan_inf"]()
        with torch.inference_mode():
            got = cs.stats(_ws(x), ALL_NEEDS)
            want = fused_basic_stats(_ws(x), ALL_NEEDS)
        assert got is not None and cs.compiled_calls == 1
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12, atol=1e-12)
        spy = _Compiles(monkeypatch)
        torch.use_deterministic_algorithms(True)
        try:
            with torch.inference_mode():
                for _ in range(MAX_GUARD_MISSES):
                    assert cs.stats(_ws(x), ALL_NEEDS) is None
        finally:
            torch.use_deterministic_algorithms(False)
        assert spy.threads == []  # run-only: the body ran uncompiled, nothing compiled
        assert cs.guard_misses == MAX_GUARD_MISSES
        assert cs.states()[_sig(torch.float32)] == "stale"
        with torch.inference_mode():
            assert cs.stats(_ws(x), ALL_NEEDS) is None  # eager for good
    finally:
        cs.close()


# --------------------------------------------------- failures and switches


@pytest.mark.parametrize("use_aoti", [True, False])
def test_a_compile_failure_is_counted_and_stays_eager(monkeypatch: pytest.MonkeyPatch, use_aoti: bool) -> None:
    def unbuildable(sig: Signature, example: object) -> object:
        raise RuntimeError("the package does not build")

    def broken(sig: Signature) -> Callable[..., torch.Tensor]:
        def kernel(x: torch.Tensor, rnd: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # data-dependent control flow: no full graph
                return x
            return rnd

        return kernel

    monkeypatch.setattr(worker, "kernel_function", broken)
    monkeypatch.setattr(aoti, "load_or_compile", unbuildable)
    cs = CompiledStats(aoti=use_aoti)
    try:
        x = torch.randn(300)
        with torch.inference_mode():
            assert cs.stats(_ws(x), ALL_NEEDS) is None
            assert cs.wait_idle(WAIT)
            assert cs.stats(_ws(x), ALL_NEEDS) is None
        assert cs.compile_failures == 1 and cs.compiles == 0
        sig = signature_of(x, inference=True)
        assert cs.states() == {sig: "failed"}
        assert not cs.compile_ahead(sig)  # never retried
        assert cs.counters() == {"compiles": 0, "compile_failures": 1, "compiled_calls": 0,
                                 "eager_calls": 2, "guard_misses": 0, "bad_packages": 0}
    finally:
        cs.close()


def test_kernels_warm_up_on_a_thread_that_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm-up runs the kernel, and libgomp keeps an OpenMP team for every
    thread that ran a parallel region until that thread exits: on the
    long-lived compile thread it would oversubscribe the cores for good."""
    warmed_on: list[threading.Thread] = []
    real = worker.example_of

    def spy(sig: Signature) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        warmed_on.append(threading.current_thread())
        return real(sig)

    monkeypatch.setattr(worker, "example_of", spy)
    cs = CompiledStats()
    try:
        assert cs.compile_ahead(_sig(torch.float32)) and cs.wait_idle(WAIT)
        assert cs.states() == {_sig(torch.float32): "ready"}
        compile_thread = cs._compiler._thread
        assert compile_thread is not None and compile_thread.is_alive()
        assert warmed_on and {*warmed_on} == {warmed_on[0]} and warmed_on[0] is not compile_thread
        warmed_on[0].join(WAIT)
        assert not warmed_on[0].is_alive()
    finally:
        cs.close()


def test_dense_cpu_tensors_get_the_aoti_kernel_and_rows_keep_dynamo(compiled: CompiledStats) -> None:
    for dtype in DTYPES:
        assert compiled._compiler.ready(_sig(dtype)).backend == "aoti"  # type: ignore[union-attr]
    assert compiled._compiler.ready(_sig(torch.float32, ROWS)).backend == "direct"  # type: ignore[union-attr]


def test_another_mode_loads_the_cached_package_without_compiling(compiled: CompiledStats,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Modes do not reach an AOTInductor library: a grad-mode signature (a training
    agent's) loads the package the inference signature built, as a restart does."""
    spy = _Compiles(monkeypatch)
    sig = _sig(torch.float32)
    path = aoti.package_path(sig)
    built = (path.stat().st_ino, path.read_bytes())  # a rebuild replaces the file: a new inode
    x = CASES["f32_nan_inf"]()
    with torch.inference_mode():
        want = compiled.stats(_ws(x), ALL_NEEDS)
    grad_sig = sig._replace(grad=True, inference=False)
    known = compiled.states()
    with torch.enable_grad():  # the ready kernel serves it at once: nothing queued, nothing eager
        eager_before = compiled.eager_calls
        assert torch.equal(compiled.stats(_ws(x), ALL_NEEDS), want)
    assert compiled.states() == known and compiled.eager_calls == eager_before
    # And compiling the mode's own signature (a restart, a training agent) loads the package.
    assert compiled.compile_ahead(grad_sig) and compiled.wait_idle(WAIT)
    assert compiled.states()[grad_sig] == "ready"
    with torch.enable_grad():
        got = compiled.stats(_ws(x), ALL_NEEDS)
    assert got is not None and want is not None and torch.equal(got, want)
    assert spy.threads == [] and (path.stat().st_ino, path.read_bytes()) == built


def test_packages_unused_for_stale_days_are_pruned_and_loads_mark_use(compiled: CompiledStats, tmp_path: Path) -> None:
    now = time.time()
    old = now - (aoti.STALE_DAYS + 1) * 86400

    def made(name: str, mtime: float) -> Path:
        path = tmp_path / name
        path.write_bytes(b"x")
        os.utime(path, (mtime, mtime))
        return path

    made("basic_stats-float32-dense-0ld.pt2", old)  # an older torch's, or a host gone from the volume
    made("basic_stats-float32-dense-0ld-abc123.tmp.pt2", old)  # a compile killed mid-write
    kept = [made("basic_stats-float16-dense-recent.pt2", now - 86400), made("notes.txt", old)]
    own = made("basic_stats-float32-dense-mine.pt2", old)  # this process's, about to load after a long run
    assert aoti.prune(tmp_path, now, keep=own) == 2
    assert sorted(tmp_path.iterdir()) == sorted([*kept, own])
    # A load refreshes the package's time, so a package in use is never stale.
    sig = _sig(torch.float32)
    path = aoti.package_path(sig)
    os.utime(path, (old, old))
    aoti.load_or_compile(sig, worker.example_of(sig))
    assert path.stat().st_mtime > now - 60
    aoti.prune(path.parent)
    assert path.exists()


def test_a_cached_package_that_does_not_load_is_rebuilt_and_counted(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aoti, "cache_dir", lambda: tmp_path)
    sig = _sig(torch.float32)
    path = aoti.package_path(sig)
    path.write_bytes(b"not a package")
    cs = CompiledStats()
    try:
        assert cs.compile_ahead(sig) and cs.wait_idle(WAIT)
        assert cs.states() == {sig: "ready"} and cs.counters()["bad_packages"] == 1
        assert path.stat().st_size > 1000 and [p.name for p in tmp_path.iterdir()] == [path.name]
        x = CASES["f32_random"]()
        with torch.inference_mode():
            got = cs.stats(_ws(x), ALL_NEEDS)
            want = fused_basic_stats(_ws(x), ALL_NEEDS)
        assert got is not None
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-9, atol=1e-9)
    finally:
        cs.close()


class _Replicas:
    """A shared cache volume with a fake loader and compiler: a package file "loads"
    when its bytes say ``good``; ``on_fail`` (a load fails) and ``during_compile`` are
    where another replica acts."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *, compile_ok: bool = True) -> None:
        self.compiles = 0
        self.on_fail: Callable[[Path], None] = lambda _p: None
        self.during_compile: Callable[[], None] = lambda: None
        monkeypatch.setattr(aoti, "cache_dir", lambda: tmp_path)
        self.path = aoti.package_path(_sig(torch.float32))

        def load(path: Path) -> object:
            if path.read_bytes() != b"good":
                self.on_fail(path)
                raise RuntimeError("not a package")
            return "kernel"

        def compile_(path: Path, _example: object, _form: str = DENSE) -> None:
            self.compiles += 1
            self.during_compile()
            if not compile_ok:
                raise RuntimeError("no C++ compiler")
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(b"good")
            os.replace(tmp, path)

        monkeypatch.setattr(aoti, "_load", load)
        monkeypatch.setattr(aoti, "_compile", compile_)

    def replace(self, content: bytes) -> None:
        """What another replica's compile does: an atomic rename over the path."""
        tmp = self.path.with_suffix(".other")
        tmp.write_bytes(content)
        os.replace(tmp, self.path)

    def load_or_compile(self) -> tuple[object, bool]:
        return aoti.load_or_compile(_sig(torch.float32), worker.example_of(_sig(torch.float32)))


def test_a_bad_package_is_rebuilt_over_atomically_never_unlinked_first(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas share the cache volume: the path never goes missing while one rebuilds."""
    fs = _Replicas(monkeypatch, tmp_path)
    fs.path.write_bytes(b"truncated")
    missing: list[bool] = []
    real_compile = aoti._compile

    def watching(path: Path, example: object, form: str = DENSE) -> None:
        missing.append(not path.exists())  # what a replica starting now would find
        real_compile(path, example, form)

    monkeypatch.setattr(aoti, "_compile", watching)
    assert fs.load_or_compile() == ("kernel", True)
    assert missing == [False] and fs.compiles == 1 and fs.path.read_bytes() == b"good"


def test_a_package_another_replica_rebuilt_meanwhile_is_loaded_not_compiled_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fs = _Replicas(monkeypatch, tmp_path)
    fs.path.write_bytes(b"truncated")
    fs.on_fail = lambda _p: fs.replace(b"good")  # the other replica's rename lands during our failed load
    assert fs.load_or_compile() == ("kernel", True)
    assert fs.compiles == 0 and fs.path.read_bytes() == b"good"


def test_a_failed_rebuild_removes_the_bad_package_but_never_a_replicas_new_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fs = _Replicas(monkeypatch, tmp_path, compile_ok=False)
    fs.path.write_bytes(b"truncated")
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        fs.load_or_compile()
    assert not fs.path.exists()  # not left for the next start to trip on
    # Another replica writes its package while our rebuild runs (and fails): theirs is kept.
    fs.path.write_bytes(b"truncated")
    fs.during_compile = lambda: fs.replace(b"another")
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        fs.load_or_compile()
    assert fs.path.read_bytes() == b"another"


def test_counts_only_plans_run_the_aoti_kernel_and_decline_dynamo(use: CompiledStats) -> None:
    """every=N taps run nonfinite alone on most passes: the AOTInductor kernel costs
    less than the eager counts there, a dynamo kernel's call more."""
    plan = ReducerPlan(build_reducers(parse_reducer_names("nonfinite")), kernel=use)
    dense, rows = CASES["f32_nan_inf"](), CASES["sliced_last_dim"]()
    before = use.counters()
    for x, compiled_calls in ((dense, 1), (rows, 1)):  # cumulative: the rows call adds none
        with torch.inference_mode():
            (got,) = plan.decode(plan.run(x).numpy(), x.shape)
        values = _np(x)
        assert (got.nonfinite.nan_count, got.nonfinite.inf_count) == (np.isnan(values).sum(), np.isinf(values).sum())
        assert use.compiled_calls == before["compiled_calls"] + compiled_calls
    assert use.eager_calls == before["eager_calls"]  # the rows call was declined, not a fallback


def test_the_package_key_separates_cpus_and_modes_share_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor builds for the native CPU: another host's package must never be loaded."""
    sig = _sig(torch.float32)
    here = aoti.package_path(sig)
    assert aoti.package_path(sig._replace(grad=True, inference=False)) == here
    assert aoti.package_path(_sig(torch.float16)) != here
    monkeypatch.setattr(aoti, "_host_build", lambda: "x86_64 avx2 g++")
    assert aoti.package_path(sig) != here


def test_disabled_never_compiles_nor_starts_a_thread() -> None:
    cs = CompiledStats(enabled=False)
    x = torch.randn(300)
    with torch.inference_mode():
        assert cs.stats(_ws(x), ALL_NEEDS) is None
    assert not cs.compile_ahead(x)
    assert cs.states() == {} and cs._compiler._thread is None
    assert cs.counters()["eager_calls"] == 0


def test_the_process_instance_is_off_until_the_server_turns_it_on() -> None:
    from layertap.server.app import process_compilation

    assert not process_compilation().stats.enabled
    assert ReducerPlan(build_reducers(parse_reducer_names(BASIC))).kernel is None  # a plan alone runs eager


def test_signature_modes_follow_the_thread_or_the_caller() -> None:
    x = torch.randn(100)
    with torch.inference_mode():
        assert signature_of(x) == _sig(torch.float32)
    with torch.no_grad():
        assert signature_of(x) == _sig(torch.float32)._replace(inference=False)
    assert signature_of(x, inference=True) == _sig(torch.float32)  # implies grad=False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert signature_of(x, inference=True, grad=False).autocast == torch.bfloat16  # type: ignore[union-attr]


def test_no_cxx_compiler_turns_the_device_type_off(monkeypatch: pytest.MonkeyPatch) -> None:
    no_compiler = type("InvalidCxxCompiler", (RuntimeError,), {})

    def missing(sig: Signature) -> Callable[..., torch.Tensor]:
        raise no_compiler("No working C++ compiler found")

    monkeypatch.setattr(worker, "kernel_function", missing)
    monkeypatch.setattr(aoti, "load_or_compile", lambda sig, example: missing(sig))
    cs = CompiledStats()
    try:
        assert cs.compile_ahead(_sig(torch.float64))
        assert cs.wait_idle(WAIT)
        assert cs.compile_failures == 1
        assert not cs.compile_ahead(_sig(torch.float32))  # not tried: it would fail the same way
        assert cs.states() == {_sig(torch.float64): "failed"}
    finally:
        cs.close()


#: A process that exits while a cold compile runs: the compile thread must be
#: joined before the interpreter finalizes, or the process aborts
#: ("terminate called without an active exception", SIGABRT), as
#: ``layertap demo drift`` did on a fresh CI machine.
_EXIT_DURING_COMPILE = """
import time, torch
from layertap.server.app import process_compilation
from layertap.server.compile.kernel import DENSE, Signature
stats = process_compilation().stats
stats.set_enabled(True)
assert stats.compile_ahead(Signature(torch.device("cpu"), torch.float32, DENSE,
                                              grad=False, inference=True, autocast=None))
time.sleep(3)  # inside the cold compile (15-20 s on 2 cores)
print("leaving")
"""


def test_exit_during_a_cold_compile_is_clean(tmp_path: Path) -> None:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}  # cold: nothing cached
    res = subprocess.run([sys.executable, "-c", _EXIT_DURING_COMPILE], capture_output=True, text=True,
                         timeout=WAIT, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "leaving"
    assert res.stderr == "", res.stderr  # no abort message, no warning about the interrupted compile


def test_a_cached_package_loads_without_importing_dynamo_or_inductor(compiled: CompiledStats) -> None:
    """A server whose packages are cached never needs dynamo or inductor: importing them costs
    ~70-80 MiB of resident memory (measured), the C++ loader ~1 MiB."""
    assert aoti.package_path(_sig(torch.float32)).exists()  # the fixture built it
    script = textwrap.dedent("""
        import sys, torch
        from layertap.server.compile.stats import CompiledStats
        from layertap.server.compile.kernel import DENSE, Signature
        from layertap.server.reducers.kernels import StatNeeds, fused_basic_stats
        from layertap.server.reducers.workspace import Workspace
        cs = CompiledStats()
        sig = Signature(torch.device("cpu"), torch.float32, DENSE, grad=False, inference=True, autocast=None)
        assert cs.compile_ahead(sig) and cs.wait_idle(120), cs.states()
        x = torch.randn(300, 7) * 3 + 1
        needs = StatNeeds(zeros=True, nan=True, count=True, sums=True, shifted=True, minmax=True)
        with torch.inference_mode():
            ws = lambda: Workspace(x, torch.Generator().manual_seed(0), False)
            got, want = cs.stats(ws(), needs), fused_basic_stats(ws(), needs)
        assert cs.states()[sig] == "ready" and cs.counters()["compiled_calls"] == 1, cs.counters()
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-9), (got, want)
        print(sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e4])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_graph_stats_equal_a_float64_numpy_reference(scale: float, layout: str) -> None:
    """The in-graph statistics (``graph_stats``: a cheap shift K, any rank, any layout) against numpy."""
    from layertap.server.compile.kernel import graph_stats

    gen = torch.Generator().manual_seed(int(scale * 7) + len(layout))
    x = torch.randn(6, 12, 5, 7, generator=gen) * scale + 30 * scale
    flat = x.view(-1)
    flat[::53] = float("nan")
    flat[3], flat[4], flat[9] = float("inf"), float("-inf"), 0.0
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    row = graph_stats(x).numpy()
    v = x.double().numpy().reshape(-1)
    fin = v[np.isfinite(v)]
    assert row[0] == (v == 0).sum() and row[1] == np.isnan(v).sum() and row[2] == fin.size
    assert row[6] == fin.min() and row[7] == fin.max()
    n, sy, syy, k = row[2], row[3], row[4], row[5]
    np.testing.assert_allclose(k + sy / n, fin.mean(), rtol=1e-12)
    np.testing.assert_allclose(syy - sy * sy / n, ((fin - fin.mean()) ** 2).sum(), rtol=1e-9)
    assert abs(k - fin.mean()) < 4 * fin.std(), "K must lie near the data for the shifted sums to be well conditioned"


def test_graph_stats_of_edge_tensors() -> None:
    from layertap.server.compile.kernel import graph_stats

    row = graph_stats(torch.tensor(3.0)).numpy()  # a 0-d output
    assert row[2] == 1 and row[6] == row[7] == 3.0
    big = graph_stats(torch.full((4, 8), 1.5e308, dtype=torch.float64)).numpy()
    assert np.isfinite(big[5]) and big[3] == 0 and big[4] == 0 and big[6] == big[7] == 1.5e308
    alt = torch.tensor([1.7e308, -1.7e308] * 20, dtype=torch.float64)
    r = graph_stats(alt).numpy()
    assert np.isfinite(r[5]) and r[2] == 40
    none = graph_stats(torch.full((40,), float("nan"))).numpy()
    assert none[1] == 40 and none[2] == 0 and none[3] == 0 and none[4] == 0
    ints = graph_stats(torch.arange(100, dtype=torch.int32).reshape(10, 10)).numpy()
    assert ints[2] == 100 and ints[6] == 0 and ints[7] == 99
    np.testing.assert_allclose(ints[5] + ints[3] / 100, 49.5)
