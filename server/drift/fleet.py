"""Fleet-wide baselines on the monitor: ExportBaseline and InstallBaseline (the monitor's ``export``, ``install``).

A mixin of :class:`~layertap.server.drift.monitor.DriftMonitor` that reads
only the attributes it declares, so this module imports nothing downstream.
The messages themselves (builder states, frozen documents, their checks and
the merge) are :mod:`.exchange`'s; here they meet a baseline tap's entries:
every baseline is checked before any is installed, so a refusal changes
nothing, and a phase the layer has not seen yet gets its entry when installed.
Merged builders freeze with the tap's derive (a builder's state does not say
it); a frozen document names its own (schema v4), and one that reads another
quantity than the tap is refused.
"""

from __future__ import annotations

import threading
from dataclasses import replace

from layertap.server.drift.baseline import Baseline
from layertap.server.drift.builder import BuilderState
from layertap.server.drift.exchange import builder_state_from_proto, frozen_from_bytes, merge_states
from layertap.server.drift.layer import LayerEntry
from layertap.server.drift.table import LayerTable
from layertap.server.drift.tap_control import TapControl
from layertap.server.errors import InvalidField, NotFound, Unsupported
from layertap.server.reducers.derive import DERIVE_NAMES
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["FleetBaselines"]


def _reads(derive: int) -> str:
    """What a tap with ``derive`` reads, for a refusal."""
    return repr(DERIVE_NAMES[derive]) if derive in DERIVE_NAMES else "the tensor itself"


class FleetBaselines:
    """``export()`` and ``install()``: one baseline tap's builders or frozen references between replicas."""

    control: TapControl
    _lock: threading.Lock
    _build_lock: threading.Lock
    _layers: LayerTable

    def _channels(self, layer: str) -> int | None:
        raise NotImplementedError

    def _add_phase(self, tap: str, layer: str, phase: str, *, replan: bool = True) -> LayerEntry | None:
        raise NotImplementedError

    def _freeze(self, entry: LayerEntry, baseline: Baseline) -> bool:
        raise NotImplementedError

    def _entries(self, tap: str) -> dict[str, dict[str, LayerEntry]]:
        """Layer -> phase -> entry of baseline ``tap``."""
        with self._lock:
            entries = {layer: dict(phases) for (t, layer), phases in self._layers.items() if t == tap}
        if not entries:
            raise NotFound(f"tap: no baseline tap {tap!r}; SetBaseline returns its id", field="tap")
        return entries

    def export(self, tap: str) -> list[pb.LayerBaseline]:
        """Each layer and phase of baseline ``tap``: its builder's state, or its frozen document."""
        with self._build_lock:
            msgs = [e.export_message() for phases in self._entries(tap).values() for e in phases.values()]
        return [m for m in msgs if m is not None]

    def install(self, req: pb.InstallBaselineRequest) -> list[Baseline]:
        """Freeze the merged ``req.builders`` (or take ``req.frozen``) as the reference of ``req.tap``'s layers.

        Every baseline is checked before any is installed, so a refusal changes nothing.

        Raises:
            InvalidField: A malformed state or document, or a layer or point the tap does not have.
            NotFound: No such baseline tap.
            Unsupported: Merged builders that hold no data yet.
        """
        if bool(req.builders) == bool(req.frozen):
            raise InvalidField("builders", "give exported builders or frozen documents (exactly one of the two)")
        entries = self._entries(req.tap)
        # Per (layer, phase): a phase the layer has not seen yet gets its entry when installed.
        baselines: dict[tuple[str, str], Baseline] = {}
        if req.builders:
            groups: dict[tuple[str, str], list[BuilderState]] = {}
            for i, msg in enumerate(req.builders):
                state = builder_state_from_proto(msg, f"builders[{i}]")
                self._check_layer(entries, state.layer, state.point, f"builders[{i}]")
                groups.setdefault((state.layer, state.phase), []).append(state)
            for (layer, phase), states in groups.items():
                e = next(iter(entries[layer].values()))
                try:
                    baselines[layer, phase] = merge_states(req.tap, states).freeze(
                        window=e.window_len, thresholds=e.thresholds, fixed=e.fixed, derive=e.derive)
                except ValueError as exc:
                    raise Unsupported(f"builders: {exc}; collect more passes first", field="builders") from None
        else:
            known = {name: self._channels(name) for name in self.control.host.layer_names}
            for i, data in enumerate(req.frozen):
                b = frozen_from_bytes(data, f"frozen[{i}]", known)
                self._check_layer(entries, b.layer, b.point, f"frozen[{i}]")
                if (b.layer, b.phase) in baselines:
                    raise InvalidField(f"frozen[{i}]", f"a second document for layer {b.layer!r} in phase {b.phase!r}")
                e = next(iter(entries[b.layer].values()))
                if b.derive != e.derive:  # scored on the wrong quantity otherwise
                    raise InvalidField(f"frozen[{i}]", f"a baseline of {_reads(b.derive)}, but tap {req.tap!r} "
                                                       f"reads {_reads(e.derive)} of {b.layer!r}")
                # The alarm decides on this tap's window: the null's per-pass μ, σ hold at any window.
                null = b.null.rewindowed(e.window_len) if b.null is not None else None
                baselines[b.layer, b.phase] = replace(b, tap=req.tap, window=e.window_len, thresholds=e.thresholds,
                                                      fixed=e.fixed, null=null)
        with self._build_lock:
            for (layer, phase), b in baselines.items():
                entry = entries[layer].get(phase) or self._add_phase(req.tap, layer, phase, replan=False)
                if entry is None or not self._freeze(entry, b):
                    raise NotFound(f"tap: baseline tap {req.tap!r} was deleted or replaced meanwhile", field="tap")
        return list(baselines.values())

    @staticmethod
    def _check_layer(entries: dict[str, dict[str, LayerEntry]], layer: str, point: str, field: str) -> None:
        if layer not in entries:
            raise InvalidField(f"{field}.layer", f"{layer!r} is not a layer of this baseline tap ({', '.join(entries)})")
        at = next(iter(entries[layer].values())).point
        if at != point:
            raise InvalidField(f"{field}.point", f"{point!r}, but the tap reads {layer!r} at {at!r}")
