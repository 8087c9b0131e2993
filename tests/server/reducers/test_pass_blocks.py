"""A pass's batched statistics as one block, the transfer thread's linger, and when reuse is on.

Each of these takes work off a decode step (docs/benchmarks.md, session 16);
each test pins the behaviour that must not change with it.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Hashable

import numpy as np
import pytest
import torch
from torch import nn

from layertap.server.host.model_host import ModelHost
from layertap.server.host.sources import InputSpec, LoadedModel
from layertap.server.reducers.batched import PassBatch
from layertap.server.reducers.transfer import HostTransfer, PassBuffer
from layertap.server.stream.broker import Broker
from layertap.server.taps.engine import TRANSFER_LINGER, TapEngine
from layertap.server.taps.tap_files import reducer_spec
from layertap.v1 import telemetry_pb2 as pb

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


def test_batched_rows_equal_numpy_whatever_the_layout_of_the_hooked_tensor() -> None:
    """Copies keep the tensor's layout; its row is still the tensor in logical order."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 8, 16, generator=g)
    tensors = [base.permute(2, 0, 1), base.permute(2, 0, 1) * 2, torch.randn(16, 4, 8, generator=g)]
    batch = PassBatch()
    rows = [batch.defer(t) for t in tensors]
    assert all(r is not None for r in rows) and len({r.group for r in rows}) == 1
    for i, r in enumerate(rows):
        r.keys.append(i)
    got: dict[Hashable, np.ndarray] = {}

    def add_rows(keys: list[list[int]], block: torch.Tensor) -> None:
        for row, ks in zip(block, keys):
            for k in ks:
                got[k] = row.numpy()

    batch.finish(add_rows, lambda keys, exc: pytest.fail(f"{keys}: {exc}"))
    for i, t in enumerate(tensors):
        ref = t.double().numpy()
        zeros, nan, count, s1, s2, shift, lo, hi = got[i]
        assert (zeros, nan, count) == (0, 0, ref.size) and (lo, hi) == (ref.min(), ref.max())
        np.testing.assert_allclose(shift + s1 / count, ref.mean(), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(s2 / count - (s1 / count) ** 2, ref.var(), rtol=1e-9)


def settle(transfer: HostTransfer) -> None:
    """Wait until the thread is back in its poll (a pass queued while it ends a batch is taken at once)."""
    assert transfer.flush(5)
    time.sleep(0.2)


def test_a_stream_of_passes_gathers_and_a_flush_a_backlog_or_a_quiet_spell_wakes_the_thread() -> None:
    seen: list[float] = []
    handled = threading.Event()

    def callback(values: dict[Hashable, np.ndarray]) -> None:
        seen.append(float(values["a"][0]))
        handled.set()

    def one(v: float) -> object:
        buf = PassBuffer()
        buf.add("a", torch.tensor([v], dtype=F64))
        return buf.finish()

    with HostTransfer(maxsize=8, linger=30.0) as transfer:
        transfer.submit(one(1.0), callback)
        assert handled.wait(5) and seen == [1.0]  # the first pass after a quiet spell goes at once
        settle(transfer)
        handled.clear()
        for v in (2.0, 3.0):
            transfer.submit(one(v), callback)
        assert not handled.wait(0.3) and transfer.pending() == 2  # a stream gathers, not one wake per pass
        assert transfer.flush(5) and seen == [1.0, 2.0, 3.0]  # a flush handles them at once, in order
        settle(transfer)
        handled.clear()
        for v in (4.0, 5.0, 6.0):
            transfer.submit(one(v), callback)
        assert not handled.wait(0.3)
        transfer.submit(one(7.0), callback)  # the fourth reaches half of maxsize: the thread wakes
        assert handled.wait(5)
        assert transfer.flush(5) and seen == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0] and transfer.dropped == 0
    with HostTransfer(maxsize=8, linger=0.05) as polled:
        polled.submit(one(8.0), callback)
        assert polled.flush(5)
        handled.clear()
        polled.submit(one(9.0), callback)  # within the linger of the last: the next poll takes it
        assert handled.wait(5) and seen[-1] == 9.0 and polled.pending() == 0


def rig(module: nn.Module) -> tuple[ModelHost, Broker, TapEngine]:
    host = ModelHost(LoadedModel(module.eval(), "m", "test", [InputSpec("input", torch.float32, (-1, 8))]))
    broker = Broker(default_queue_size=10_000)
    return host, broker, TapEngine(host, broker, rng=random.Random(0))


def test_reuse_is_on_only_while_two_firings_can_share_a_tensor() -> None:
    host, _broker, engine = rig(nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 8))))
    spec = pb.TapSpec(selector="0", reducers=[reducer_spec("moments", "r")])
    assert engine.transfer.linger == TRANSFER_LINGER > 0
    one = engine.create(spec)
    assert not engine._reuse_on  # one tap, one layer: nothing to share
    two = engine.create(spec)
    assert engine._reuse_on  # the same layer twice
    engine.delete(two.id)
    assert not engine._reuse_on
    parent = engine.create(pb.TapSpec(selector="1", reducers=[reducer_spec("moments", "r")]))
    assert not engine._reuse_on  # "1" returns its last child's output, but that child is not hooked
    child = engine.create(pb.TapSpec(selector="1.1", reducers=[reducer_spec("moments", "r")]))
    assert engine._reuse_on
    for tap in (one, parent, child):
        engine.delete(tap.id)
    assert not engine._reuse_on
    engine.close()
