"""A pass's model inputs: positional tensors first, then keyword tensors.

A request's tensors bind to the model's declared inputs (``InputSpec``, one
per ``forward`` parameter the metadata lists): an unnamed tensor is
positional and takes the next declared input in order; a named tensor takes
the declared input of its name and reaches ``forward`` as that keyword
argument (so does an unnamed one bound to an input declared ``keyword``).
Unnamed tensors come first. Every required input must be bound, none twice,
so a missing or unexpected name is the caller's error, and the message names
it and the expected list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from layertap.server.errors import InvalidField
from layertap.server.host.sources import InputSpec


@dataclass(frozen=True)
class ModelInputs:
    """What one forward pass is called with: ``module(*args, **kwargs)``."""

    args: tuple[torch.Tensor, ...] = ()
    kwargs: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def positional(cls, tensors: Sequence[torch.Tensor]) -> ModelInputs:
        return cls(tuple(tensors))

    def named(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor with its name: ``""`` for a positional one, else its keyword."""
        for t in self.args:
            yield "", t
        yield from self.kwargs.items()

    def tensors(self) -> list[torch.Tensor]:
        return [*self.args, *self.kwargs.values()]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def __len__(self) -> int:
        return len(self.args) + len(self.kwargs)

    def map(self, fn: Callable[[torch.Tensor, int], torch.Tensor]) -> ModelInputs:
        """Apply ``fn(tensor, i)`` to each tensor; ``i`` counts positional then keyword inputs."""
        n = len(self.args)
        return ModelInputs(tuple(fn(t, i) for i, t in enumerate(self.args)),
                           {k: fn(t, n + i) for i, (k, t) in enumerate(self.kwargs.items())})

    def call(self, module: Callable[..., object]) -> object:
        return module(*self.args, **self.kwargs)


def _expected(specs: Sequence[InputSpec]) -> str:
    return "[" + ", ".join(s.name for s in specs) + "]"


def bind_inputs(tensors: Sequence[tuple[str, torch.Tensor]], specs: Sequence[InputSpec],
                field_name: str = "inputs") -> tuple[ModelInputs, list[InputSpec]]:
    """Bind ``(name, tensor)`` pairs to the declared inputs.

    Returns:
        The model inputs, and the declared spec of each tensor in the order of
        :meth:`ModelInputs.tensors`.

    Raises:
        InvalidField: A named tensor after an unnamed one, more unnamed
            tensors than declared inputs, an unknown or repeated name, or a
            declared input left unbound.
    """
    by_name = {s.name: s for s in specs}
    args: list[torch.Tensor] = []
    kwargs: dict[str, torch.Tensor] = {}
    bound: list[InputSpec] = []
    named_seen = False
    for i, (name, t) in enumerate(tensors):
        where = f"{field_name}[{i}]"
        if not name:
            if named_seen:
                raise InvalidField(f"{where}.name", "unnamed (positional) inputs come before named ones")
            if len(args) + len(kwargs) >= len(specs):
                raise InvalidField(field_name, f"expected {len(specs)} input tensor(s) {_expected(specs)}, "
                                               f"got {len(tensors)}")
            declared = specs[len(args) + len(kwargs)]
            if declared.keyword:
                kwargs[declared.name] = t
            else:
                args.append(t)
            bound.append(declared)
            continue
        named_seen = True
        spec = by_name.get(name)
        if spec is None:
            raise InvalidField(f"{where}.name", f"unexpected input {name!r}; the model's inputs are {_expected(specs)}")
        if name in kwargs or any(s.name == name for s in specs[:len(args)]):
            raise InvalidField(f"{where}.name", f"input {name!r} is given twice (positionally or by name)")
        kwargs[name] = t
        bound.append(spec)
    done = {s.name for s in bound}
    missing = [s.name for s in specs if s.required and s.name not in done]
    if missing:
        raise InvalidField(field_name, f"missing input(s) {', '.join(repr(m) for m in missing)}; "
                                       f"the model's inputs are {_expected(specs)}")
    return ModelInputs(tuple(args), kwargs), bound


def as_positional(inputs: ModelInputs, specs: Sequence[InputSpec]) -> ModelInputs:
    """All inputs positional, in declared order: for a model whose ``forward`` takes no keywords."""
    if not inputs.kwargs:
        return inputs
    rest = [inputs.kwargs[s.name] for s in specs[len(inputs.args):]]
    return ModelInputs((*inputs.args, *rest))
