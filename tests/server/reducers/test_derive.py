"""Derived tensors (``TapSpec.derive``): per-row softmax entropy and top-1 probability.

References are float64 numpy per row. Rows without a softmax (a NaN or +Inf
logit, or only -Inf ones) give NaN; a -Inf logit alone is a class of
probability 0.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from layertap.server.reducers.derive import derivation, derive, entropy, log_probs, top1_prob
from layertap.server.reducers.spec import SpecError
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit


def reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float64 entropy and top-1 probability of each row over the last axis."""
    z = x.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        shifted = z - z.max(-1, keepdims=True)
        p = np.exp(shifted) / np.exp(shifted).sum(-1, keepdims=True)
        plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    return -plogp.sum(-1), p.max(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_entropy_and_top1_equal_the_float64_reference_per_token(dtype: torch.dtype) -> None:
    x = torch.randn(2, 5, 17, generator=torch.Generator().manual_seed(0)).mul_(3).to(dtype)
    want_h, want_p = reference(x.double().numpy())  # the reference sees the very values the model had
    h, p = entropy(x), top1_prob(x)
    assert h.shape == p.shape == (2, 5)
    assert h.dtype == p.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    np.testing.assert_allclose(h.double().numpy(), want_h, rtol=tol, atol=tol)
    np.testing.assert_allclose(p.double().numpy(), want_p, rtol=tol, atol=tol)
    assert (h.numpy() > 0).all() and (h.numpy() < math.log(17)).all()


def test_nonfinite_rows_are_nan_and_masked_classes_count_zero() -> None:
    x = torch.randn(2, 5, 17, generator=torch.Generator().manual_seed(1))
    x[0, 0, 3] = math.nan           # no softmax: NaN
    x[0, 1, 4] = math.inf           # no softmax: NaN
    x[0, 2, :] = -math.inf          # every class masked: NaN
    x[1, 0, :8] = -math.inf         # 8 classes masked: the softmax of the other 9
    before = x.clone()
    h, p = entropy(x), top1_prob(x)
    assert torch.equal(torch.isnan(x), torch.isnan(before)) and torch.equal(x.nan_to_num(), before.nan_to_num())
    nan = torch.zeros(2, 5, dtype=torch.bool)
    nan[0, :3] = True
    assert torch.equal(torch.isnan(h), nan) and torch.equal(torch.isnan(p), nan)
    want_h, want_p = reference(x[1, 0, 8:].numpy())
    assert float(h[1, 0]) == pytest.approx(want_h, rel=1e-6) and float(p[1, 0]) == pytest.approx(want_p, rel=1e-6)
    rest = x.clone()
    rest[0, :3] = 0.0
    rh, rp = reference(rest.numpy())
    np.testing.assert_allclose(h[~nan].numpy(), rh[~nan.numpy()], rtol=1e-5)
    np.testing.assert_allclose(p[~nan].numpy(), rp[~nan.numpy()], rtol=1e-5)


def test_log_probs_is_the_logits_reducers_numerics() -> None:
    x = torch.tensor([[0.0, math.log(3.0)], [-math.inf, 1.0]], dtype=torch.float16)
    logp, valid = log_probs(x)
    assert logp.dtype == torch.float32 and valid.tolist() == [True, True]
    assert logp.exp()[0].tolist() == pytest.approx([0.25, 0.75], rel=1e-3)
    assert logp.exp()[1].tolist() == [0.0, 1.0]


def test_a_tensor_without_classes_or_not_floating_is_refused() -> None:
    fn = derivation(pb.DERIVE_ENTROPY, "spec.derive")
    assert fn is entropy and derivation(pb.DERIVE_TOP1_PROB, "spec.derive") is top1_prob
    assert derivation(pb.DERIVE_UNSPECIFIED, "spec.derive") is None
    with pytest.raises(ValueError, match="floating-point"):
        derive(fn, torch.arange(6).reshape(2, 3))
    with pytest.raises(ValueError, match="at least 2 classes"):
        derive(fn, torch.zeros(4, 1))
    with pytest.raises(ValueError, match="at least 2 classes"):
        derive(fn, torch.tensor(1.0))
    with pytest.raises(SpecError) as err:
        derivation(7, "spec.derive")
    assert err.value.field == "spec.derive" and "DERIVE_ENTROPY" in err.value.message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_derivations_never_sync_on_cuda() -> None:
    """The derivation runs in the tap's hook, on the model's step: no host sync, as the reducers."""
    x = torch.randn(4, 7, 33, generator=torch.Generator().manual_seed(2)).cuda()
    x[0, 0, 3] = float("-inf")
    want_h, want_p = reference(x.double().cpu().numpy())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        h, p = entropy(x), top1_prob(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    np.testing.assert_allclose(h.double().cpu().numpy(), want_h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(p.double().cpu().numpy(), want_p, rtol=1e-5, atol=1e-5)
