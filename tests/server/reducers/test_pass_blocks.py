"""A pass's batched statistics as one block, copies in the hooked tensor's layout, and when reuse is on.

Each of these takes work off a decode step (docs/benchmarks.md, session 16);
each test pins the behaviour that must not change with it.
"""

from __future__ import annotations

import random
from collections.abc import Hashable

import numpy as np
import pytest
import torch
from torch import nn

from layertap.server.host.model_host import ModelHost
from layertap.server.host.sources import InputSpec, LoadedModel
from layertap.server.reducers.batched import PassBatch
from layertap.server.reducers.transfer import PassBuffer
from layertap.server.stream.broker import Broker
from layertap.server.taps.engine import TapEngine
from layertap.server.taps.tap_files import reducer_spec
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit

F64 = torch.float64


def test_a_block_gives_each_key_of_each_row_its_slice() -> None:
    buf = PassBuffer()
    buf.add("before", torch.tensor([9.0], dtype=F64))
    block = torch.arange(6, dtype=F64).reshape(3, 2)
    buf.add_rows([[1, 7], [], [2]], block)  # a row read by two pieces; a row no piece reads
    buf.add("after", torch.tensor([8.0, 8.5], dtype=F64))
    assert len(buf) == 5
    by_key = buf.finish().values_by_key()
    np.testing.assert_array_equal(by_key["before"], [9.0])
    np.testing.assert_array_equal(by_key[1], [0.0, 1.0])
    np.testing.assert_array_equal(by_key[7], [0.0, 1.0])
    np.testing.assert_array_equal(by_key[2], [4.0, 5.0])
    np.testing.assert_array_equal(by_key["after"], [8.0, 8.5])
    # Alone in its pass, a block is read without a concatenation and still split by row.
    only = PassBuffer()
    only.add_rows([["a"], ["b"]], block[:2])
    np.testing.assert_array_equal(only.finish().values_by_key()["b"], [2.0, 3.0])


def test_a_block_is_refused_with_a_repeated_key_or_the_wrong_form() -> None:
    buf = PassBuffer()
    buf.add("a", torch.zeros(2, dtype=F64))
    with pytest.raises(ValueError, match="already added"):
        buf.add_rows([["a"]], torch.zeros(1, 2, dtype=F64))
    with pytest.raises(ValueError, match="already added"):
        buf.add_rows([["b"], ["b"]], torch.zeros(2, 2, dtype=F64))
    with pytest.raises(ValueError, match="2-D float64 tensor of 2 rows"):
        buf.add_rows([["c"], ["d"]], torch.zeros(3, 2, dtype=F64))
    with pytest.raises(ValueError, match="2-D float64"):
        buf.add_rows([["c"]], torch.zeros(1, 2, dtype=torch.float32))
    assert len(buf) == 1  # nothing of a refused block stays


def batched(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """Each tensor's row of one PassBatch (seed 0), through ``finish``'s block."""
    batch = PassBatch(seed=0)
    rows = [batch.defer(t) for t in tensors]
    assert all(r is not None for r in rows)
    for i, r in enumerate(rows):
        r.keys.append(i)
    got: dict[Hashable, np.ndarray] = {}

    def add_rows(keys: list[list[int]], block: torch.Tensor) -> None:
        for row, ks in zip(block, keys):
            for k in ks:
                got[k] = row.numpy().copy()

    batch.finish(add_rows, lambda keys, exc: pytest.fail(f"{keys}: {exc}"))
    return [got[i] for i in range(len(tensors))]


def test_batched_rows_read_each_tensor_in_logical_order_whatever_its_layout() -> None:
    """Copies keep the hooked tensor's layout; its row is still the tensor in logical order.

    The shift K is the median of strided and random positions of the row, and
    the shifted sums round by order: a row laid out in memory order would give
    another vector than the contiguous tensor's, not just other rounding.
    """
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 8, 16, generator=g) + 3.0
    permuted = [base.permute(2, 0, 1), (base * 2).permute(2, 0, 1), torch.randn(16, 4, 8, generator=g)]
    dense = [t.contiguous() for t in permuted]
    assert not permuted[0].is_contiguous()
    for a, b, t in zip(batched(permuted), batched(dense), dense):
        np.testing.assert_array_equal(a, b)
        ref = t.double().numpy()
        zeros, nan, count, s1, s2, shift, lo, hi = a
        assert (zeros, nan, count) == (0, 0, ref.size) and (lo, hi) == (ref.min(), ref.max())
        np.testing.assert_allclose(shift + s1 / count, ref.mean(), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(s2 / count - (s1 / count) ** 2, ref.var(), rtol=1e-9)


def rig(module: nn.Module) -> tuple[ModelHost, Broker, TapEngine]:
    host = ModelHost(LoadedModel(module.eval(), "m", "test", [InputSpec("input", torch.float32, (-1, 8))]))
    broker = Broker(default_queue_size=10_000)
    return host, broker, TapEngine(host, broker, rng=random.Random(0))


def test_reuse_is_on_only_while_two_firings_can_share_a_tensor() -> None:
    host, _broker, engine = rig(nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 8))))
    spec = pb.TapSpec(selector="0", reducers=[reducer_spec("moments", "r")])
    one = engine.create(spec)
    assert not engine.plans.reuse_on  # one tap, one layer: nothing to share
    two = engine.create(spec)
    assert engine.plans.reuse_on  # the same layer twice
    engine.delete(two.id)
    assert not engine.plans.reuse_on
    parent = engine.create(pb.TapSpec(selector="1", reducers=[reducer_spec("moments", "r")]))
    assert not engine.plans.reuse_on  # "1" returns its last child's output, but that child is not hooked
    child = engine.create(pb.TapSpec(selector="1.1", reducers=[reducer_spec("moments", "r")]))
    assert engine.plans.reuse_on
    for tap in (one, parent, child):
        engine.delete(tap.id)
    assert not engine.plans.reuse_on
    engine.close()
