"""Bounds on what a request may ask for, in one table.

layertap is meant to be reachable from other machines, so every field that
arrives is bounded before it costs anything: time (matching, compiling),
memory (allocations sized by the client) or state (taps, hooks). Each check
raises ``InvalidField`` naming the field, so a client learns what to fix.
docs/security.md lists these limits for operators.
"""

from __future__ import annotations

import re

from layertap.server.errors import InvalidField, echo

#: Names that clients invent (taps, baselines): length and charset. Layer
#: names come from the model, so they are only length-capped (see capture).
MAX_NAME_CHARS = 256
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]*\Z")
#: Tensors a client sends (Infer, active captures): rank, and elements as if
#: every zero-sized dimension were 1, so an empty tensor cannot claim an
#: absurd shape that overflows torch's size arithmetic.
MAX_TENSOR_DIMS = 16
MAX_TENSOR_ELEMENTS = 1 << 34
#: A durable tap lives at most this long; "forever" is its own flag.
MAX_TTL_SECONDS = 30 * 24 * 3600.0
#: Reducers one tap may run on each tapped tensor.
MAX_REDUCERS_PER_TAP = 16
#: Elements one tap may sample per tapped tensor, over all its reducers
#: (histogram and quantile samples): bounds the per-pass cost of one tap.
MAX_SAMPLED_ELEMENTS = 1 << 20
#: Integrated gradients' steps per Explain request: each step is a forward and
#: a backward of every sample (rows per pass are capped by --max-explain-batch).
MAX_EXPLAIN_STEPS = 256


def check_name(name: str, field: str) -> None:
    """A client-chosen name: at most ``MAX_NAME_CHARS`` from a safe charset."""
    if len(name) > MAX_NAME_CHARS:
        raise InvalidField(field, f"at most {MAX_NAME_CHARS} characters, got {len(name)}")
    if not _NAME.match(name):
        raise InvalidField(field, f"{echo(name)} must start with a letter or digit and use only "
                                 "letters, digits and . _ : @ / -")


def check_ttl(ttl: float, field: str = "ttl") -> None:
    """A durable tap's TTL: positive, finite, at most ``MAX_TTL_SECONDS``."""
    if not (0 < ttl <= MAX_TTL_SECONDS):
        raise InvalidField(field, f"must be in (0, {MAX_TTL_SECONDS:.0f}] seconds (30 days), got {ttl}; "
                                 "use forever=true for a tap that never expires")
