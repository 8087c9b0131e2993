"""Build the flight recorder from the server's flags (one call from the app)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from layertap.server.config import ServerConfig
from layertap.server.drift.monitor import DriftMonitor
from layertap.server.record.recorder import Recorder
from layertap.server.record.store import IncidentStore, RingLimits
from layertap.server.record.triggers import TriggerCheck
from layertap.server.taps.engine import TapEngine

MIB = 1 << 20


def start_recorder(config: ServerConfig, taps: TapEngine, drift: DriftMonitor,
                   registry: CollectorRegistry | None, model_name: str) -> Recorder | None:
    """The recorder as a sink of ``taps``, or None without ``--incident-dir``.

    Either way a sink answers for a spec's triggers: the recorder validates
    them, and without it :class:`TriggerCheck` refuses them.

    Raises:
        ValueError: A flag out of range, ``--incident-max-file-bytes`` above ``--incident-max-bytes``,
            or ``--record-inputs`` without ``--incident-dir``.
    """
    if config.record_inputs < 0:
        raise ValueError(f"--record-inputs {config.record_inputs}: must be >= 0 MiB")
    if not config.incident_dir:
        if config.record_inputs:
            raise ValueError("--record-inputs needs --incident-dir: retained inputs are only kept for incidents")
        taps.sinks.add(TriggerCheck())
        return None
    if taps.host.training:
        raise ValueError("--incident-dir: a training agent cannot replay inputs (it only observes the loop's steps)")
    for flag, value in (("--incident-max-count", config.incident_max_count),
                        ("--incident-max-bytes", config.incident_max_bytes),
                        ("--incident-max-file-bytes", config.incident_max_file_bytes),
                        ("--incident-max-age", config.incident_max_age)):
        if not value > 0:
            raise ValueError(f"{flag} {value}: must be > 0")
    if config.incident_max_file_bytes > config.incident_max_bytes:
        raise ValueError(f"--incident-max-file-bytes {config.incident_max_file_bytes} must be <= --incident-max-bytes "
                         f"{config.incident_max_bytes}: an incident that size would be evicted as soon as it is written")
    store = IncidentStore(config.incident_dir, RingLimits(
        max_count=config.incident_max_count, max_bytes=config.incident_max_bytes,
        max_incident_bytes=config.incident_max_file_bytes, max_age_seconds=config.incident_max_age))
    return taps.sinks.add(Recorder(taps, store, record_bytes=config.record_inputs * MIB, drift=drift,
                                   registry=registry, model_name=model_name))
