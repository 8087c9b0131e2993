"""The explain command's PNG writer and heatmap overlay, read back with Pillow."""

from __future__ import annotations

import io

import numpy as np
import pytest

from layertap._png import encode_png
from layertap.cli.explain import MIN_SIDE, overlay

pytestmark = pytest.mark.unit

Image = pytest.importorskip("PIL.Image")


@pytest.mark.parametrize("shape", [(1, 1, 3), (7, 13, 3), (64, 48, 3)])
def test_png_round_trips_through_pillow(shape):
    rgb = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    img = Image.open(io.BytesIO(encode_png(rgb)))
    img.load()  # decodes every chunk and checks the CRCs
    assert img.mode == "RGB" and img.size == (shape[1], shape[0])
    assert np.array_equal(np.asarray(img), rgb)


@pytest.mark.parametrize("bad", [np.zeros((4, 4), np.uint8), np.zeros((4, 4, 4), np.uint8),
                                 np.zeros((4, 4, 3), np.float32), np.zeros((0, 4, 3), np.uint8)])
def test_png_refuses_what_it_cannot_write(bad):
    with pytest.raises(ValueError, match=r"\(H, W, 3\) uint8"):
        encode_png(bad)


def test_overlay_colours_and_blends():
    cam = np.array([[0.0, 1.0], [0.5, 0.25]], np.float32)
    alone = overlay(None, cam)
    scale = MIN_SIDE // 2
    assert alone.shape == (2 * scale, 2 * scale, 3) and alone.dtype == np.uint8
    assert tuple(alone[0, 0]) == (0, 0, 128)  # cold: dark blue
    assert tuple(alone[0, -1]) == (128, 0, 0)  # hot: dark red
    assert tuple(alone[-1, 0]) == (128, 255, 128)  # the middle: green
    white = np.ones((3, 2, 2), np.float32)
    white[:, 0, 0] = 0  # black at (0, 0), so the image spans [0, 1]
    blended = overlay(white, cam)
    assert tuple(blended[0, 0]) == (0, 0, 64)  # half of dark blue over black
    assert tuple(blended[-1, -1]) == (128, 191, 255)  # white + jet(0.25) = (0, 0.5, 1), halved
