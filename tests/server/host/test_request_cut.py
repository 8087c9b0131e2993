"""A request's cut of a pass's tensors: its own rows (less shared padding), the tensor itself when it owns them all."""

from __future__ import annotations

import pytest
import torch

from layertap.server.host.model_host import PHASE_DECODE, PHASE_PREFILL, PassContext, RequestRows
from layertap.server.host.rows import RequestCut

pytestmark = pytest.mark.unit


def test_a_request_alone_in_a_decode_step_sees_each_tensor_itself() -> None:
    rows = RequestRows("a", slice(0, 2), (7, 7))
    cut = RequestCut(PassContext(index=0, phase=PHASE_DECODE, requests=(rows,), tokens=1), rows)
    for t in (torch.randn(2, 1, 8), torch.randn(2, 8), torch.randn(()), torch.randn(5, 3)):
        assert cut(t) is t  # no view op per firing: every row is its own


def test_a_request_sharing_the_pass_or_its_padding_is_cut() -> None:
    a, b = RequestRows("a", slice(0, 1), (5,)), RequestRows("b", slice(1, 3), (3, 3), 2)
    ctx = PassContext(index=0, phase=PHASE_PREFILL, requests=(a, b), tokens=5)
    t = torch.arange(3 * 5 * 2.0).reshape(3, 5, 2)
    assert torch.equal(RequestCut(ctx, a)(t), t[0:1])
    assert torch.equal(RequestCut(ctx, b)(t), t[1:3, 2:])
    assert torch.equal(RequestCut(ctx, b)(t.reshape(15, 2)), t[1:3, 2:].reshape(-1, 2))
    assert RequestCut(ctx, b)(torch.randn(4, 2)) is None  # rows it cannot tell apart
    alone = RequestRows("c", slice(0, 2), (4, 4), 1)
    padded = RequestCut(PassContext(index=1, phase=PHASE_PREFILL, requests=(alone,), tokens=4), alone)
    x = torch.randn(2, 4, 3)
    assert torch.equal(padded(x), x[:, 1:])  # its own rows, but a padding column to leave out
