"""``layertap::tap_stats`` against float64 numpy: dtypes, layouts, non-finite values, masks, bad arguments."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from layertap.server.reducers.op import IDENTITY, MAX_ATEN_OPS, new_rows, reset_rows, tap_stats
from layertap.server.reducers.op.reference import reference_stats, sample_positions

pytestmark = pytest.mark.unit

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def expected(x: torch.Tensor, mask: torch.Tensor | None = None) -> np.ndarray:
    """The row in float64 numpy, from x's logical values (K by the same sampling rule, computed here)."""
    v = x.detach().double().numpy().reshape(-1)  # logical order, whatever the strides
    keep = np.ones(v.shape, bool)
    if mask is not None:
        keep = np.broadcast_to(mask.numpy().astype(bool).reshape(*mask.shape, *([1] * (x.dim() - mask.dim()))),
                               x.shape).reshape(-1)
    sample = [v[i] for i in sample_positions(v.size) if keep[i] and np.isfinite(v[i])]
    k = sorted(sample)[(len(sample) - 1) // 2] if sample else 0.0
    fin = np.isfinite(v) & keep
    y = v[fin] - k
    return np.array([((v == 0) & keep).sum(), (np.isnan(v) & keep).sum(), fin.sum(), y.sum(), (y * y).sum(), k,
                     v[fin].min() if fin.any() else math.inf, v[fin].max() if fin.any() else -math.inf])


def check(row: np.ndarray, want: np.ndarray) -> None:
    assert row[[0, 1, 2, 5, 6, 7]].tolist() == want[[0, 1, 2, 5, 6, 7]].tolist()  # counts, K, min, max: exact
    scale = max(1.0, want[4])
    np.testing.assert_allclose(row[3], want[3], rtol=1e-9, atol=1e-9 * math.sqrt(scale * max(want[2], 1)))
    np.testing.assert_allclose(row[4], want[4], rtol=1e-9, atol=1e-12)


def run(x: torch.Tensor, mask: torch.Tensor | None = None, row: int = 1) -> np.ndarray:
    out = new_rows(3, "cpu")
    tap_stats(x, out, torch.tensor([row]), torch.ones(1, dtype=torch.int32), mask)
    others = np.delete(out.numpy(), row, axis=0)
    assert (others == np.array(IDENTITY)).all()  # only its row is written
    return out[row].numpy()


def layouts(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(4, 6, 5, 7, generator=g) * 3 + 1).to(dtype)
    return {
        "contiguous": base,
        "channels_last": base.contiguous(memory_format=torch.channels_last),
        "transposed": base.transpose(1, 3),
        "sliced": base[1:3, ::2, :, 2:],
        "expanded": base[0, 0, :, :1].expand(5, 9),
        "overlapping": base.reshape(-1)[: 40].as_strided((6, 8), (5, 1)),
        "0-d": base[0, 0, 0, 0],
        "empty": base[:0],
        "row": base.reshape(-1)[:1024 - 7].reshape(1, -1),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(layouts(torch.float32)))
def test_the_op_matches_float64_numpy(dtype: torch.dtype, layout: str) -> None:
    x = layouts(dtype)[layout]
    check(run(x), expected(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_finite_values_are_counted_and_left_out(dtype: torch.dtype) -> None:
    x = torch.tensor([[0.0, -0.0, math.nan, math.inf], [-math.inf, 2.5, -1.0, 0.0]], dtype=dtype)
    row = run(x)
    check(row, expected(x))
    assert row[:3].tolist() == [3, 1, 5] and (row[6], row[7]) == (-1.0, 2.5)
    for fill in (math.nan, math.inf):
        row = run(torch.full((3, 5), fill, dtype=dtype))
        check(row, expected(torch.full((3, 5), fill, dtype=dtype)))
        assert row[2] == 0 and row[6] > row[7]  # no finite element: min > max, decoded as NaN


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_mask_leaves_out_whole_positions(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 8, generator=g).to(dtype).transpose(0, 1)  # (5, 3, 8), not contiguous
    x[0, 0, 0] = math.nan
    for mask in (torch.tensor([1, 0, 1, 1, 0], dtype=torch.bool),
                 torch.tensor([[1, 0, 1]] * 4 + [[0, 0, 0]], dtype=torch.uint8),
                 torch.zeros(5, 3, 8, dtype=torch.bool)):
        check(run(x, mask), expected(x, mask))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_large_tensor_read_in_chunks_on_several_threads_matches_numpy(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    base = (torch.randn(700, 500, generator=g) * 2 - 3).to(dtype)
    base[5, 7], base[600, 1], base[100, 100] = math.nan, math.inf, 0.0
    assert torch.get_num_threads() > 1 or pytest.skip("one intra-op thread: no chunks")
    for x, mask in ((base, None), (base.t(), None), (base, torch.arange(700) % 3 != 0)):  # contiguous, strided, masked
        check(run(x, mask), expected(x, mask))


def test_flag_two_counts_zeros_nan_and_finite_values_only() -> None:
    x = torch.tensor([[0.0, math.nan, 1.5], [math.inf, -2.0, 0.0]])
    out = new_rows(2, "cpu")
    tap_stats(x, out, torch.tensor([0]), torch.full((1,), 2, dtype=torch.int32))
    reference_stats(x, out, torch.tensor([1]), torch.full((1,), 2, dtype=torch.int32), None)
    for row in out.tolist():  # the C++ kernel and the aten body alike
        assert row == [2, 1, 4, 0, 0, 0, math.inf, -math.inf]  # what nonfinite reads, and nothing else


def test_a_zero_flag_writes_nothing_and_rows_merge_then_reset() -> None:
    x = torch.randn(50, dtype=torch.float64)
    out = new_rows(2, "cpu")
    tap_stats(x, out, torch.tensor([0]), torch.zeros(1, dtype=torch.int32))
    assert (out.numpy() == np.array(IDENTITY)).all()
    tap_stats(x, out, torch.tensor([0]), torch.ones(1, dtype=torch.int32))
    tap_stats(x[:10], out, torch.tensor([0]), torch.ones(1, dtype=torch.int32))  # a merge: counts add
    assert out[0, 2].item() == 60
    reset_rows(out)
    assert (out.numpy() == np.array(IDENTITY)).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_aten_fallback_gives_the_same_row_in_a_bounded_number_of_ops(dtype: torch.dtype) -> None:
    for x in layouts(dtype).values():
        for mask in (None, torch.ones(x.shape[:1], dtype=torch.bool)) if x.dim() else (None,):
            out = new_rows(2, "cpu")
            ops: list[str] = []

            class Count(TorchDispatchMode):
                def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                    ops.append(str(func))
                    return func(*args, **(kwargs or {}))

            with Count():
                reference_stats(x, out, torch.tensor([1]), torch.ones(1, dtype=torch.int32), mask)
            assert 0 < len(ops) <= MAX_ATEN_OPS
            check(out[1].numpy(), expected(x, mask))


def test_a_call_is_one_op_and_nothing_behind_it() -> None:
    x = torch.randn(1, 1024)
    out, row, flag = new_rows(1, "cpu"), torch.tensor([0]), torch.ones(1, dtype=torch.int32)
    tap_stats(x, out, row, flag)  # built and loaded before the count
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        tap_stats(x, out, row, flag)
    names = [e.name for e in prof.events()]
    assert names.count("layertap::tap_stats") == 1
    assert [n for n in names if n.startswith("aten::")] == []  # the C kernel: no aten op inside


@pytest.mark.parametrize(("args", "named"), [
    (lambda x: (x.to(torch.int32), new_rows(1, "cpu"), torch.tensor([0]), torch.ones(1, dtype=torch.int32)), "x"),
    (lambda x: (x, new_rows(1, "cpu").float(), torch.tensor([0]), torch.ones(1, dtype=torch.int32)), "out"),
    (lambda x: (x, new_rows(2, "cpu").t(), torch.tensor([0]), torch.ones(1, dtype=torch.int32)), "out"),
    (lambda x: (x, new_rows(1, "cpu"), torch.tensor([0], dtype=torch.int32), torch.ones(1, dtype=torch.int32)), "row"),
    (lambda x: (x, new_rows(1, "cpu"), torch.tensor([3]), torch.ones(1, dtype=torch.int32)), "row"),
    (lambda x: (x, new_rows(1, "cpu"), torch.tensor([0]), torch.ones(2, dtype=torch.int32)), "flag"),
    (lambda x: (x, new_rows(1, "cpu"), torch.tensor([0]), torch.ones(1, dtype=torch.int32),
                torch.ones(5, dtype=torch.bool)), "mask"),
    (lambda x: (x, new_rows(1, "meta"), torch.tensor([0]), torch.ones(1, dtype=torch.int32)), "device"),
], ids=["x-dtype", "out-dtype", "out-layout", "row-dtype", "row-range", "flag-size", "mask-shape", "devices"])
def test_bad_arguments_are_refused_naming_them(args, named: str) -> None:
    out_args = args(torch.randn(4, 3))
    before = out_args[1].clone() if out_args[1].device.type == "cpu" else None
    with pytest.raises(ValueError, match=named if named != "device" else "one device"):
        tap_stats(*out_args)
    if before is not None:
        assert torch.equal(out_args[1], before)  # nothing written


def test_the_op_is_one_node_of_a_fullgraph_compile_and_matches_eager() -> None:
    class Tapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)
            self.register_buffer("rows", new_rows(1, "cpu"))
            self.register_buffer("row", torch.tensor([0]))
            self.register_buffer("flag", torch.ones(1, dtype=torch.int32))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            torch.ops.layertap.tap_stats(h, self.rows, self.row, self.flag)
            return h.relu()

    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model = Tapped()
    x = torch.randn(4, 16)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        got = compiled(x)
        h = model.lin(x)
    assert counter.frame_count == 1 and len(counter.graphs) == 1
    assert [n for n in counter.graphs[0].graph.nodes
            if n.target in (torch.ops.layertap.tap_stats, torch.ops.layertap.tap_stats.default)]
    torch.testing.assert_close(got, h.relu())
    check(model.rows[0].numpy(), expected(h))
    model.flag.zero_()  # the tap off: a buffer's value, no recompile
    reset_rows(model.rows)
    with torch.no_grad():
        compiled(x)
    assert counter.frame_count == 1 and (model.rows[0].numpy() == np.array(IDENTITY)).all()
