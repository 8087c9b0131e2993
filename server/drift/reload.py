"""Start-up: saved baselines reloaded, their taps recreated (the monitor's ``load``).

A mixin of :class:`~layertap.server.drift.monitor.DriftMonitor` that reads
only the attributes it declares, so this module imports nothing downstream.
A file saved before calibration (schema v1/v2) loads uncalibrated, with the
reason on its GetDrift entry; a refused file is logged and counted, and the
others still load. A derived baseline (schema v4) gets its tap back with its
derive and without per-channel means (a derived tensor has no channels), so
it scores the derived quantity again. One tap is one point and one derive:
files of one tap id that disagree on either make one tap of the first such
group, and the rest are refused and counted.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable

from layertap.server.drift.baseline import Baseline
from layertap.server.drift.files import load_baselines
from layertap.server.drift.layer import LayerEntry, layer_reducers
from layertap.server.drift.table import LayerTable
from layertap.server.drift.tap_control import TapControl
from layertap.server.host.hooks import POINT_BY_NAME
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["BaselineReload"]

log = logging.getLogger("layertap.server")


class BaselineReload:
    """``load()``: every saved baseline back on a tap of its own."""

    control: TapControl
    baseline_dir: str | None
    _on_load_error: Callable[[str], None] | None
    _lock: threading.Lock
    _layers: LayerTable
    _own: set[str]

    def _channels(self, layer: str) -> int | None:
        raise NotImplementedError

    def _install(self, entry: LayerEntry, baseline: Baseline) -> bool:
        raise NotImplementedError

    def load(self) -> int:
        """Reload saved baselines and recreate their taps; returns how many."""
        if not self.baseline_dir:
            return 0
        known = {name: self._channels(name) for name in self.control.host.layer_names}
        baselines, errors = load_baselines(self.baseline_dir, known)
        for err in errors:
            self._refused(err)
        by_tap: dict[tuple[str, str, int], list[Baseline]] = {}
        for b in baselines:
            by_tap.setdefault((b.tap, b.point, b.derive), []).append(b)
        loaded = 0
        taken: set[str] = set()
        for (tap_id, point, derive), group in by_tap.items():
            if tap_id in taken:  # its entries would replace the first group's
                self._refused(f"{tap_id}: its files name more than one point or derive "
                              f"({len(group)} file(s) at {point!r}, derive {derive} skipped)")
                continue
            taken.add(tap_id)
            selector = "re:" + "|".join(re.escape(layer) for layer in dict.fromkeys(b.layer for b in group))
            per_channel = not derive and all(b.channel_mean is not None or (b.null is not None and b.null.features > 0)
                                             for b in group)
            spec = pb.TapSpec(name=tap_id, selector=selector, point=POINT_BY_NAME[point],
                              reducers=layer_reducers(per_channel=per_channel), derive=derive)
            with self._lock:
                for b in group:
                    self._layers.setdefault((tap_id, b.layer), {})[b.phase] = LayerEntry(
                        tap_id, b.layer, point, b.passes, b.window, b.thresholds, phase=b.phase,
                        per_channel=b.channel_mean is not None, derive=derive)
            try:
                tap = self.control.create(spec, forever=True, trusted_selector=True)
                self._own.add(tap_id)
            except Exception as exc:  # noqa: BLE001 - one bad group must not stop start-up
                self._refused(f"{tap_id}: cannot recreate its tap: {exc}")
                with self._lock:
                    for b in group:
                        self._layers.pop((tap_id, b.layer), None)
                continue
            for b in group:
                self._layers[(tap_id, b.layer)][b.phase].handle = tap
            for b in group:
                try:
                    if self._install(self._layers[(tap_id, b.layer)][b.phase], b):
                        loaded += 1
                except Exception as exc:  # noqa: BLE001 - a bad file is skipped and counted, never stops start-up
                    self._refused(f"{tap_id}/{b.layer} ({b.phase}): cannot install its baseline: {exc}")
                    with self._lock:
                        self._layers.get((tap_id, b.layer), {}).pop(b.phase, None)
                        if not self._layers.get((tap_id, b.layer), True):
                            self._layers.pop((tap_id, b.layer), None)
        if loaded:
            log.info("reloaded %d baseline(s) from %s", loaded, self.baseline_dir)
        return loaded

    def _refused(self, msg: str) -> None:
        """A file (or a tap's group of files) not loaded: logged and counted, start-up goes on."""
        log.error("baseline refused: %s", msg)
        if self._on_load_error is not None:
            self._on_load_error(msg)
