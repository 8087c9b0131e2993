"""The ``logits`` reducer against a float64 numpy reference on local tensors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from support.sync_guard import NoSyncMode

from layertap.server.reducers.plan import ReducerPlan, build_reducers
from layertap.server.reducers.spec import SpecError
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit

SPEC = pb.ReducerSpec(kind=pb.REDUCER_KIND_LOGITS)


def run(x: torch.Tensor) -> pb.Logits:
    plan = ReducerPlan(build_reducers([SPEC]))
    with NoSyncMode(sample_op_limit=0):  # no sync, and no sort or top-k of the whole tensor either
        out = plan.run(x)
    assert out.shape == (plan.width(x.shape),) and out.dtype == torch.float64
    (res,) = plan.decode(out.numpy(), x.shape)
    return res.logits


def reference(x: np.ndarray) -> dict[str, float]:
    """Per row in float64, rows with a NaN/+Inf logit or only -Inf ones left out; then mean and worst."""
    rows = x.astype(np.float64).reshape(-1, x.shape[-1])
    keep = ~np.isnan(rows).any(1) & ~np.isposinf(rows).any(1) & np.isfinite(rows).any(1)
    rows = rows[keep]
    top = rows.max(1, keepdims=True)
    e = np.exp(rows - top)
    p = e / e.sum(1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.where(p > 0, p * np.log(p), 0.0).sum(1)
    s = np.sort(p, 1)
    p1 = s[:, -1]
    margin = p1 - s[:, -2] if rows.shape[1] > 1 else p1
    return {"rows": len(rows), "entropy_mean": entropy.mean(), "entropy_max": entropy.max(),
            "top1_mean": p1.mean(), "top1_min": p1.min(), "margin_mean": margin.mean(), "margin_min": margin.min()}


def check(got: pb.Logits, x: np.ndarray, atol: float) -> None:
    ref = reference(x)
    assert got.rows == ref.pop("rows") and got.classes == x.shape[-1]
    for name, want in ref.items():
        assert getattr(got, name) == pytest.approx(want, abs=atol), name


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("shape", [(2, 7, 50), (5, 3), (4, 1, 1000), (3, 2, 4, 9)])
def test_matches_float64_numpy(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, generator=gen()) * 4
    check(run(x), x.numpy(), atol=1e-5)


def test_float64_input_stays_float64() -> None:
    x = torch.randn(6, 30, generator=gen(1), dtype=torch.float64) * 10
    check(run(x), x.numpy(), atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_input_is_computed_in_float32(dtype: torch.dtype) -> None:
    # A 4096-way vocabulary: in bf16, softmax's small probabilities (and their
    # entropy) would be lost; in float32 the reference is met on the same values.
    x = (torch.randn(2, 3, 4096, generator=gen(2)) * 3).to(dtype)
    check(run(x), x.float().numpy(), atol=2e-5)


def test_masked_classes_and_bad_rows() -> None:
    x = torch.randn(4, 6, 10, generator=gen(3)) * 2
    x[0, 0, :5] = -math.inf  # masked classes: probability 0, no NaN
    x[1, 1, 2] = math.nan  # left out
    x[2, 2, 7] = math.inf  # left out
    x[3, 3, :] = -math.inf  # nothing allowed: left out
    got = run(x)
    assert got.rows == 24 - 3
    check(got, x.numpy(), atol=1e-5)


def test_ties_single_class_and_certainty() -> None:
    tie = torch.tensor([[2.0, 2.0, -1.0], [0.0, 0.0, 0.0]])
    got = run(tie)
    assert got.margin_min == 0.0 and got.entropy_max == pytest.approx(math.log(3), abs=1e-6)
    one = run(torch.randn(5, 1, generator=gen(4)))
    assert (one.rows, one.classes, one.top1_min, one.margin_min, one.entropy_max) == (5, 1, 1.0, 1.0, 0.0)
    sure = run(torch.tensor([[100.0, 0.0, 0.0]]))
    assert sure.top1_min == 1.0 and sure.entropy_max == pytest.approx(0.0, abs=1e-30)


def test_no_rows_gives_nan() -> None:
    for x in (torch.empty(0, 8), torch.full((2, 3), math.nan), torch.empty(3, 0)):
        got = run(x)
        assert got.rows == 0
        assert all(math.isnan(getattr(got, f)) for f in ("entropy_mean", "top1_min", "margin_mean"))


def test_integer_logits_and_the_tensor_is_left_alone() -> None:
    x = torch.randint(-5, 5, (3, 4, 12), generator=gen(5))
    check(run(x), x.numpy(), atol=1e-5)
    f = torch.randn(3, 8, generator=gen(6))
    f[0, 0] = -math.inf
    before = f.clone()
    run(f)
    torch.testing.assert_close(f, before, equal_nan=True)


def test_a_scalar_is_a_spec_error() -> None:
    plan = ReducerPlan(build_reducers([SPEC], "tap.reducers"))
    with pytest.raises(SpecError) as err:
        plan.run(torch.tensor(1.0))
    assert err.value.field == "tap.reducers[0].kind"
