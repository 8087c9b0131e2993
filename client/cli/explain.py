"""``layertap explain``: a heatmap over the input as PNG, or a token table for token inputs.

Grad-CAM (the default method) asks the server for maps upsampled to the input
and normalized to ``[0, 1]``. The other methods' attributions are drawn as
each pixel's absolute attribution summed over channels, scaled per sample to
``[0, 1]``. Either is coloured (a jet-like map, in numpy), blended over the
input image and written as one PNG per sample. Layer integrated gradients on
token ids prints a table instead: each unpadded token with its attribution.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from .._client import Client
from .._explain import EXPLAIN_METHODS, LAYER_METHODS, Explanation, method_name
from .._png import write_png
from .args import CommandFactory, connect, positive_float, positive_int
from .input import load_input

__all__ = ["add_explain_command", "heat", "overlay", "token_rows"]

Array = np.ndarray[Any, Any]

#: The heatmap's weight in the blend over the input.
ALPHA = 0.5
#: Small inputs are enlarged (nearest neighbour) until their longer side reaches this.
MIN_SIDE = 256


def _unit(a: Array) -> Array:
    a = np.nan_to_num(a.astype(np.float64))
    span = a.max() - a.min()
    return (a - a.min()) / span if span > 0 else np.zeros_like(a)


def _jet(v: Array) -> Array:
    """``(H, W)`` in [0, 1] -> ``(H, W, 3)`` in [0, 1]: blue (cold) through green to red (hot)."""
    return np.stack([np.clip(1.5 - np.abs(4 * v - k), 0, 1) for k in (3, 2, 1)], axis=-1)


def overlay(image: Array | None, cam: Array, alpha: float = ALPHA) -> Array:
    """The coloured ``(H, W)`` map blended over a ``(C, H, W)`` image, as ``(H, W, 3)`` uint8.

    3 channels are shown as RGB; any other count as grey (their mean). Each
    is scaled to its own range. Without an image, the heatmap alone.
    """
    heat_rgb = _jet(np.clip(np.nan_to_num(cam.astype(np.float64)), 0, 1))
    if image is not None:
        base = _unit(image)
        rgb = base.transpose(1, 2, 0) if base.shape[0] == 3 else np.repeat(base.mean(axis=0)[..., None], 3, axis=-1)
        heat_rgb = (1 - alpha) * rgb + alpha * heat_rgb
    out = np.round(heat_rgb * 255).astype(np.uint8)
    scale = max(1, MIN_SIDE // max(out.shape[:2]))
    return out.repeat(scale, axis=0).repeat(scale, axis=1)


def heat(attributions: Array) -> Array:
    """Per sample, ``(H, W)`` in [0, 1]: the absolute attribution summed over channels, scaled to its range.

    Raises:
        ValueError: The attributions are not ``(N, C, H, W)`` or ``(N, H, W)``.
    """
    if attributions.ndim not in (3, 4):
        raise ValueError(f"attributions shaped {attributions.shape[1:]} per sample; a PNG needs 2 spatial dims")
    magnitude = np.abs(attributions.astype(np.float64))
    if magnitude.ndim == 4:
        magnitude = magnitude.sum(axis=1)
    return np.stack([_unit(m) for m in magnitude])


def _outputs(path: Path, n: int) -> list[Path]:
    path = path if path.suffix.lower() == ".png" else path.with_name(path.name + ".png")
    return [path] if n == 1 else [path.with_name(f"{path.stem}-{i}{path.suffix}") for i in range(n)]


def _sample_line(found: Explanation, i: int) -> str:
    delta = f" delta {found.delta[i]:.6g}" if found.delta is not None else ""
    return f"class {found.classes[i]} score {found.scores[i]:.6g}{delta}"


def token_rows(found: Explanation, ids: Array, mask: Array | None, i: int) -> list[tuple[int, str, float]]:
    """Sample ``i``'s unpadded tokens: (position, token, attribution); the tokenizer's spelling, else the id."""
    keep = np.ones(ids.shape[1], dtype=bool) if mask is None else np.asarray(mask[i]) != 0
    names = found.tokens[i] if found.tokens is not None else [str(int(t)) for t in ids[i]]
    return [(pos, names[pos], float(found.attributions[i, pos])) for pos in range(ids.shape[1]) if keep[pos]]


def _print_tokens(found: Explanation, ids: Array, mask: Array | None) -> None:
    for i in range(len(found.classes)):
        rows = token_rows(found, ids, mask, i)
        print(f"sample {i}: {_sample_line(found, i)}")
        width = max([5, *(len(token) for _, token, _ in rows)])
        print(f"  {'pos':>4}  {'token':<{width}}  attribution")
        for pos, token, value in rows:
            print(f"  {pos:>4}  {token:<{width}}  {value:+.6g}")


def _main_input(client: Client, x: list[Array] | dict[str, Array]) -> tuple[Array, Array | None]:
    """The input the server attributes (the model's first), and the attention mask beside it."""
    if isinstance(x, list):
        return x[0], None
    name = client.metadata().inputs[0].name
    main = x.get(name, next(iter(x.values())))
    return main, x.get("attention_mask")


def _baseline(text: str | None) -> Any:
    if text is None or text in ("zeros", "noise"):
        return text
    return np.load(text, allow_pickle=False)


def _cmd_explain(args: argparse.Namespace) -> int:
    method = method_name(args.method)
    if method == "grad_cam" and not args.layer:
        raise ValueError("--layer: grad_cam needs the layer to explain (see 'layertap layers')")
    if args.layer and method not in LAYER_METHODS:
        raise ValueError(f"--layer: {method} attributes the input; --layer is for {', '.join(LAYER_METHODS)}")
    x = load_input(args.input)
    grad_cam = method == "grad_cam"
    # Options a method does not take go to the server all the same: its error names them.
    with connect(args) as client:
        main, mask = _main_input(client, x)
        found = client.explain(x, args.layer, args.target, method=method, normalize=grad_cam, upsample=grad_cam,
                               output_name=args.output_name, n_steps=args.n_steps, baseline=_baseline(args.baseline),
                               noise_std=args.noise_std, seed=args.seed, internal_batch_size=args.internal_batch_size)
    if not grad_cam and not np.issubdtype(main.dtype, np.floating) and found.attributions.shape == main.shape:
        _print_tokens(found, main, mask)
        return 0
    if args.output is None:
        raise ValueError("-o/--output: give the PNG file to write the heatmap to")
    maps = found.attributions if grad_cam else heat(found.attributions)
    if maps.ndim != 3:
        raise ValueError(f"the maps of {found.layer!r} are shaped {maps.shape[1:]}; a PNG needs 2 spatial dims")
    image_like = main.ndim == 4 and main.shape[2:] == maps.shape[1:]
    for i, path in enumerate(_outputs(args.output, len(maps))):
        write_png(path, overlay(main[i] if image_like else None, maps[i]))
        print(f"{path}: {_sample_line(found, i)}")
    return 0


def add_explain_command(command: CommandFactory) -> None:
    """Register ``explain`` with the CLI's ``command(name, help)`` factory (which adds HOST and the connection flags)."""
    p = command("explain", "Attributions by Captum on the server: a heatmap over the input as PNG (Grad-CAM, "
                           "integrated gradients, saliency), or a token table for token inputs.")
    p.add_argument("--input", type=Path, required=True,
                   help="model input: .npy, shaped (N, C, H, W) for an image model; or .npz by input name "
                        "(input_ids, attention_mask) for a token model")
    p.add_argument("--method", default="grad_cam", choices=[*EXPLAIN_METHODS, "ig", "lig"],
                   help="grad_cam (default), integrated_gradients (ig), layer_integrated_gradients (lig), saliency")
    p.add_argument("--layer", help="layer methods only: the module to explain, e.g. layer4 for grad_cam (see "
                                   "'layertap layers'); lig defaults to the input embedding")
    p.add_argument("--target", type=int, help="output index (class) to explain (default: each sample's top class)")
    p.add_argument("--output-name", default="", help="the model output to explain when it returns several (a key, "
                                                     "or outputN for a tuple; default: the tensor, else logits)")
    p.add_argument("--n-steps", "--steps", type=positive_int, help="integrated gradients: steps (default 50, at most 256)")
    p.add_argument("--baseline", help="integrated gradients: zeros (default), noise, or a .npy shaped like the input")
    p.add_argument("--noise-std", type=positive_float, help="--baseline noise: its standard deviation (default 1)")
    p.add_argument("--seed", type=int, help="--baseline noise: its seed (default 0)")
    p.add_argument("--internal-batch-size", type=positive_int,
                   help="rows (samples x steps) per server pass (default: the server's --max-explain-batch)")
    p.add_argument("-o", "--output", type=Path,
                   help="PNG file (image inputs); with N > 1 samples, NAME-0.png, NAME-1.png, ...")
    p.set_defaults(func=_cmd_explain)
