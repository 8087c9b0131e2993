"""Baseline files: one JSON document per (tap, layer, point, phase), never pickle.

Writes are atomic (temporary file in the same directory, fsync,
``os.replace``, fsync of the directory) so a crash never leaves a torn file,
and loading refuses a bad file with a message rather than failing start-up.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from layertap.server.drift.baseline import Baseline
from layertap.server.drift.phases import FORWARD
from layertap.server.drift.schema import BaselineFormatError, KnownLayers, baseline_from_dict, baseline_to_dict

__all__ = ["baseline_filename", "load_baselines", "save_baseline"]


def baseline_filename(b: Baseline) -> str:
    """A stable, filesystem-safe file name for ``b``'s (tap, layer, point, phase).

    A forward baseline keeps the name v1 servers gave it (no phase in it), so
    saving it again replaces its old file instead of leaving a duplicate.
    """
    key = b.key if b.phase != FORWARD else b.key[:3]
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", ".".join(key[1:]))[:120]
    digest = hashlib.sha256("\0".join(key).encode()).hexdigest()[:12]
    return f"baseline-{safe}-{digest}.json"


def save_baseline(path_dir: str | os.PathLike[str], baseline: Baseline) -> Path:
    """Write ``baseline`` atomically as JSON into ``path_dir`` (created if needed).

    A crash leaves either the old file or the new one, never a torn file: the
    document goes to a temporary file in the same directory, is fsynced, and
    replaces the target with ``os.replace``; the directory is fsynced so the
    rename itself survives power loss.

    Returns:
        The path written.

    Raises:
        ValueError: When the baseline holds non-finite numbers.
        OSError: When the directory is not writable.
    """
    d = Path(path_dir)
    d.mkdir(parents=True, exist_ok=True)
    target = d / baseline_filename(baseline)
    text = json.dumps(baseline_to_dict(baseline), allow_nan=False, indent=1)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=d)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:
        dfd = os.open(d, os.O_RDONLY)
    except OSError:  # e.g. platforms without directory fds
        return target
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return target


def _reject_constant(name: str) -> Any:
    raise BaselineFormatError(f"non-finite number {name} in JSON")


def load_baselines(
    path_dir: str | os.PathLike[str],
    known_layers: KnownLayers | None = None,
) -> tuple[list[Baseline], list[str]]:
    """Load every ``*.json`` baseline in ``path_dir``; never raises for a bad file.

    Args:
        path_dir: The ``--baseline-dir``; a missing directory loads nothing.
        known_layers: Module names of the served model (a mapping may add the
            expected channel count per layer); None accepts any layer.

    Returns:
        ``(baselines, errors)``: one one-line message per refused file, for the
        server to log and count in ``layertap_baseline_load_errors_total``.
    """
    d = Path(path_dir)
    if not d.is_dir():
        return [], []
    out: list[Baseline] = []
    errors: list[str] = []
    seen: set[tuple[str, str, str, str]] = set()
    for p in sorted(d.glob("*.json")):
        if p.name.startswith(".tmp-"):
            continue  # a write interrupted before os.replace
        try:
            doc = json.loads(p.read_text(encoding="utf-8"), parse_constant=_reject_constant)
            b = baseline_from_dict(doc, known_layers)
            if b.key in seen:
                raise BaselineFormatError(f"duplicate baseline for tap {b.tap!r} layer {b.layer!r} point {b.point!r} "
                                          f"phase {b.phase!r}")
            seen.add(b.key)
            out.append(b)
        except json.JSONDecodeError as exc:
            errors.append(f"baseline file {p} refused: corrupt JSON ({exc.msg} at line {exc.lineno} column {exc.colno})")
        except (BaselineFormatError, UnicodeDecodeError, OSError, ValueError, TypeError, RecursionError) as exc:
            errors.append(f"baseline file {p} refused: {exc}")
    return out, errors
