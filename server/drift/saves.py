"""Frozen baselines on disk: the monitor's writes, their retries, and the files of deleted baselines.

A mixin of :class:`~layertap.server.drift.monitor.DriftMonitor` that reads
only the attributes it declares, so this module imports nothing downstream.
A write that fails (a full disk) leaves the baseline UNSAVED, though it
scores drift as usual; the server's housekeeping retries it with backoff
(:meth:`BaselineSaves.retry_saves`), whether or not traffic flows. A deleted
or replaced baseline's file goes, or it would come back at the next start
(:mod:`.reload`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from layertap.server.drift.files import baseline_filename
from layertap.server.drift.layer import LayerEntry

__all__ = ["BaselineSaves"]

log = logging.getLogger("layertap.server")


class BaselineSaves:
    """``_save()``, ``retry_saves()``, ``unsaved()`` and ``_remove_files()`` over ``--baseline-dir``."""

    baseline_dir: str | None
    _on_save_error: Callable[[str], None] | None
    _clock: Callable[[], float]
    _lock: threading.Lock

    def _all(self) -> list[LayerEntry]:
        raise NotImplementedError

    def _save(self, entry: LayerEntry) -> bool:
        """Write the entry's baseline file (caller holds ``_lock``); on failure it is UNSAVED (see ``LayerEntry.save``)."""
        if entry.save(self.baseline_dir, self._clock()):
            return True
        if self._on_save_error is not None:
            self._on_save_error(entry.save_error)
        return False

    def retry_saves(self) -> int:
        """Retry writing every UNSAVED baseline whose backoff has passed; returns how many are still unsaved.

        Called once a second by the server's housekeeping thread, so a baseline
        is saved once the disk has room again whether or not traffic flows.
        """
        now = self._clock()
        with self._lock:
            entries = self._all()
            for e in entries:
                if e.save_error and e.baseline is not None and e.retry_at <= now:
                    self._save(e)
            return sum(1 for e in entries if e.save_error)

    def final_saves(self) -> list[LayerEntry]:
        """At shutdown: one last write of every unsaved baseline, backoff or not; returns those still
        unsaved, which the stopping server loses (it logs and counts them)."""
        with self._lock:
            entries = self._all()
            for e in entries:
                if e.save_error and e.baseline is not None:
                    self._save(e)
            return [e for e in entries if e.save_error]

    def unsaved(self) -> int:
        """Frozen baselines whose file is not written yet (``layertap_baselines_unsaved``)."""
        with self._lock:
            return sum(1 for e in self._all() if e.save_error)

    def _remove_files(self, gone: list[LayerEntry]) -> None:
        """Delete the files of these entries' baselines (their tap was deleted or replaced)."""
        if self.baseline_dir:
            for entry in gone:
                if entry.baseline is not None:
                    path = Path(self.baseline_dir) / baseline_filename(entry.baseline)
                    try:
                        path.unlink(missing_ok=True)
                    except OSError as exc:
                        log.error("cannot remove baseline file %s: %s", path, exc)
