"""Which layer to suggest to a new user: the model's last block-level module.

``serve`` prints a capture command to try, and ``serve --smoke`` captures a
layer; both must name a module the served model really has and runs. A block
(a module with children of its own, such as ResNet's ``layer4`` or a
transformer's ``encoder.layers.1``) is what users tap first; its output is the
model's last features before the head.
"""

from __future__ import annotations

from collections.abc import Collection

from torch import nn

__all__ = ["suggest_layer"]

#: Containers that are never called themselves, so their hooks never fire.
_UNCALLED = (nn.ModuleList, nn.ModuleDict)


def _callable_children(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    """Children in definition order, looking through ModuleList/ModuleDict."""
    out: list[tuple[str, nn.Module]] = []
    for name, child in module.named_children():
        qualified = f"{prefix}{name}"
        if isinstance(child, _UNCALLED):
            out += _callable_children(child, qualified + ".")
        else:
            out.append((qualified, child))
    return out


def suggest_layer(model: nn.Module, ran: Collection[str] = ()) -> str | None:
    """The qualified name of the model's last block-level module.

    Walks down from the root while a level holds a single block (a wrapper
    such as ``encoder``), then takes that level's last block. A model with no
    block at all gives its last module.

    Args:
        model: The served module.
        ran: Names of the modules seen running (from the warm-up pass); when
            given, modules that never ran are passed over.

    Returns:
        A module name, or None when the model has no child module to tap.
    """
    best: str | None = None
    module, prefix = model, ""
    while True:
        children = [(n, m) for n, m in _callable_children(module, prefix) if not ran or n in ran]
        blocks = [(n, m) for n, m in children if any(True for _ in m.children())]
        if not blocks:
            # Inside a lone block, that block is the answer; at the root, the last module.
            return best if best is not None or not children else children[-1][0]
        best = blocks[-1][0]
        if len(blocks) > 1:
            return best
        module, prefix = blocks[0][1], best + "."
