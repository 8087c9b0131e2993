"""Protobuf wire-format primitives for the messages the server writes by hand.

Hot paths (summaries, capture chunks) emit bytes directly instead of building
messages; they share these so the encoding is written once.
"""

from __future__ import annotations

__all__ = ["uint64", "varint"]

_SMALL = [bytes((i,)) for i in range(128)]


def varint(n: int) -> bytes:
    """``n`` (-2**63 <= n < 2**64) as a protobuf base-128 varint; negatives (int64) as ten bytes."""
    if 0 <= n < 128:
        return _SMALL[n]
    n &= (1 << 64) - 1
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def uint64(value: float) -> int:
    """A count bound for a ``uint64`` field; out of range raises, as the message constructors do (never wraps)."""
    n = int(value)
    if not 0 <= n < 1 << 64:
        raise ValueError(f"count out of range for uint64: {n}")
    return n
