"""Grad-CAM through Captum's ``LayerGradCam``, then upsampled and normalised as asked.

Grad-CAM (Selvaraju et al., 2017) weights each channel of a layer's output by
the spatial mean of the target score's gradient there, sums the channels and
keeps the positive part: ``LayerGradCam(...).attribute(relu_attributions=True)``.
Captum's hook hands the rest of the model a clone of the layer's output, so
in-place operations downstream (``ReLU(inplace=True)``) leave the values it
differentiates alone, and it differentiates with ``torch.autograd.grad``, so
no parameter's ``.grad`` changes.

Each internal batch is a group of samples (``batch_rows`` of them): samples
are explained independently in eval mode, so the maps do not depend on the
grouping. The map is returned in float32 whatever the model's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from layertap.server.errors import InvalidField
from layertap.server.explain.library import Captum
from layertap.server.explain.options import ExplainOptions
from layertap.server.explain.passes import ExplainPasses
from layertap.server.explain.prepared import Prepared, not_in_graph, sample_groups

__all__ = ["grad_cam"]

#: Interpolation mode by the map's spatial rank (F.interpolate's names).
_MODES = {1: "linear", 2: "bilinear", 3: "trilinear"}


def finish(lib: Captum, cam: torch.Tensor, opts: ExplainOptions, input_size: Sequence[int]) -> torch.Tensor:
    """Upsample (Captum's ``LayerAttribution.interpolate``, corners not aligned), then normalize, as asked."""
    if opts.upsample:
        mode = _MODES.get(cam.dim() - 1)
        if mode is None or len(input_size) != cam.dim() - 1:
            # The caller's argument, not the server's state: this layer and input never
            # upsample, and the same request without upsample is answered.
            raise InvalidField("upsample", f"the map of {opts.layer!r} has {cam.dim() - 1} spatial dim(s) and the "
                                          f"input {len(input_size)} (after N, C); upsampling needs 1 to 3 of each, "
                                          "the same number: leave upsample off or pick a spatial layer")
        cam = lib.LayerAttribution.interpolate(cam[:, None], tuple(input_size), interpolate_mode=mode)[:, 0]
    if opts.normalize:
        flat = cam.reshape(cam.shape[0], -1)  # a layer without spatial dims gives one value per sample
        low = flat.min(dim=1).values.view(-1, *[1] * (cam.dim() - 1))
        span = flat.max(dim=1).values.view_as(low) - low
        cam = torch.where(span > 0, (cam - low) / span.clamp_min(torch.finfo(cam.dtype).tiny), torch.zeros_like(cam))
    return cam


def _maps(lib: Captum, prep: Prepared, opts: ExplainOptions, start: int, stop: int) -> torch.Tensor:
    main, others = prep.fn.rows(start, stop)
    cam: Any
    try:
        cam = lib.LayerGradCam(prep.fn, prep.layer_module).attribute(
            main, target=prep.targets[start:stop], additional_forward_args=others or None, relu_attributions=True)
    except RuntimeError as exc:
        raise not_in_graph(exc, opts.layer) from None
    return finish(lib, cam.detach().float()[:, 0], opts, main.shape[2:]).cpu()


def grad_cam(lib: Captum, passes: ExplainPasses, prep: Prepared, opts: ExplainOptions) -> list[torch.Tensor]:
    """The maps of each group of samples, float32 on the CPU: ``(group, *spatial)``."""
    groups = sample_groups(prep.n, opts.batch_rows)
    passes.planned += len(groups)
    return [passes.run(_maps, lib, prep, opts, start, stop) for start, stop in groups]
