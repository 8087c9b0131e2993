"""Training helpers for agent tests: an in-place-ReLU model, synthetic batches, a loop."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn


class InplaceNet(nn.Module):
    """Conv -> BN -> ReLU(inplace) twice: the in-place ops write the outputs that
    full backward hooks on ``conv1``/``bn1``/``conv2`` would have wrapped."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.relu2 = nn.ReLU(inplace=True)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.relu2(self.conv2(x))
        return self.fc(torch.flatten(x, 1))


def inplace_net(seed: int = 0) -> InplaceNet:
    torch.manual_seed(seed)
    return InplaceNet()


def batches(seed: int = 0, size: int = 4, shape: tuple[int, ...] = (3, 8, 8)) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless synthetic (x, label) batches, reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randn(size, *shape, generator=gen), torch.randint(0, 10, (size,), generator=gen)


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, data: Iterator[tuple[torch.Tensor, torch.Tensor]],
                steps: int, *, micro: int = 1, on_grads: Callable[[int], None] | None = None) -> list[float]:
    """Run ``steps`` optimizer steps of ``micro`` micro-batches each; returns the
    float64 total gradient norm of each step, taken just before ``opt.step()``."""
    norms = []
    for i in range(steps):
        opt.zero_grad()
        for _ in range(micro):
            x, y = next(data)
            nn.functional.cross_entropy(model(x), y).backward()
        grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        if on_grads is not None:
            on_grads(i)
        opt.step()
    return norms


def free_port_pair() -> int:
    """A base port whose next port is free too (racy, as any free-port pick)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            base = a.getsockname()[1] - 1  # the port above it was free: is this one? (it went unchecked)
        try:
            with socket.socket() as b:
                b.bind(("127.0.0.1", base))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def free_port() -> int:
    """A port free right now on loopback (racy, as any free-port pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, master: int, tests_dir: Path, **extra: str) -> dict[str, str]:
    """The environment torchrun would give rank ``rank`` of 2 on one CPU host, plus ``extra``."""
    return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master), "OMP_NUM_THREADS": "1", **extra,
            "PYTHONPATH": os.pathsep.join([str(tests_dir), os.environ.get("PYTHONPATH", "")])}
