"""The layer ``serve`` suggests (and ``--smoke`` captures) is one the model really has."""

from __future__ import annotations

import pytest
import torch
from support.encoder import text_encoder
from support.models import perturbable
from torch import nn

from layertap.server.host.demo_model import build_demo_model
from layertap.server.host.suggest import suggest_layer

pytestmark = pytest.mark.unit


def ran_names(model: nn.Module, x: torch.Tensor) -> set[str]:
    """The modules a forward pass really calls, as the warm-up pass records them."""
    names = {id(m): n for n, m in model.named_modules() if n}
    seen: set[str] = set()
    handle = nn.modules.module.register_module_forward_hook(
        lambda m, _a, _o: seen.add(names[id(m)]) if id(m) in names else None)
    try:
        with torch.inference_mode():
            model.eval()(x)
    finally:
        handle.remove()
    return seen


def test_resnet_style_models_get_their_last_stage():
    model = build_demo_model(0)
    assert suggest_layer(model) == "layer4"
    assert suggest_layer(model, ran_names(model, torch.zeros(1, 3, 32, 32))) == "layer4"


def test_a_wrapped_transformer_gets_its_last_encoder_layer():
    # encoder is the one block at the top, so the walk goes into it; its
    # ModuleList is never called itself, so the walk looks through it.
    model = text_encoder()
    ran = ran_names(model, torch.zeros(1, 8, 32))
    assert "encoder.layers" not in ran
    assert suggest_layer(model) == suggest_layer(model, ran) == "encoder.layers.1"
    assert dict(model.named_modules())["encoder.layers.1"] is model.encoder.layers[1]


def test_modules_that_never_ran_are_passed_over():
    model = text_encoder()
    # As if the last encoder layer were skipped by the forward.
    assert suggest_layer(model, {"encoder", "encoder.layers.0", "head"}) == "encoder.layers.0"


def test_flat_models_get_their_last_module_and_a_lone_block_is_kept_whole():
    assert suggest_layer(perturbable()) == "layer4"
    wrapped = nn.Module()
    wrapped.net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert suggest_layer(wrapped) == "net"


def test_a_model_without_children_has_no_suggestion():
    assert suggest_layer(nn.Linear(2, 2)) is None
