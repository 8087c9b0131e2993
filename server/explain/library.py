"""Captum, imported off the start-up path, with the few of its internals the internal batches drive.

Imported on a thread of its own (:func:`preload`, started once the model is
loaded): ``captum.attr`` imports ``matplotlib.pyplot`` (its visualisation
module), 0.5 to 1 s of CPU on the 2-core machine, which start-up should not
wait for, nor the first Explain (measured: 2.7 s for the first Grad-CAM when
it imported Captum itself, 0.1 s after). It costs about 32 MiB resident.
A training agent never imports it: its host refuses Explain.

Why internals: Captum runs an integrated-gradients attribution's internal
batches inside one call (``captum.attr._utils.batching._batch_attribution``),
which would hold the model lock for all of them. Explain runs each batch as
a pass of its own (:mod:`.passes`), so it drives Captum's own loop itself:
every batch is ``IntegratedGradients._attribute`` with that batch's slice of
step sizes and alphas (``step_sizes_and_alphas``), exactly as
``_batch_attribution`` calls it, and the slices add up in the same order. A
layer method first takes the layer's values for the inputs and the baselines
with ``_forward_layer_eval`` and installs
``LayerIntegratedGradients._make_gradient_func``, as
``LayerIntegratedGradients.attribute`` does. The arithmetic is Captum's; only
the loop is ours. These names are private to Captum 0.9, hence the pin
``captum>=0.9,<0.10``; ``tests/server/explain`` compares every method with
Captum's public ``attribute`` on the same weights, so a change shows there.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["Captum", "captum", "preload"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Captum:
    IntegratedGradients: Any
    LayerIntegratedGradients: Any
    LayerGradCam: Any
    LayerAttribution: Any
    Saliency: Any
    #: ``approximation_parameters(method) -> (step_sizes(n), alphas(n))``.
    approximation_parameters: Any
    #: ``_forward_layer_eval(forward, inputs, layer, additional_forward_args=...)``: the layer's values.
    forward_layer_eval: Any


@functools.cache
def captum() -> Captum:
    """The Captum names Explain uses, imported once."""
    # Imported here, not at the top: see the module docstring (matplotlib at start-up).
    from captum._utils.gradient import _forward_layer_eval  # noqa: PLC0415
    from captum.attr import IntegratedGradients, LayerAttribution, LayerGradCam, LayerIntegratedGradients, Saliency  # noqa: PLC0415
    from captum.attr._utils.approximation_methods import approximation_parameters  # noqa: PLC0415

    return Captum(IntegratedGradients, LayerIntegratedGradients, LayerGradCam, LayerAttribution, Saliency,
                  approximation_parameters, _forward_layer_eval)


def _import() -> None:
    try:
        captum()
    except ImportError as exc:  # Explain says so when called; the rest of the server does not need it
        log.warning("captum does not import (%s): Explain will answer FAILED_PRECONDITION", exc)


def preload() -> threading.Thread:
    """Import Captum on a thread that exits when done; returns it (started).

    Not a daemon: a process that stops during the import waits for it (at most
    about a second) rather than leaving a thread inside an import at exit.
    """
    thread = threading.Thread(target=_import, name="layertap-captum-import")
    thread.start()
    return thread
