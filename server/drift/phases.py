"""Pass phases by name: the ``phase`` label of every activation series and the ``phase`` of a baseline.

A generation runs one prefill pass and then decode passes; Infer, captures,
replays and training steps are plain forwards. Their tensors differ in shape
and in distribution (a decode step's ``(batch, 1, hidden)`` against a
prefill's ``(batch, prompt, hidden)``), so metrics and drift keep them apart
by this name. One table, read by the exporter (labels) and by drift
(baseline files and the drift series).
"""

from __future__ import annotations

from layertap.server.host.model_host import PHASE_DECODE, PHASE_NONE, PHASE_PREFILL

__all__ = ["FORWARD", "PHASE_BY_NAME", "PHASE_NAMES", "phase_name"]

#: The name of ``PHASE_UNSPECIFIED``: a plain forward pass.
FORWARD = "forward"
#: ``layertap.v1.Phase`` value -> its name, in proto order.
PHASE_NAMES: dict[int, str] = {PHASE_NONE: FORWARD, PHASE_PREFILL: "prefill", PHASE_DECODE: "decode"}
PHASE_BY_NAME: dict[str, int] = {name: value for value, name in PHASE_NAMES.items()}


def phase_name(phase: int) -> str:
    """``layertap.v1.Phase`` value -> label value (``PHASE_DECODE`` -> ``"decode"``).

    A value this build does not know keeps a bounded, readable label, as
    :func:`~layertap.server.export.snapshots.point_name` does for points.
    """
    name = PHASE_NAMES.get(phase)
    return name if name is not None else f"phase_{int(phase)}"
