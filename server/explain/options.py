"""What an Explain request asks for, once its fields are checked, and what it gives back."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "BASELINES",
    "DEFAULT_STEPS",
    "EXPLAIN_OWNER",
    "GRAD_CAM",
    "INTEGRATED_GRADIENTS",
    "LAYERED",
    "LAYER_INTEGRATED_GRADIENTS",
    "METHODS",
    "SALIENCY",
    "STEPPED",
    "STEP_METHOD",
    "ExplainOptions",
    "Explanation",
]

#: The ``active_owner`` of an Explain pass: observers skip active passes.
EXPLAIN_OWNER = "explain"

#: Method names, as the client and the metrics spell them (``ExplainMethod`` without its prefix).
GRAD_CAM = "grad_cam"
INTEGRATED_GRADIENTS = "integrated_gradients"
LAYER_INTEGRATED_GRADIENTS = "layer_integrated_gradients"
SALIENCY = "saliency"
METHODS = (GRAD_CAM, INTEGRATED_GRADIENTS, LAYER_INTEGRATED_GRADIENTS, SALIENCY)
#: Methods that integrate along a path from a baseline, in steps.
STEPPED = (INTEGRATED_GRADIENTS, LAYER_INTEGRATED_GRADIENTS)
#: Methods that attribute to a layer; the others attribute to the main input.
LAYERED = (GRAD_CAM, LAYER_INTEGRATED_GRADIENTS)

#: Baseline kinds (``BaselineKind`` without its prefix).
BASELINES = ("zeros", "given", "noise")
#: Captum's default number of steps.
DEFAULT_STEPS = 50
#: Captum's default (and only offered) quadrature.
STEP_METHOD = "gausslegendre"


@dataclass(frozen=True)
class ExplainOptions:
    #: One of :data:`METHODS`.
    method: str = GRAD_CAM
    #: The layer of a layer method ("" for the input methods).
    layer: str = ""
    #: Empty: each sample's top class; one: every sample's; N: one per sample.
    targets: tuple[int, ...] = ()
    normalize: bool = False
    upsample: bool = False
    #: The output to explain (see ``pick_output``): empty picks the tensor, ``logits`` or the only one.
    output_name: str = ""
    #: Integrated gradients' steps.
    n_steps: int = DEFAULT_STEPS
    #: One of :data:`BASELINES`.
    baseline: str = "zeros"
    #: The given baseline (CPU), shaped like the main input or with a batch of 1.
    baseline_tensor: torch.Tensor | None = None
    noise_std: float = 1.0
    seed: int = 0
    #: Rows per internal batch: samples x steps for the stepped methods, samples otherwise.
    batch_rows: int = 64


@dataclass(frozen=True)
class Explanation:
    method: str
    #: The layer explained ("" for the input methods).
    layer: str
    #: float32 on the CPU: Grad-CAM's maps ``(N, *spatial)``, or the attributions.
    attributions: torch.Tensor
    #: The explained index into each sample's flattened output, ``(N,)`` int64.
    targets: torch.Tensor
    #: The model's output at that index, ``(N,)`` float32.
    scores: torch.Tensor
    #: Integrated gradients' convergence delta per sample, ``(N,)``; None for the other methods.
    deltas: torch.Tensor | None = None
    n_steps: int = 0
    #: Passes run, each under the model lock.
    batches: int = 0
    #: The main input's tokens as the tokenizer spells them, row-major; empty without one.
    tokens: tuple[str, ...] = ()
