"""Hooks on modules called with keyword arguments: what ``input`` and ``grad_input`` see."""

from __future__ import annotations

import pytest
import torch
from support.kwargs_models import keyword_block

from layertap.server.host.hooks import CallArgs, HookRegistry, ParamGrad
from layertap.server.host.model_host import flatten_tensors
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit


def test_call_args_name_positional_tensors_by_position_and_keywords_by_path() -> None:
    a, b, c, d = (torch.full((1,), float(i)) for i in range(4))
    call = CallArgs((a, None, b), {"hidden": c, "pe": (d, [a, {"k": b}]), "cache": object(), "flag": True})
    names = [k for k, _ in flatten_tensors(call)]
    assert names == ["0", "2", "hidden", "pe.0", "pe.1.0", "pe.1.1.k"]
    assert call.positional == 2
    assert [t for _, t in flatten_tensors(call)][2] is c
    assert flatten_tensors(CallArgs((), {"cache": object(), "mask": None})) == []


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_input_gives_keyword_tensors_and_grad_input_only_positional_ones() -> None:
    model = keyword_block()
    ctx = object()
    hooks = HookRegistry(model, lambda: ctx, raw_pass=lambda: None)
    seen: dict[tuple[str, int], list[object]] = {}
    for layer in ("kw", "pos"):
        for point in (pb.POINT_INPUT, pb.POINT_GRAD_INPUT):
            hooks.add(layer, point, lambda _c, v, _k=(layer, point): seen.setdefault(_k, []).append(v))
    # torch's own full backward hook: what grad_input means for a module called with keywords.
    torch_grads: dict[str, tuple[object, ...]] = {}
    for layer in ("kw", "pos"):
        model.get_submodule(layer).register_full_backward_hook(
            lambda _m, gi, _go, _l=layer: torch_grads.__setitem__(_l, gi))
    local: dict[str, tuple[tuple[object, ...], dict[str, object]]] = {}
    for layer in ("kw", "pos"):
        model.get_submodule(layer).register_forward_pre_hook(
            lambda _m, a, k, _l=layer: local.__setitem__(_l, (a, k)), with_kwargs=True)

    model(torch.randn(3, 8)).sum().backward()

    (kw_in,) = seen["kw", pb.POINT_INPUT]
    assert isinstance(kw_in, CallArgs) and kw_in.args == ()
    assert [k for k, _ in flatten_tensors(kw_in)] == ["x", "scale", "pair.0", "pair.1"]  # cache, flag skipped
    assert flatten_tensors(kw_in)[0][1] is local["kw"][1]["x"]
    (pos_in,) = seen["pos", pb.POINT_INPUT]
    assert [k for k, _ in flatten_tensors(pos_in)] == ["0", "scale", "pair.0", "pair.1"]
    assert isinstance(pos_in, CallArgs) and pos_in.positional == 1

    # grad_input covers positional tensor arguments only, as torch's does: a
    # module called with keywords only gives none; one with a positional
    # tensor gives that tensor's gradient (position 0), and no keyword's.
    assert ("kw", pb.POINT_GRAD_INPUT) not in seen
    assert torch_grads["kw"] == ()
    (grad,) = seen["pos", pb.POINT_GRAD_INPUT]
    assert isinstance(grad, ParamGrad) and grad.position == 0
    torch.testing.assert_close(grad.grad, torch_grads["pos"][0], rtol=0, atol=0)


def test_positional_call_still_gives_the_args_tuple() -> None:
    model = keyword_block()
    ctx = object()
    hooks = HookRegistry(model, lambda: ctx, raw_pass=lambda: None)
    seen: list[object] = []
    hooks.add("lin", pb.POINT_INPUT, lambda _c, v: seen.append(v))
    x = torch.randn(2, 8)
    with torch.inference_mode():
        model(x)
    assert isinstance(seen[0], tuple) and seen[0][0] is x
