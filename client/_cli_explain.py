"""``layertap explain``: a Grad-CAM heatmap over the input, as PNG.

The server returns the maps upsampled to the input and normalized to
``[0, 1]``; this module colours them (a jet-like map, in numpy), blends them
over the input image and writes one PNG per sample.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ._client import Client
from ._png import write_png

__all__ = ["add_explain_command", "overlay"]

#: The heatmap's weight in the blend over the input.
ALPHA = 0.5
#: Small inputs are enlarged (nearest neighbour) until their longer side reaches this.
MIN_SIDE = 256


def _unit(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    a = np.nan_to_num(a.astype(np.float64))
    span = a.max() - a.min()
    return (a - a.min()) / span if span > 0 else np.zeros_like(a)


def _jet(v: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``(H, W)`` in [0, 1] -> ``(H, W, 3)`` in [0, 1]: blue (cold) through green to red (hot)."""
    return np.stack([np.clip(1.5 - np.abs(4 * v - k), 0, 1) for k in (3, 2, 1)], axis=-1)


def overlay(image: np.ndarray[Any, Any] | None, cam: np.ndarray[Any, Any], alpha: float = ALPHA) -> np.ndarray[Any, Any]:
    """The coloured ``(H, W)`` map blended over a ``(C, H, W)`` image, as ``(H, W, 3)`` uint8.

    3 channels are shown as RGB; any other count as grey (their mean). Each
    is scaled to its own range. Without an image, the heatmap alone.
    """
    heat = _jet(np.clip(np.nan_to_num(cam.astype(np.float64)), 0, 1))
    if image is not None:
        base = _unit(image)
        rgb = base.transpose(1, 2, 0) if base.shape[0] == 3 else np.repeat(base.mean(axis=0)[..., None], 3, axis=-1)
        heat = (1 - alpha) * rgb + alpha * heat
    out = np.round(heat * 255).astype(np.uint8)
    scale = max(1, MIN_SIDE // max(out.shape[:2]))
    return out.repeat(scale, axis=0).repeat(scale, axis=1)


def _outputs(path: Path, n: int) -> list[Path]:
    path = path if path.suffix.lower() == ".png" else path.with_name(path.name + ".png")
    return [path] if n == 1 else [path.with_name(f"{path.stem}-{i}{path.suffix}") for i in range(n)]


def _cmd_explain(args: argparse.Namespace) -> int:
    x = np.load(args.input, allow_pickle=False)
    if not isinstance(x, np.ndarray):
        raise ValueError(f"--input {args.input}: expected one array in a .npy file")
    with Client(args.host, timeout=args.timeout, token=args.token, tls=args.tls_ca or args.tls) as client:
        found = client.explain(x, args.layer, args.target, normalize=True, upsample=True,
                               output_name=args.output_name)
    if found.maps.ndim != 3:
        raise ValueError(f"the maps of {args.layer!r} are shaped {found.maps.shape[1:]}; a PNG needs 2 spatial dims")
    image_like = x.ndim == 4 and x.shape[2:] == found.maps.shape[1:]
    for i, path in enumerate(_outputs(args.output, len(found.maps))):
        write_png(path, overlay(x[i] if image_like else None, found.maps[i]))
        print(f"{path}: class {found.classes[i]} score {found.scores[i]:.6g}")
    return 0


def add_explain_command(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """Register ``explain`` with the CLI's ``command(name, help)`` factory (which adds HOST and the connection flags)."""
    p = command("explain", "Grad-CAM: write the heatmap of a layer's evidence for a class over the input, as PNG.")
    p.add_argument("--input", type=Path, required=True, help="model input .npy, shaped (N, C, H, W) for an image model")
    p.add_argument("--layer", required=True, help="module to explain, e.g. layer4 (see 'layertap layers')")
    p.add_argument("--target", type=int, help="output index (class) to explain (default: each sample's top class)")
    p.add_argument("--output-name", default="", help="the model output to explain when it returns several (a key, "
                                                     "or outputN for a tuple; default: the tensor, else logits)")
    p.add_argument("-o", "--output", type=Path, required=True,
                   help="PNG file; with N > 1 samples, NAME-0.png, NAME-1.png, ...")
    p.set_defaults(func=_cmd_explain)
