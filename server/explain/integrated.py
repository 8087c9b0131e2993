"""Integrated gradients of the main input, and layer integrated gradients, one internal batch per pass.

Both are Captum's (``IntegratedGradients``, ``LayerIntegratedGradients``)
with Gauss-Legendre steps. Captum cuts ``n_steps`` into internal batches of
``internal_batch_size // samples`` steps and adds the batches' attributions;
here each batch is one pass (:mod:`.passes`) that calls Captum's own
``_attribute`` with its slice of step sizes and alphas (see :mod:`.library`
for why, and which internals). Samples beyond ``batch_rows`` are split into
groups first, each integrated on its own: samples are independent in eval
mode. Each group's convergence delta is Captum's ``compute_convergence_delta``
(one more pass): the sum of a sample's attributions minus
``F(input) - F(baseline)`` at its target.

Layer integrated gradients on a token model's embedding attribute per token:
the layer's trailing dims are summed, and tokens whose ``attention_mask`` is
0 are 0 (their baseline ids are the input's own, :mod:`.prepared`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from layertap.server.explain.library import Captum
from layertap.server.explain.options import STEP_METHOD, ExplainOptions
from layertap.server.explain.passes import ExplainPasses
from layertap.server.explain.prepared import Prepared, not_in_graph, sample_groups, step_chunks

__all__ = ["integrated_gradients", "layer_integrated_gradients"]


def _steps(lib: Captum, n_steps: int) -> tuple[list[float], list[float]]:
    sizes, alphas = lib.approximation_parameters(STEP_METHOD)
    return list(sizes(n_steps)), list(alphas(n_steps))


def _add(total: tuple[torch.Tensor, ...] | None, part: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """One batch's attributions added to the total, as ``_batch_attribution`` adds them."""
    if total is None:
        return tuple(part)
    return tuple(p.detach() + t for p, t in zip(part, total))


def _batch(method: Any, layer: str, total: tuple[torch.Tensor, ...] | None, step_sizes: list[float],
           alphas: list[float], **kwargs: Any) -> tuple[torch.Tensor, ...]:
    try:
        part = method._attribute(**kwargs, n_steps=len(step_sizes), method=STEP_METHOD,
                                 step_sizes_and_alphas=(step_sizes, alphas))
    except RuntimeError as exc:
        raise not_in_graph(exc, layer) from None
    return _add(total, part)


def _integrate(passes: ExplainPasses, method: Any, layer: str, samples: int, opts: ExplainOptions,
               steps: tuple[list[float], list[float]], **kwargs: Any) -> tuple[torch.Tensor, ...]:
    sizes, alphas = steps
    total: tuple[torch.Tensor, ...] | None = None
    for start, stop in step_chunks(opts.n_steps, samples, opts.batch_rows):
        total = passes.run(functools.partial(_batch, method, layer, total, sizes[start:stop], alphas[start:stop],
                                             **kwargs))
    assert total is not None
    return total


def _plan(passes: ExplainPasses, prep: Prepared, opts: ExplainOptions, per_group: int) -> list[tuple[int, int]]:
    groups = sample_groups(prep.n, opts.batch_rows)
    passes.planned += sum(len(step_chunks(opts.n_steps, stop - start, opts.batch_rows)) + per_group
                          for start, stop in groups)
    return groups


def _per_token(attr: torch.Tensor, main: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """A token model's layer attributions summed per token, padding 0; any other layer's as they are."""
    attr = attr.detach().float()
    if main.is_floating_point() or main.dim() != 2 or tuple(attr.shape[:2]) != tuple(main.shape):
        return attr.cpu()
    tokens = attr.sum(dim=tuple(range(2, attr.dim()))) if attr.dim() > 2 else attr
    if mask is not None:
        tokens = torch.where(mask != 0, tokens, torch.zeros_like(tokens))
    return tokens.cpu()


def _finish(method: Any, total: tuple[torch.Tensor, ...], start_point: torch.Tensor, end_point: torch.Tensor,
            others: tuple[torch.Tensor, ...], targets: list[int],
            mask: torch.Tensor | None = None, per_token: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's last pass: Captum's convergence delta, and its attributions on the CPU (float32)."""
    delta = method.compute_convergence_delta(total, start_point=(start_point,), end_point=(end_point,),
                                             additional_forward_args=others or None, target=targets)
    attr = _per_token(total[0], end_point, mask) if per_token else total[0].detach().float().cpu()
    return attr, delta.detach().double().cpu()


def integrated_gradients(lib: Captum, passes: ExplainPasses, prep: Prepared,
                         opts: ExplainOptions) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Attributions shaped like the main input, and the deltas, per group of samples (CPU, float32 / float64)."""
    assert prep.baseline is not None
    ig = lib.IntegratedGradients(prep.fn)
    steps = _steps(lib, opts.n_steps)
    parts, deltas = [], []
    for start, stop in _plan(passes, prep, opts, 1):
        main, others = prep.fn.rows(start, stop)
        base, targets = prep.baseline[start:stop], prep.targets[start:stop]
        total = _integrate(passes, ig, "", stop - start, opts, steps, inputs=(main,), baselines=(base,),
                           target=targets, additional_forward_args=others or None)
        attr, delta = passes.run(_finish, ig, total, base, main, others, targets)
        parts.append(attr)
        deltas.append(delta)
    return parts, deltas


def _layer_values(lib: Captum, prep: Prepared, main: torch.Tensor, base: torch.Tensor,
                  others: tuple[torch.Tensor, ...]) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The layer's output for the inputs and for the baselines, as ``LayerIntegratedGradients.attribute`` takes them."""
    extra = others or None
    values = lib.forward_layer_eval(prep.fn, (main,), prep.layer_module, additional_forward_args=extra)
    baselines = lib.forward_layer_eval(prep.fn, (base,), prep.layer_module, additional_forward_args=extra)
    return tuple(values), tuple(baselines)


def layer_integrated_gradients(lib: Captum, passes: ExplainPasses, prep: Prepared,
                               opts: ExplainOptions) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Attributions at the layer (per token for token ids), and the deltas, per group of samples."""
    assert prep.baseline is not None and prep.layer_module is not None
    lig = lib.LayerIntegratedGradients(prep.fn, prep.layer_module)
    # One layer with one output tensor: LayerIntegratedGradients.attribute's num_outputs_cumsum, [0, 1].
    lig.ig.gradient_func = lig._make_gradient_func(torch.cumsum(torch.IntTensor([0, 1]), dim=0), False, None)
    steps = _steps(lib, opts.n_steps)
    parts, deltas = [], []
    for start, stop in _plan(passes, prep, opts, 2):
        main, others = prep.fn.rows(start, stop)
        base, targets = prep.baseline[start:stop], prep.targets[start:stop]
        values, baselines = passes.run(_layer_values, lib, prep, main, base, others)
        total = _integrate(passes, lig.ig, opts.layer, stop - start, opts, steps, inputs=values, baselines=baselines,
                           target=targets, additional_forward_args=(main, *others))
        mask = prep.mask[start:stop] if prep.mask is not None else None
        attr, delta = passes.run(_finish, lig, total, base, main, others, targets, mask, True)
        parts.append(attr)
        deltas.append(delta)
    return parts, deltas
