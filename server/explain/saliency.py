"""Saliency through Captum's ``Saliency``: the absolute gradient of the target score at the main input.

One pass per group of ``batch_rows`` samples; samples are independent in
eval mode. The input's copy carries the gradient, so the caller's tensor and
the model's parameters keep theirs.
"""

from __future__ import annotations

import torch

from layertap.server.explain.library import Captum
from layertap.server.explain.options import ExplainOptions
from layertap.server.explain.passes import ExplainPasses
from layertap.server.explain.prepared import Prepared, not_in_graph, sample_groups

__all__ = ["saliency"]


def _gradients(lib: Captum, prep: Prepared, start: int, stop: int) -> torch.Tensor:
    main, others = prep.fn.rows(start, stop)
    try:
        grads: torch.Tensor = lib.Saliency(prep.fn).attribute(main.detach().clone().requires_grad_(),
                                                             target=prep.targets[start:stop],
                                                             abs=True, additional_forward_args=others or None)
    except RuntimeError as exc:
        raise not_in_graph(exc, "") from None
    return grads.detach().float().cpu()


def saliency(lib: Captum, passes: ExplainPasses, prep: Prepared, opts: ExplainOptions) -> list[torch.Tensor]:
    """Attributions shaped like the main input, per group of samples (CPU, float32)."""
    groups = sample_groups(prep.n, opts.batch_rows)
    passes.planned += len(groups)
    return [passes.run(_gradients, lib, prep, start, stop) for start, stop in groups]
