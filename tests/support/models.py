"""Small models for tests, importable as ``support.models:<factory>``.

Tests put this folder on ``PYTHONPATH`` for subprocess servers, so these are
real ``package.module:factory`` references.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from layertap.server.host.sources import LoadedModel


class Identity(nn.Module):
    """Returns its input through a named child, for big-tensor captures."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def identity() -> nn.Module:
    return Identity()


class PairHead(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x.sum(dim=1)


class DictHead(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"pos": torch.relu(x), "neg": torch.relu(-x)}


class Mixer(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


class Containers(nn.Module):
    """Tuple and dict outputs, and a two-argument module."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.pair = PairHead()
        self.dict = DictHead()
        self.mix = Mixer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        a, _s = self.pair(h)
        d = self.dict(h)
        return self.mix(a, d["pos"])


def containers() -> nn.Module:
    torch.manual_seed(0)
    return Containers()


class Perturbable(nn.Module):
    """Three stages; ``layer3`` can be scaled at run time to force drift."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer1 = nn.Linear(16, 16)
        self.layer2 = nn.Linear(16, 16)
        self.layer3 = nn.Linear(16, 16)
        self.layer4 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer4(torch.relu(self.layer3(torch.relu(self.layer2(torch.relu(self.layer1(x)))))))

    @torch.no_grad()
    def perturb_layer3(self, scale: float = 3.0, shift: float = 1.0) -> None:
        """Scale ``layer3``'s weights and shift its bias in place.

        ``layer3`` and everything after it drift; ``layer1`` and ``layer2`` do
        not. Hold the host's ``pass_lock()`` so no pass sees half an update.
        """
        self.layer3.weight.mul_(scale)
        self.layer3.bias.add_(shift)


#: Input signature of :class:`Perturbable` (batch free).
PERTURBABLE_INPUT_SHAPE: tuple[int, ...] = (-1, 16)


def perturbable() -> nn.Module:
    """``support.models:perturbable`` for ``layertap serve --input-shape -1,16``."""
    return Perturbable()


def perturbable_loaded(name: str = "perturbable") -> LoadedModel:
    """A ``LoadedModel`` of a fresh :class:`Perturbable` for in-process servers."""
    from layertap.server.host.sources import InputSpec, LoadedModel

    return LoadedModel(Perturbable(), name, "factory", [InputSpec("input", torch.float32, PERTURBABLE_INPUT_SHAPE)])


class RowSum(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(dim=1)


class Pooled(nn.Module):
    """``lin`` has (batch, 16) outputs, ``total`` one value per row: no channels to score."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(16, 16)
        self.total = RowSum()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.total(self.lin(x))


def pooled_loaded(name: str = "pooled") -> LoadedModel:
    """A ``LoadedModel`` of :class:`Pooled`, input ``(-1, 16)``."""
    from layertap.server.host.sources import InputSpec, LoadedModel

    return LoadedModel(Pooled(), name, "factory", [InputSpec("input", torch.float32, PERTURBABLE_INPUT_SHAPE)])


def layer_outputs(x: np.ndarray, names: list[str]) -> dict[str, np.ndarray]:
    """Float64 outputs of the named layers of the demo model (seed 0) for ``x``: the reference."""
    from layertap.server.host.demo_model import build_demo_model

    model = build_demo_model(0)
    got: dict[str, np.ndarray] = {}
    hs = [model.get_submodule(n).register_forward_hook(
        lambda _m, _a, o, _n=n: got.__setitem__(_n, o.detach().double().numpy().copy())) for n in names]
    with torch.inference_mode():
        model(torch.from_numpy(x))
    for h in hs:
        h.remove()
    return got


class Two(nn.Module):
    """Two 8-wide Linears around a tanh: the compiled-serving tests' smallest tapped model."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def two_loaded() -> LoadedModel:
    """A ``LoadedModel`` of a fresh :class:`Two` in eval mode, input ``(-1, 8)``."""
    from layertap.server.host.sources import InputSpec, LoadedModel

    return LoadedModel(Two().eval(), "two", "factory", [InputSpec("x", torch.float32, (-1, 8))])
