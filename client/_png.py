"""A minimal PNG writer: 8-bit RGB, numpy and zlib only.

The explain command writes one heatmap; Pillow or matplotlib would add a
dependency (and tens of megabytes) to the thin client for about thirty lines
of standard format (PNG, RFC 2083: signature, IHDR, IDAT, IEND).
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["encode_png", "write_png"]

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: IHDR: bit depth 8, colour type 2 (RGB), deflate, adaptive filtering, no interlace.
_RGB8 = (8, 2, 0, 0, 0)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def encode_png(rgb: np.ndarray[Any, Any]) -> bytes:
    """PNG bytes of an ``(H, W, 3)`` uint8 image."""
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3 or not rgb.shape[0] or not rgb.shape[1]:
        raise ValueError(f"expected a non-empty (H, W, 3) uint8 image, got {rgb.dtype} {rgb.shape}")
    height, width = rgb.shape[:2]
    # Filter type 0 (None) on every row: the heatmaps are small, and smooth
    # enough for deflate alone.
    rows = np.concatenate([np.zeros((height, 1), np.uint8), np.ascontiguousarray(rgb).reshape(height, -1)], axis=1)
    header = struct.pack(">IIBBBBB", width, height, *_RGB8)
    return _SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(rows.tobytes(), 6)) + _chunk(b"IEND", b"")


def write_png(path: Path, rgb: np.ndarray[Any, Any]) -> None:
    """Write an ``(H, W, 3)`` uint8 image to ``path`` as PNG."""
    path.write_bytes(encode_png(rgb))
